"""The training state as parts: what a joiner downloads from several donors at once, verified part by part.

A state is the flat list of tensors a donor serves (parameters, extra tensors, 8-bit optimizer statistics) and its
metadata (epoch, optimizer hyper-parameters). Its tensors are laid end to end as one byte string (each tensor's
bytes in order, no padding) and cut into parts of ``part_bytes`` each, the last one shorter: the partition depends
only on the layout (shapes, dtypes) and ``part_bytes``, so every peer of a run computes the same one.

Each part has a digest (SHA-256 of its bytes); the metadata has one (of its serialized form); the root digest covers
both. A donor announces a ``Manifest`` (epoch, sizes, every digest); donors that hold the same state announce the
same root. A joiner downloads the parts of one root from several donors (``PartSchedule``), checks each part's size
and digest against the manifest before keeping it, and builds tensors only from a complete, verified byte string.

No hivemind here: the seam (``peer.swarm.hivemind_seam.averaging``) serves and fetches parts over hivemind's P2P.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from peer.swarm.validate import integer_at_least, require

DEFAULT_PART_BYTES = 4 << 20
"""4 MiB: ~190 parts for the ``small`` preset's 747 MB, 3.4 s each over 10 Mbit/s (a slow donor's last part delays
the end by at most that), and a request per part costs one round trip."""
MIN_PART_BYTES = 16 << 10
MAX_PART_BYTES = 64 << 20
"""A manifest's part size must lie between these (a joiner holds one part per donor in memory while it checks it)."""
SPREAD_PARTS = 48
"""A state smaller than this many default parts is cut into this many smaller ones: ``tiny``'s 5.6 MB in 4 MiB parts
is 2 parts, which at most two donors can share."""


def part_bytes_for(total_bytes: int) -> int:
    """The part size a donor cuts a state of ``total_bytes`` into: ``DEFAULT_PART_BYTES``, or for a small state the
    size that gives ``SPREAD_PARTS`` parts (at least ``MIN_PART_BYTES``). It depends on the size alone, so donors of
    one state announce the same partition."""
    return max(MIN_PART_BYTES, min(DEFAULT_PART_BYTES, math.ceil(total_bytes / SPREAD_PARTS)))


Layout = Sequence[Tuple[torch.Size, torch.dtype]]


def layout_bytes(layout: Layout) -> List[int]:
    """Bytes of each tensor of ``layout``."""
    return [torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in layout]


def part_ranges(total_bytes: int, part_bytes: int) -> List[Tuple[int, int]]:
    """[start, end) byte ranges of the parts of a state of ``total_bytes``: all ``part_bytes`` long but the last."""
    require(isinstance(part_bytes, int) and part_bytes > 0, f"part_bytes must be a positive integer, got {part_bytes}")
    count = max(1, math.ceil(total_bytes / part_bytes))
    return [(i * part_bytes, min((i + 1) * part_bytes, total_bytes)) for i in range(count)]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes end to end, as one uint8 tensor (a copy)."""
    views = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(views) if views else torch.empty(0, dtype=torch.uint8)


def unflatten(buffer: torch.Tensor, layout: Layout) -> List[torch.Tensor]:
    """The tensors of ``layout`` from their bytes end to end (``flatten``'s inverse); the sizes must add up."""
    sizes = layout_bytes(layout)
    require(buffer.numel() == sum(sizes), f"the state has {buffer.numel()} bytes, its layout {sum(sizes)}")
    tensors, offset = [], 0
    for (shape, dtype), size in zip(layout, sizes):
        # a copy: a view of the shared buffer would need each tensor's offset aligned to its element size
        chunk = buffer[offset : offset + size].clone()
        tensors.append(chunk.view(dtype).reshape(shape))
        offset += size
    return tensors


def digest(data) -> bytes:
    """SHA-256 of a bytes-like object or of a uint8 tensor's bytes."""
    if isinstance(data, torch.Tensor):
        data = data.contiguous().numpy()
    return hashlib.sha256(data).digest()


def root_digest(epoch: int, metadata_digest: bytes, part_bytes: int, total_bytes: int, parts: Sequence[bytes]) -> bytes:
    """The digest of a whole state: its epoch, metadata, partition and every part's digest."""
    h = hashlib.sha256(f"leanhive-state-v1/{epoch}/{part_bytes}/{total_bytes}/".encode())
    h.update(metadata_digest)
    for part in parts:
        h.update(part)
    return h.digest()


@dataclass(frozen=True)
class Manifest:
    """What a donor announces about the state it serves: enough to verify every part and the whole."""

    epoch: int
    total_bytes: int
    part_bytes: int
    metadata_digest: bytes
    parts: Tuple[bytes, ...]
    root: bytes

    @classmethod
    def build(cls, epoch: int, metadata_bytes: bytes, buffer: torch.Tensor, part_bytes: int) -> "Manifest":
        parts = tuple(digest(buffer[start:end]) for start, end in part_ranges(buffer.numel(), part_bytes))
        meta = digest(metadata_bytes)
        root = root_digest(epoch, meta, part_bytes, buffer.numel(), parts)
        return cls(epoch, buffer.numel(), part_bytes, meta, parts, root)

    def to_dict(self) -> dict:
        return dict(
            epoch=self.epoch,
            total_bytes=self.total_bytes,
            part_bytes=self.part_bytes,
            metadata_digest=self.metadata_digest,
            parts=list(self.parts),
            root=self.root,
        )

    @classmethod
    def from_dict(cls, raw, expected_total: int) -> "Manifest":
        """A manifest received from a peer, checked against this peer's state size (raises ValueError why not)."""
        require(isinstance(raw, dict), "its manifest is not a dictionary")
        epoch, total, part_bytes = raw.get("epoch"), raw.get("total_bytes"), raw.get("part_bytes")
        for name, value in (("epoch", epoch), ("total_bytes", total), ("part_bytes", part_bytes)):
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 0, f"its {name} is {value!r}")
        require(total == expected_total, f"its state has {total} bytes, this peer's {expected_total}")
        require(MIN_PART_BYTES <= part_bytes <= MAX_PART_BYTES, f"its part size {part_bytes} is out of bounds")
        parts = raw.get("parts")
        count = len(part_ranges(total, part_bytes))
        require(isinstance(parts, list) and len(parts) == count, f"its manifest does not list {count} parts")
        hashes = [raw.get("metadata_digest"), raw.get("root"), *parts]
        require(all(isinstance(h, bytes) and len(h) == 32 for h in hashes), "its manifest has malformed digests")
        manifest = cls(epoch, total, part_bytes, raw["metadata_digest"], tuple(parts), raw["root"])
        require(
            root_digest(epoch, manifest.metadata_digest, part_bytes, total, manifest.parts) == manifest.root,
            "its root digest does not cover its parts",
        )
        return manifest

    def ranges(self) -> List[Tuple[int, int]]:
        return part_ranges(self.total_bytes, self.part_bytes)


