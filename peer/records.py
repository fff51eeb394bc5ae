"""Limits on the DHT records every peer accepts, whatever their key (schemas only cover known keys)."""
from __future__ import annotations

import logging

from hivemind.dht.validation import DHTRecord, RecordValidatorBase

logger = logging.getLogger(__name__)

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
