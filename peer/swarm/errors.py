"""Errors a peer reports to the user instead of a traceback."""


class NetworkSetupError(RuntimeError):
    """The peer could not join or start the swarm; the message says how to fix the input."""
