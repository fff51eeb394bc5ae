"""hivemind's DHT side: a record validator, the allowlist authorizer, a key read from disk, routing-table access.
See the package docstring for why each exists."""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence

import hivemind
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils import get_dht_time
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- DHT records

MAX_RECORD_BYTES = 16 * 1024  # LeanHive's and hivemind's own records are well under 2 KiB


class RecordSizeValidator(RecordValidatorBase):
    """Refuses records whose key, subkey and value together exceed ``max_bytes``, so that a hostile peer cannot
    fill honest peers' memory (or their answers to others) with large records under keys no schema covers."""

    def __init__(self, max_bytes: int = MAX_RECORD_BYTES):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes

    def validate(self, record: DHTRecord) -> bool:
        size = len(record.key) + len(record.subkey or b"") + len(record.value)
        if size > self.max_bytes:
            logger.debug("Refused a DHT record of %d bytes (limit %d)", size, self.max_bytes)
            return False
        return True

    @property
    def priority(self) -> int:
        return 100  # the cheapest check goes first, before signatures are verified or values parsed

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, RecordSizeValidator):
            return False
        self.max_bytes = min(self.max_bytes, other.max_bytes)
        return True


MAX_CLOCK_SKEW = 60.0  # seconds another peer's clock (DHT time) may be ahead of ours


@dataclass(frozen=True)
class KeyRule:
    """What a record under one of the swarm's keys may look like.

    ``entries``: "signed" (subkey carries the owner's public key; schema and signature are checked by the
    SchemaValidator / RSASignatureValidator), "peer_priority" (subkey: a libp2p peer ID, value: None or a finite
    number; hivemind's state-sharing declarations) or "peer_flag" (subkey: a peer ID, value: a bool; hivemind's
    matchmaking declarations). ``max_ttl``: how far beyond now (plus ``MAX_CLOCK_SKEW``) a record may expire.
    """

    name: str
    entries: str
    max_ttl: float


def _is_peer_id(raw: bytes) -> bool:
    # a libp2p peer ID is a multihash: identity (0x00, small keys) or sha2-256 (0x12), then the digest length
    return isinstance(raw, bytes) and 2 < len(raw) <= 130 and raw[0] in (0x00, 0x12) and raw[1] == len(raw) - 2


class SwarmKeyValidator(RecordValidatorBase):
    """Every key the swarm reads only takes per-peer entries (one subkey per peer, in the key's form) that expire
    within the key's bound: hivemind lets a plain value with a later expiration replace a whole dictionary, so
    without this one record with an expiration years ahead locks every honest declaration out of a key (key
    squatting). Keys this validator does not know are left to the other validators."""

    def __init__(self, rules: Mapping[str, KeyRule]):
        self._rules: Dict[bytes, KeyRule] = {DHTID.generate(source=key).to_bytes(): rule for key, rule in rules.items()}

    def validate(self, record: DHTRecord) -> bool:
        rule = self._rules.get(record.key)
        if rule is None:
            return True
        problem = self._problem(rule, record)
        if problem is not None:
            logger.debug("Refused a record under %s: %s", rule.name, problem)
            return False
        return True

    @staticmethod
    def _problem(rule: KeyRule, record: DHTRecord) -> Optional[str]:
        if record.subkey == DHTProtocol.IS_REGULAR_VALUE:
            return "a plain value where only per-peer entries (subkeys) are allowed"
        latest = get_dht_time() + rule.max_ttl + MAX_CLOCK_SKEW
        if not record.expiration_time <= latest:
            return f"expiration {record.expiration_time} is more than {rule.max_ttl:g} s (+ clock skew) ahead"
        if rule.entries == "signed":
            return None
        try:
            subkey, value = MSGPackSerializer.loads(record.subkey), MSGPackSerializer.loads(record.value)
        except Exception as e:  # noqa: BLE001 - any undecodable record is refused
            return f"undecodable subkey or value ({e!r})"
        if not _is_peer_id(subkey):
            return "the subkey is not a peer ID"
        if rule.entries == "peer_flag":
            return None if isinstance(value, bool) else f"value {value!r} is not a bool"
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is None or (number and math.isfinite(value)):
            return None
        return f"value {value!r} is neither None nor a finite number"

    @property
    def priority(self) -> int:
        return 5  # after the signature validator (10) stripped its signature

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, SwarmKeyValidator):
            return False
        self._rules.update(other._rules)
        return True


def private_key_from_der(der: bytes) -> RSAPrivateKey:
    """An RSAPrivateKey around a DER-encoded key (hivemind has no public constructor for one read from disk)."""
    from cryptography.hazmat.primitives import serialization

    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = serialization.load_der_private_key(der, password=None)
    return key


# -------------------------------------------------------------------------------------------- authorization


class AllowlistAuthorizer(TokenAuthorizerBase):
    """hivemind's token protocol (signed requests/responses, fresh nonces) with an allowlist instead of an
    authority: a token is valid when its public key is in the allowlist (a ``peer.swarm.auth.Allowlist``)."""

    def __init__(self, private_key: RSAPrivateKey, allowlist):
        super().__init__(private_key)
        self.allowlist = allowlist

    async def get_token(self) -> AccessToken:
        return AccessToken(
            username="", public_key=self.local_public_key.to_bytes(), expiration_time="never", signature=b""
        )

    def is_token_valid(self, access_token: AccessToken) -> bool:
        return access_token.public_key in self.allowlist.public_keys

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return False


def authorized_peer_ids(dht: hivemind.DHT) -> Optional[FrozenSet[str]]:
    """Peer IDs allowed to call this peer's averagers, or None when authorization is off."""
    authorizer = getattr(dht, "kwargs", {}).get("authorizer")
    return authorizer.allowlist.peer_ids if isinstance(authorizer, AllowlistAuthorizer) else None


# ---------------------------------------------------------------------------------------------- DHT routing


async def routing_table_peers(_dht, node) -> List[str]:
    """Peer IDs (base58) in the node's routing table; run with ``dht.run_coroutine``."""
    return [peer_id.to_base58() for peer_id in node.protocol.routing_table.uid_to_peer_id.values()]


async def ping_peers(_dht, node, peer_ids: Sequence[str]) -> List[str]:
    """Ping these peers at once; the ones that answer are back in the routing table and off the blacklist."""

    async def ping_one(text: str) -> Optional[str]:
        peer_id = PeerID.from_base58(text)
        if await node.protocol.call_ping(peer_id) is None:
            return None
        if peer_id in node.blacklist:
            node.blacklist.register_success(peer_id)
        return text

    answers = await asyncio.gather(*(ping_one(text) for text in peer_ids), return_exceptions=True)
    return [answer for answer in answers if isinstance(answer, str)]