def group_by_root(manifests: Dict[object, Manifest]) -> List[List[object]]:
    """Donors grouped by the root they announce, the largest group first (ties: the higher epoch, then the group of
    the donor listed first, i.e. the best-ranked candidate): donors of one group hold the same state bit for bit; a
    donor alone against a majority is outvoted. Each group is shuffled: joiners spread over its donors."""
    groups: Dict[bytes, List[object]] = {}
    first: Dict[bytes, int] = {}
    for index, (donor, manifest) in enumerate(manifests.items()):
        groups.setdefault(manifest.root, []).append(donor)
        first.setdefault(manifest.root, index)
    ordered = sorted(groups, key=lambda root: (-len(groups[root]), -manifests[groups[root][0]].epoch, first[root]))
    result = []
    for root in ordered:
        group = groups[root]
        random.shuffle(group)
        result.append(group)
    return result


@dataclass
class PartSchedule:
    """Which donor fetches which part of one state (one root): up to ``max_donors`` donors at once.

    Each donor asks ``next_for`` for its next part: a part nobody holds or fetches, else (once none is left) a part
    another donor has been fetching longest, fetched twice so that a slow donor's last part does not hold up the end.
    A donor that fails or serves a wrong part is ``exclude``d: its parts go back to the others. ``done`` parts are
    kept across downloads of the same root (``resume``): a download cut off fetches only the missing ones."""

    count: int
    max_donors: int = 3
    done: Set[int] = field(default_factory=set)
    in_flight: Dict[int, Dict[object, float]] = field(default_factory=dict)  # part -> donor -> started
    excluded: Set[object] = field(default_factory=set)
    fetched_by: Dict[int, object] = field(default_factory=dict)

    def __post_init__(self):
        integer_at_least(self, 1, "count", "max_donors")

    @property
    def finished(self) -> bool:
        return len(self.done) == self.count

    def missing(self) -> List[int]:
        return [i for i in range(self.count) if i not in self.done]

    def next_for(self, donor, now: Optional[float] = None) -> Optional[int]:
        if donor in self.excluded or self.finished:
            return None
        now = time.monotonic() if now is None else now
        for part in range(self.count):
            if part not in self.done and not self.in_flight.get(part):
                self.in_flight.setdefault(part, {})[donor] = now
                return part
        # nothing left to start: duplicate the part fetched longest by one other donor (at most two fetchers)
        candidates = [
            (min(fetchers.values()), part)
            for part, fetchers in self.in_flight.items()
            if part not in self.done and len(fetchers) == 1 and donor not in fetchers
        ]
        if not candidates:
            return None
        _, part = min(candidates)
        self.in_flight[part][donor] = now
        return part

    def complete(self, part: int, donor) -> bool:
        """``donor`` delivered ``part`` (verified); False if another donor's copy was kept already."""
        self.in_flight.pop(part, None)
        if part in self.done:
            return False
        self.done.add(part)
        self.fetched_by[part] = donor
        return True

    def release(self, part: int, donor) -> None:
        """``donor`` gave up ``part`` (it may try another later)."""
        fetchers = self.in_flight.get(part)
        if fetchers is not None:
            fetchers.pop(donor, None)
            if not fetchers:
                del self.in_flight[part]

    def exclude(self, donor) -> None:
        """``donor`` failed or served a wrong part: it gets no more parts, its unfinished ones go to the others."""
        self.excluded.add(donor)
        for part in list(self.in_flight):
            self.release(part, donor)

    def donors_per_part(self) -> Dict[object, int]:
        counts: Dict[object, int] = {}
        for donor in self.fetched_by.values():
            counts[donor] = counts.get(donor, 0) + 1
        return counts


def resume_from(count: int, max_donors: int, done: Iterable[int]) -> PartSchedule:
    """A schedule that already holds the parts ``done`` (a download of the same root cut off before)."""
    return PartSchedule(count=count, max_donors=max_donors, done=set(done))
