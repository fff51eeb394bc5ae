"""Authorization: only the peers listed in an allowlist file may use the swarm's DHT and join its averaging.

The file (``--authorized_keys``) has one line per peer, like SSH's authorized_keys::

    12D3KooWAbc... ssh-rsa AAAAB3NzaC1yc2E... alice-gpu

the peer's libp2p ID and the public half of its signing key, then an optional name. Every peer logs its
own line at start (with a stable ``--identity_path``); ``python -m peer.auth --identity_path PATH`` prints
it without joining anything. Two checks, both on the receiving side:

- DHT requests and responses are signed with the signing key (hivemind's authorizer protocol: signature,
  time and nonce); requests from keys not in the file get no answer, so an unlisted peer can neither
  store records (metrics, progress) nor read them, nor even bootstrap;
- averaging RPCs (matchmaking, all-reduce parts, state downloads) carry no such field, so they are
  checked by the caller's libp2p peer ID, which the encrypted libp2p connection authenticates.
"""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import FrozenSet, Optional

import hivemind
from hivemind.p2p import PeerID
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

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
            raise AuthorizationError(f"--authorized_keys {path}: cannot read it ({e.strerror}); give the path of "
                                     f"a file with one line per peer: {FORMAT_HELP}") from None
        peer_ids, keys = set(), set()
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            if len(fields) < 3 or fields[1] != "ssh-rsa":
                raise AuthorizationError(f"--authorized_keys {path}, line {number}: expected {FORMAT_HELP}; "
                                         f"got {raw.strip()[:80]!r}")
            key = f"{fields[1]} {fields[2]}".encode()
            try:
                PeerID.from_base58(fields[0])
                RSAPublicKey.from_bytes(key)
            except Exception as e:
                raise AuthorizationError(f"--authorized_keys {path}, line {number}: not a valid peer ID and RSA "
                                         f"public key ({e}); copy the line the peer logs at start") from None
            peer_ids.add(fields[0])
            keys.add(key)
        if not peer_ids:
            raise AuthorizationError(f"--authorized_keys {path} lists no peer; add one line per peer: {FORMAT_HELP}")
        return cls(frozenset(peer_ids), frozenset(keys))


def allowlist_line(peer_id: str, public_key: RSAPublicKey, name: str = "") -> str:
    """The line that authorizes one peer."""
    return f"{peer_id} {public_key.to_bytes().decode()} {name}".rstrip()


class AllowlistAuthorizer(TokenAuthorizerBase):
    """hivemind's token protocol (signed requests/responses, fresh nonces) with an allowlist instead of an
    authority: a token is valid when its public key is in the allowlist."""

    def __init__(self, private_key: RSAPrivateKey, allowlist: Allowlist):
        super().__init__(private_key)
        self.allowlist = allowlist

    async def get_token(self) -> AccessToken:
        return AccessToken(username="", public_key=self.local_public_key.to_bytes(), expiration_time="never",
                           signature=b"")

    def is_token_valid(self, access_token: AccessToken) -> bool:
        return access_token.public_key in self.allowlist.public_keys

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return False


def make_authorizer(network_args) -> AllowlistAuthorizer:
    """The DHT authorizer of a peer started with ``--authorized_keys``; its own signing key must be listed."""
    from peer.network import load_or_create_signing_key, signing_key_path

    path = network_args.authorized_keys
    allowlist = Allowlist.load(path)
    private_key = load_or_create_signing_key(signing_key_path(network_args))
    if private_key.get_public_key().to_bytes() not in allowlist.public_keys:
        raise AuthorizationError(f"this peer is not in --authorized_keys {path}; the run owner must add its line:\n"
                                 f"{identity_line(network_args)}")
    return AllowlistAuthorizer(private_key, allowlist)


