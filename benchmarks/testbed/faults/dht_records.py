"""Crafting DHT records byte by byte, as a hostile peer would, and sending them straight to one honest peer.

``hivemind.DHT.store`` serializes and signs values itself, so it cannot produce a forged signature or a
record for someone else's key; ``raw_store`` calls the store RPC with exactly the bytes given.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Union

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.testbed.hivemind_faults import record_bytes_to_sign


@dataclass
class CraftedRecord:
    key: str
    """The DHT key as peers name it (e.g. 'run_metrics'); its DHTID is what goes on the wire."""
    subkey: object
    """The dictionary subkey (e.g. a b'[owner:ssh-rsa ...]' public key marker), serialized like hivemind does."""
    value: bytes
    """The serialized value, with a signature suffix or not."""
    expiration: float
    repeat: int = 1
    """The value sent is ``value * repeat``, built in the DHT process (a DHT's command pipe chokes on large
    arguments, so a 1 MiB record is made where it is sent)."""

    @property
    def key_bytes(self) -> bytes:
        return DHTID.generate(source=self.key).to_bytes()

    @property
    def subkey_bytes(self) -> bytes:
        return MSGPackSerializer.dumps(self.subkey)


def craft(key: str, subkey, value, *, ttl: float = 60.0) -> CraftedRecord:
    """An unsigned record (``value`` serialized with hivemind's serializer unless it is bytes already)."""
    raw = value if isinstance(value, bytes) else MSGPackSerializer.dumps(value)
    return CraftedRecord(key, subkey, raw, get_dht_time() + ttl)


def signed(record: CraftedRecord, key: RSAPrivateKey) -> CraftedRecord:
    """``record`` with an RSA signature by ``key`` over it, exactly as RSASignatureValidator computes one (it
    verifies only if the subkey names that key's owner)."""
    validator = RSASignatureValidator(key)
    dht_record = DHTRecord(record.key_bytes, record.subkey_bytes, record.value, record.expiration)
    signature = key.sign(record_bytes_to_sign(validator, dht_record))
    return CraftedRecord(record.key, record.subkey, record.value + b"[signature:" + signature + b"]", record.expiration)


def owner_marker(key: RSAPrivateKey) -> bytes:
    """The subkey under which only ``key``'s owner may write (what publish_metrics uses)."""
    return RSASignatureValidator(key).local_public_key


async def _store(
    _dht, node, peer: str, key: str, subkey, value: bytes, repeat: int, expiration: float
) -> Optional[bool]:
    from hivemind.p2p import PeerID

    result = await node.protocol.call_store(
        PeerID.from_base58(peer), [DHTID.generate(source=key)], [value * repeat], [expiration], subkeys=[subkey]
    )
    return None if result is None else bool(result[0])


def raw_store(
    sender: hivemind.DHT, receiver: Union[hivemind.DHT, str], record: CraftedRecord, timeout: float = 20.0
) -> Optional[bool]:
    """Ask ``receiver`` (a DHT or a peer ID) through ``sender``'s node to store ``record``; True/False as it
    answers, None if it did not answer at all (e.g. to an unauthorized sender)."""
    peer = receiver if isinstance(receiver, str) else receiver.peer_id.to_base58()
    call = functools.partial(
        _store,
        peer=peer,
        key=record.key,
        subkey=record.subkey,
        value=record.value,
        repeat=record.repeat,
        expiration=record.expiration,
    )
    return sender.run_coroutine(call, return_future=True).result(timeout)
