"""Authorization: only the peers listed in an allowlist file may use the swarm's DHT and join its averaging.

The file (``--authorized_keys``) has one line per peer, like SSH's authorized_keys::

    12D3KooWAbc... ssh-rsa AAAAB3NzaC1yc2E... alice-gpu

the peer's libp2p ID and the public half of its signing key, then an optional name. Every peer logs its
own line at start (with a stable ``--identity_path``); ``python -m peer.swarm.auth --identity_path PATH`` prints
it without joining anything. Two checks, both on the receiving side:

- DHT requests and responses are signed with the signing key (hivemind's authorizer protocol: signature,
  time and nonce); requests from keys not in the file get no answer, so an unlisted peer can neither
  store records (metrics, progress) nor read them, nor even bootstrap;
- averaging RPCs (matchmaking, all-reduce parts, state downloads) carry no such field, so they are
  checked by the caller's libp2p peer ID, which the encrypted libp2p connection authenticates.

The hivemind side of both checks (the authorizer, the RPC wrapper) is in peer.swarm.hivemind_seam.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import FrozenSet, Optional

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.utils.crypto import RSAPublicKey

from peer.swarm.hivemind_seam import AllowlistAuthorizer
from peer.swarm.identity import load_or_create_signing_key, signing_key_path

logger = logging.getLogger(__name__)

FORMAT_HELP = "'<peer ID> ssh-rsa <base64 key> [name]', e.g. 12D3KooWAbc... ssh-rsa AAAAB3NzaC1yc2E... alice"


class AuthorizationError(ValueError):
    """The allowlist file is missing or malformed, or this peer is not in it; the message says how to fix it."""


@dataclass(frozen=True)
class Allowlist:
    peer_ids: FrozenSet[str]
    """libp2p peer IDs (base58) allowed to call this peer's averaging RPCs."""
    public_keys: FrozenSet[bytes]
    """Signing keys (``RSAPublicKey.to_bytes()``: b"ssh-rsa AAAA...") allowed to use the DHT."""

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Allowlist":
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise AuthorizationError(
                f"--authorized_keys {path}: cannot read it ({e.strerror}); give the path of "
                f"a file with one line per peer: {FORMAT_HELP}"
            ) from None
        peer_ids, keys = set(), set()
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            if len(fields) < 3 or fields[1] != "ssh-rsa":
                raise AuthorizationError(
                    f"--authorized_keys {path}, line {number}: expected {FORMAT_HELP}; got {raw.strip()[:80]!r}"
                )
            key = f"{fields[1]} {fields[2]}".encode()
            try:
                PeerID.from_base58(fields[0])
                RSAPublicKey.from_bytes(key)
            except Exception as e:
                raise AuthorizationError(
                    f"--authorized_keys {path}, line {number}: not a valid peer ID and RSA "
                    f"public key ({e}); copy the line the peer logs at start"
                ) from None
            peer_ids.add(fields[0])
            keys.add(key)
        if not peer_ids:
            raise AuthorizationError(f"--authorized_keys {path} lists no peer; add one line per peer: {FORMAT_HELP}")
        return cls(frozenset(peer_ids), frozenset(keys))


def allowlist_line(peer_id: str, public_key: RSAPublicKey, name: str = "") -> str:
    """The line that authorizes one peer."""
    return f"{peer_id} {public_key.to_bytes().decode()} {name}".rstrip()


def make_authorizer(path: str, identity_path: Optional[str]) -> AllowlistAuthorizer:
    """The DHT authorizer of a peer started with ``--authorized_keys path``; its own signing key must be listed."""
    allowlist = Allowlist.load(path)
    private_key = load_or_create_signing_key(signing_key_path(identity_path))
    if private_key.get_public_key().to_bytes() not in allowlist.public_keys:
        raise AuthorizationError(
            f"this peer is not in --authorized_keys {path}; the run owner must add its line:\n"
            f"{identity_line(identity_path)}"
        )
    return AllowlistAuthorizer(private_key, allowlist)


def check_own_peer_id(dht: hivemind.DHT, authorizer: AllowlistAuthorizer, path: str) -> None:
    peer_id = dht.peer_id.to_base58()
    if peer_id not in authorizer.allowlist.peer_ids:
        line = allowlist_line(peer_id, authorizer.local_public_key)
        raise AuthorizationError(f"this peer's ID is not in --authorized_keys {path}; the run owner must add:\n{line}")
    logger.info(
        "Authorization on: %d peers allowed; this peer's line:\n%s",
        len(authorizer.allowlist.peer_ids),
        allowlist_line(peer_id, authorizer.local_public_key),
    )


# ---------------------------------------------------------------------------------------------- CLI


def identity_line(identity_path: Optional[str], name: str = "") -> str:
    """The allowlist line of the peer that runs with this --identity_path (creates its keys if missing)."""
    if identity_path is None:
        raise AuthorizationError("authorization needs a stable identity: give the peer an --identity_path")
    path = Path(identity_path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    peer_id = PeerID.from_identity(path.read_bytes())
    key = load_or_create_signing_key(signing_key_path(identity_path))
    return allowlist_line(peer_id.to_base58(), key.get_public_key(), name)


def main(argv=None) -> None:
    """Print a peer's --authorized_keys line (creating its identity and signing key if missing)."""
    parser = argparse.ArgumentParser(prog="python -m peer.swarm.auth", description=main.__doc__)
    parser.add_argument("--identity_path", required=True, help="the peer's --identity_path")
    parser.add_argument("--name", default="", help="a comment at the end of the line (e.g. the volunteer's name)")
    args = parser.parse_args(argv)
    print(identity_line(args.identity_path, args.name))


if __name__ == "__main__":
    main()