def check_own_peer_id(dht: hivemind.DHT, authorizer: AllowlistAuthorizer, path: str) -> None:
    peer_id = dht.peer_id.to_base58()
    if peer_id not in authorizer.allowlist.peer_ids:
        line = allowlist_line(peer_id, authorizer.local_public_key)
        raise AuthorizationError(f"this peer's ID is not in --authorized_keys {path}; the run owner must add:\n"
                                 f"{line}")
    logger.info("Authorization on: %d peers allowed; this peer's line:\n%s", len(authorizer.allowlist.peer_ids),
                allowlist_line(peer_id, authorizer.local_public_key))


def authorized_peer_ids(dht: hivemind.DHT) -> Optional[FrozenSet[str]]:
    """Peer IDs allowed to call this peer's averagers, or None when authorization is off."""
    authorizer = getattr(dht, "kwargs", {}).get("authorizer")
    return authorizer.allowlist.peer_ids if isinstance(authorizer, AllowlistAuthorizer) else None


# ------------------------------------------------------------------------------------------ averaging RPCs


class _AllowlistServicer:
    """Registered by ``add_p2p_handlers`` instead of the averager: each rpc_* first checks the caller's peer ID."""

    def __init__(self, servicer, allowed: FrozenSet[str]):
        self._servicer, self._allowed = servicer, allowed
        servicer._collect_rpc_handlers()
        self._streaming = {handler.method_name: handler.stream_output for handler in servicer._rpc_handlers}

    def __getattr__(self, name: str):
        method = getattr(self._servicer, name)
        if not name.startswith("rpc_"):
            return method
        allowed = self._allowed

        def refuse(context) -> bool:
            if context.remote_id.to_base58() in allowed:
                return False
            logger.warning("Refused %s from %s: not in --authorized_keys", name, context.remote_id)
            return True

        if self._streaming.get(name, False):
            async def checked_stream(request, context):
                if refuse(context):
                    raise PermissionError(f"{context.remote_id} is not authorized to call {name}")
                async for item in method(request, context):
                    yield item
            return checked_stream

        async def checked(request, context):
            if refuse(context):
                raise PermissionError(f"{context.remote_id} is not authorized to call {name}")
            return await method(request, context)
        return checked


class AuthorizedAveragerMixin:
    """For hivemind averagers: ``authorized_peers`` (peer IDs, or None for everyone) may call its RPCs."""

    def __init__(self, *args, authorized_peers: Optional[FrozenSet[str]] = None, **kwargs):
        self.authorized_peers = authorized_peers  # before super().__init__, which forks the averager process
        super().__init__(*args, **kwargs)

    async def add_p2p_handlers(self, p2p, wrapper=None, *, namespace=None, balanced=False):
        if self.authorized_peers is not None and wrapper is None:
            wrapper = _AllowlistServicer(self, self.authorized_peers)
        return await super().add_p2p_handlers(p2p, wrapper, namespace=namespace, balanced=balanced)


# ---------------------------------------------------------------------------------------------- CLI


def identity_line(network_args, name: str = "") -> str:
    """The allowlist line of the peer that runs with these NetworkArguments (creates its keys if missing)."""
    from hivemind.p2p import P2P, PeerID

    from peer.network import load_or_create_signing_key, signing_key_path

    if network_args.identity_path is None:
        raise AuthorizationError("authorization needs a stable identity: give the peer an --identity_path")
    path = Path(network_args.identity_path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    peer_id = PeerID.from_identity(path.read_bytes())
    key = load_or_create_signing_key(signing_key_path(network_args))
    return allowlist_line(peer_id.to_base58(), key.get_public_key(), name)


def main(argv=None) -> None:
    """Print a peer's --authorized_keys line (creating its identity and signing key if missing)."""
    from peer.network import NetworkArguments

    parser = argparse.ArgumentParser(prog="python -m peer.auth", description=main.__doc__)
    parser.add_argument("--identity_path", required=True, help="the peer's --identity_path")
    parser.add_argument("--name", default="", help="a comment at the end of the line (e.g. the volunteer's name)")
    args = parser.parse_args(argv)
    print(identity_line(NetworkArguments(identity_path=args.identity_path), args.name))


if __name__ == "__main__":
    main()
