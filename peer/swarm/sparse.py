"""Sparse low-bit pseudo-gradients with error feedback (``--outer_compression sparse`` of ``--sync_mode local``).

A peer's contribution to a round is its pseudo-gradient plus what earlier rounds left out (the error-feedback
buffer), flattened and cut into chunks of ``chunk`` values. Each chunk keeps its ``k = round(density x chunk)``
values of largest magnitude: their positions (uint16, so ``chunk`` <= 65536) and their values quantized to ``bits``
bits on a uniform grid from -scale to +scale, where scale is the chunk's largest kept magnitude (one float32 per
chunk; 32 bits sends the values as float32). What was not sent (``contribution - decode(payload)``) stays in the
buffer for the next round (error feedback, as in SparseLoCo and DeMo): with decay 1 nothing is lost, only delayed;
SparseLoCo decays the buffer (0.95 per round) and drops the outer momentum, whose role the buffer takes.

A payload is untrusted input: ``SparseCodec.check`` refuses it before anything is decoded unless its size is exactly
what this run's settings give, its header repeats those settings, every scale is finite and >= 0, every chunk's
positions are strictly increasing (sorted, unique) and inside the chunk, and 32-bit values are finite. The level
codes of b-bit values cannot be out of range (every b-bit pattern is a level).

Wire layout (little endian)::

    header  <4sBBHIIQ: b"LHSP", version, bits, 0, chunk, k, number of values
    scales  float32 x chunks            (absent for 32-bit values)
    indices uint16 x kept values        (per chunk, sorted)
    values  bits x kept values, bit-packed MSB first; float32 for 32 bits

The all-gather of payloads over hivemind is in ``peer.swarm.hivemind_seam.sparse_wire``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

MAGIC = b"LHSP"
VERSION = 1
_HEADER = struct.Struct("<4sBBHIIQ")
MAX_CHUNK = 65536
"""Positions inside a chunk are sent as uint16."""
VALUE_BITS = (1, 2, 3, 4, 5, 6, 7, 8, 32)


@dataclass(frozen=True)
class SparseCodec:
    """Encodes and checks the contributions of one run: ``total`` values (the shared parameters, flattened)."""

    total: int
    density: float
    bits: int
    chunk: int
    k: int = field(init=False)
    """Values kept per full chunk (a shorter last chunk keeps at most its length)."""

    def __post_init__(self):
        if not (isinstance(self.total, int) and self.total >= 1):
            raise ValueError(f"a sparse codec needs at least one value, got total={self.total!r}")
        if not (0.0 < self.density <= 1.0):
            raise ValueError(f"sparse_density must be in (0, 1], got {self.density!r}; e.g. --sparse_density 0.02")
        if self.bits not in VALUE_BITS:
            raise ValueError(f"sparse_bits must be one of {VALUE_BITS}, got {self.bits!r}; e.g. --sparse_bits 2")
        if not (isinstance(self.chunk, int) and 1 <= self.chunk <= MAX_CHUNK):
            raise ValueError(f"sparse_chunk must be an integer in [1, {MAX_CHUNK}], got {self.chunk!r}")
        object.__setattr__(self, "k", max(1, min(self.chunk, round(self.density * self.chunk))))

    # ------------------------------------------------------------------------------------------- layout

    @property
    def full_chunks(self) -> int:
        return self.total // self.chunk

    @property
    def tail(self) -> int:
        """Length of the last, shorter chunk (0: none)."""
        return self.total - self.full_chunks * self.chunk

    @property
    def chunks(self) -> int:
        return self.full_chunks + (1 if self.tail else 0)

    @property
    def lossless(self) -> bool:
        """Every value sent as float32 (density 1, 32 bits): a payload decodes to its input bit for bit."""
        return self.density == 1.0 and self.bits == 32

    @property
    def kept(self) -> int:
        """Values sent per contribution."""
        return self.full_chunks * self.k + min(self.k, self.tail)

    def _value_bytes(self) -> int:
        return 4 * self.kept if self.bits == 32 else math.ceil(self.kept * self.bits / 8)

    def _scale_bytes(self) -> int:
        return 0 if self.bits == 32 else 4 * self.chunks

    @property
    def payload_bytes(self) -> int:
        """The exact size of every valid payload of this run."""
        return _HEADER.size + self._scale_bytes() + 2 * self.kept + self._value_bytes()

    # ------------------------------------------------------------------------------------------- encode

    def _select(self, flat: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions within each chunk, values, chunk of each value), chunk by chunk, positions sorted."""
        positions, values, owners = [], [], []
        body = flat[: self.full_chunks * self.chunk].view(self.full_chunks, self.chunk)
        pieces = [(body, self.k)]
        if self.tail:
            pieces.append((flat[self.full_chunks * self.chunk :].view(1, self.tail), min(self.k, self.tail)))
        first_chunk = 0
        for matrix, k in pieces:
            if matrix.shape[0] == 0:
                continue
            if k == matrix.shape[1]:  # density 1: every value, in order (no sort: exact and cheap)
                index = torch.arange(k).expand(matrix.shape[0], k)
            else:
                index = matrix.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
            positions.append(index.reshape(-1))
            values.append(matrix.gather(1, index).reshape(-1))
            owners.append(torch.arange(first_chunk, first_chunk + matrix.shape[0]).repeat_interleave(k))
            first_chunk += matrix.shape[0]
        return torch.cat(positions), torch.cat(values), torch.cat(owners)

    def encode(self, flat: torch.Tensor) -> bytes:
        """The payload of a flat float tensor of ``total`` values (float32 on the wire)."""
        flat = flat.detach().reshape(-1).to(torch.float32)
        if flat.numel() != self.total:
            raise ValueError(f"expected {self.total} values, got {flat.numel()}")
        positions, values, owners = self._select(flat)
        header = _HEADER.pack(MAGIC, VERSION, self.bits, 0, self.chunk, self.k, self.total)
        index_bytes = positions.to(torch.int32).numpy().astype("<u2").tobytes()
        if self.bits == 32:
            return header + index_bytes + values.numpy().astype("<f4").tobytes()
        scales = torch.zeros(self.chunks, dtype=torch.float32).scatter_reduce_(
            0, owners, values.abs(), reduce="amax", include_self=True
        )
        levels = (1 << self.bits) - 1
        scale_of_value = scales[owners]
        unit = torch.where(scale_of_value > 0, values / scale_of_value.clamp_min(1e-38), torch.zeros_like(values))
        codes = torch.round((unit.clamp(-1, 1) + 1) * (levels / 2)).to(torch.uint8).numpy()
        return header + scales.numpy().astype("<f4").tobytes() + index_bytes + _pack(codes, self.bits)

    # -------------------------------------------------------------------------------------------- check

    def _split(self, payload: bytes) -> Tuple[np.ndarray, np.ndarray, bytes]:
        offset = _HEADER.size
        scales = np.frombuffer(payload, dtype="<f4", count=self._scale_bytes() // 4, offset=offset)
        offset += self._scale_bytes()
        positions = np.frombuffer(payload, dtype="<u2", count=self.kept, offset=offset)
        offset += 2 * self.kept
        return scales, positions, payload[offset:]

    def check(self, payload: bytes) -> Optional[str]:
        """Why ``payload`` cannot be a contribution of this run (None: it can be decoded). Reads sizes and
        header first, so a hostile payload costs at most one pass over the bytes this run's payloads have."""
        if not isinstance(payload, (bytes, bytearray)):
            return f"a payload must be bytes, got {type(payload).__name__}"
        if len(payload) != self.payload_bytes:
            return f"its size is {len(payload)} bytes, this run's payloads have {self.payload_bytes}"
        magic, version, bits, _, chunk, k, total = _HEADER.unpack_from(payload)
        if magic != MAGIC or version != VERSION:
            return f"it is not a version-{VERSION} sparse payload (magic {magic!r}, version {version})"
        if (bits, chunk, k, total) != (self.bits, self.chunk, self.k, self.total):
            return (
                f"its settings (bits {bits}, chunk {chunk}, k {k}, values {total}) are not this run's (bits "
                f"{self.bits}, chunk {self.chunk}, k {self.k}, values {self.total}): every peer of a run needs the "
                "same model and --sparse_density/--sparse_bits/--sparse_chunk"
            )
        scales, positions, values = self._split(payload)
        if scales.size and not (np.isfinite(scales).all() and (scales >= 0).all()):
            return "a chunk's scale is NaN, inf or negative"
        full = self.full_chunks * self.k
        body = positions[:full].reshape(self.full_chunks, self.k).astype(np.int32)
        if body.size and ((body[:, -1] >= self.chunk).any() or (np.diff(body, axis=1) <= 0).any()):
            return "a chunk's positions are out of range, unsorted or repeated"
        tail = positions[full:].astype(np.int32)
        if tail.size and (tail[-1] >= self.tail or (np.diff(tail) <= 0).any()):
            return "the last chunk's positions are out of range, unsorted or repeated"
        if self.bits == 32 and not np.isfinite(np.frombuffer(values, dtype="<f4")).all():
            return "it holds NaN/inf values"
        return None

    # ------------------------------------------------------------------------------------------- decode

    def decode(self, payload: bytes) -> torch.Tensor:
        """The dense float32 contribution of a payload that passed ``check`` (call it first: this one trusts)."""
        scales, positions, values = self._split(payload)
        chunk_of = np.repeat(np.arange(self.full_chunks, dtype=np.int64), self.k)
        if self.tail:
            chunk_of = np.concatenate([chunk_of, np.full(min(self.k, self.tail), self.full_chunks, dtype=np.int64)])
        flat_index = torch.from_numpy(chunk_of * self.chunk + positions.astype(np.int64))
        if self.bits == 32:
            decoded = torch.from_numpy(np.frombuffer(values, dtype="<f4").copy())
        else:
            levels = (1 << self.bits) - 1
            codes = torch.from_numpy(_unpack(values, self.bits, self.kept).astype(np.float32))
            decoded = (codes * (2.0 / levels) - 1.0) * torch.from_numpy(scales[chunk_of].copy())
        out = torch.zeros(self.total, dtype=torch.float32)
        out[flat_index] = decoded
        return out


def _pack(codes: np.ndarray, bits: int) -> bytes:
    """``bits`` low bits of each uint8 code, most significant first, packed into bytes."""
    if bits == 8:
        return codes.tobytes()
    planes = np.unpackbits(codes.reshape(-1, 1), axis=1)[:, 8 - bits :]
    return np.packbits(planes.reshape(-1)).tobytes()


def _unpack(data: bytes, bits: int, count: int) -> np.ndarray:
    raw = np.frombuffer(data, dtype=np.uint8)
    if bits == 8:
        return raw[:count]
    planes = np.unpackbits(raw)[: count * bits].reshape(count, bits)
    padded = np.zeros((count, 8), dtype=np.uint8)
    padded[:, 8 - bits :] = planes
    return np.packbits(padded, axis=1).reshape(-1)


class ErrorFeedback:
    """One peer's error-feedback buffer: what its earlier payloads left out, added to its next contribution.

    ``compress`` does not change the buffer; ``commit`` does, once the round that sent the payload succeeded (a
    failed round sent nothing, so everything stays owed). The buffer may live in shared memory
    (``share_memory``): the averager process compresses, the trainer process saves it in backups and resets it."""

    def __init__(self, codec: SparseCodec, decay: float = 1.0):
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"sparse_feedback_decay must be in [0, 1], got {decay!r}; e.g. 0.95")
        self.codec, self.decay = codec, float(decay)
        self.buffer = torch.zeros(codec.total, dtype=torch.float32)

    def share_memory(self) -> "ErrorFeedback":
        self.buffer.share_memory_()
        return self

    def compress(self, pseudo_gradient: torch.Tensor) -> Tuple[bytes, torch.Tensor, torch.Tensor]:
        """(payload, its decoded contribution, the residual to commit if the round succeeds); the contribution is the
        pseudo-gradient plus ``decay`` x the buffer."""
        contribution = pseudo_gradient.detach().reshape(-1).to(torch.float32)
        contribution = contribution + (self.buffer if self.decay == 1.0 else self.decay * self.buffer)
        payload = self.codec.encode(contribution)
        decoded = self.codec.decode(payload)
        return payload, decoded, contribution - decoded

    def commit(self, residual: torch.Tensor) -> None:
        self.buffer.copy_(residual)

    def reset(self) -> None:
        self.buffer.zero_()

    def state(self) -> torch.Tensor:
        return self.buffer.clone()

    def load(self, buffer: torch.Tensor) -> bool:
        """Take a saved buffer; False (and zeros) if it does not fit this run or is not finite."""
        ok = (
            isinstance(buffer, torch.Tensor)
            and buffer.numel() == self.codec.total
            and bool(torch.isfinite(buffer).all())
        )
        self.buffer.copy_(buffer.reshape(-1).to(torch.float32) if ok else torch.zeros_like(self.buffer))
        return ok


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
