"""Print a peer's multiaddr from its libp2p identity file: /dns4/HOST/tcp/PORT/p2p/<peer id>.

Used by docker/compose.yaml so trainers find the aux peer by its stable identity.
"""

import sys

from hivemind.p2p import PeerID


def peer_id_from_identity(path: str) -> str:
    with open(path, "rb") as f:
        return PeerID.from_identity(f.read()).to_base58()


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: peer_address.py HOST PORT IDENTITY_PATH")
    host, port, identity = sys.argv[1:]
    print(f"/dns4/{host}/tcp/{port}/p2p/{peer_id_from_identity(identity)}")
