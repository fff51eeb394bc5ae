"""LeanHive peers: the trainer application (``cli``, ``trainer``, ``model_setup``, ``backup``) on top of the
shared swarm layer (``peer.swarm``) that the auxiliary peer uses too."""
