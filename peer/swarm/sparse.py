"""Sparse low-bit pseudo-gradients with error feedback (``--outer_compression sparse`` of ``--sync_mode local``).

A peer's contribution to a round is its pseudo-gradient plus what earlier rounds left out (the error-feedback
buffer), flattened and cut into chunks of ``chunk`` values. Each chunk keeps its ``k = round(density x chunk)``
values of largest magnitude: their positions, Elias-Fano coded (below), and their values quantized to ``bits`` bits
on a uniform grid from -scale to +scale, where scale is the chunk's largest kept magnitude (one float32 per chunk; 32
bits sends the values as float32). What was not sent (``contribution - decode(payload)``) stays in the
buffer for the next round (error feedback, as in SparseLoCo and DeMo): with decay 1 nothing is lost, only delayed;
SparseLoCo decays the buffer (0.95 per round) and drops the outer momentum, whose role the buffer takes.

Positions (Elias-Fano, as search engines code sorted posting lists): in a chunk of n values keeping k, each sorted
position p is split into its ``l = floor(log2(n / k))`` low bits, sent as they are, and its high part ``p >> l``,
sent in unary: bit ``(p >> l) + i`` of the chunk's ``((n - 1) >> l) + k``-bit upper vector is set for its i-th
position. That is at most ``l + 2 + 1/k`` bits a position, whatever the values: 7.6 bits at 2 % density and 6.3 at
5 %, where uint16 positions (version 1) took 16, so a payload at 5 % density costs about what version 1's did at
2 % (the density that closes the gap to dense local mode: docs/benchmarks.md). Every payload of a run has the same
size. A chunk that keeps all its values sends no positions.

A payload is untrusted input: ``SparseCodec.check`` refuses it before anything is decoded unless its size is exactly
what this run's settings give, its header repeats those settings, every scale is finite and >= 0, every chunk's
upper vector has exactly k bits set, every chunk's positions are strictly increasing (sorted, unique) and inside
the chunk, and 32-bit values are finite. The level codes of b-bit values cannot be out of range (every b-bit pattern
is a level).

Wire layout (little endian)::

    header    <4sBBHIIQ: b"LHSP", version, bits, 0, chunk, k, number of values
    scales    float32 x chunks            (absent for 32-bit values)
    positions per part (the full chunks, then the shorter last one): its chunks' upper vectors, then their low
              bits (MSB first, l per position), all bit-packed MSB first into whole bytes
    values    bits x kept values, bit-packed MSB first; float32 for 32 bits

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
VERSION = 2
"""Version 1 sent positions as uint16 (docs/benchmarks.md's measurements before 2026-12-02 used it)."""
_HEADER = struct.Struct("<4sBBHIIQ")
MAX_CHUNK = 65536
"""Longer chunks would share one scale among more values (coarser values); it was also version 1's uint16 limit."""
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
            raise ValueError(f"sparse_density must be in (0, 1], got {self.density!r}; e.g. --sparse_density 0.05")
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
    def parts(self) -> Tuple["_Part", ...]:
        """The full chunks, then the shorter last one: each part's chunks have one length and keep one k."""
        parts = [_Part(self.full_chunks, self.chunk, self.k)] if self.full_chunks else []
        if self.tail:
            parts.append(_Part(1, self.tail, min(self.k, self.tail)))
        return tuple(parts)

    @property
    def kept(self) -> int:
        """Values sent per contribution."""
        return sum(part.rows * part.k for part in self.parts)

    def _chunk_of_values(self) -> np.ndarray:
        """The chunk of each sent value, in payload order (each chunk's index, k times)."""
        kept_per_chunk = np.repeat([part.k for part in self.parts], [part.rows for part in self.parts])
        return np.repeat(np.arange(self.chunks, dtype=np.int64), kept_per_chunk)

    def _value_bytes(self) -> int:
        return 4 * self.kept if self.bits == 32 else math.ceil(self.kept * self.bits / 8)

    def _scale_bytes(self) -> int:
        return 0 if self.bits == 32 else 4 * self.chunks

    def _position_bytes(self) -> int:
        return math.ceil(sum(part.position_bits for part in self.parts) / 8)

    @property
    def payload_bytes(self) -> int:
        """The exact size of every valid payload of this run."""
        return _HEADER.size + self._scale_bytes() + self._position_bytes() + self._value_bytes()

    # ------------------------------------------------------------------------------------------- encode

    def _select(self, flat: torch.Tensor) -> Tuple[np.ndarray, torch.Tensor]:
        """(positions within each chunk, values), chunk by chunk, positions sorted."""
        positions, values = [], []
        first_chunk = 0
        for part in self.parts:
            matrix = flat[first_chunk * self.chunk :][: part.rows * part.length].view(part.rows, part.length)
            if part.k == part.length:  # density 1: every value, in order (no sort: exact and cheap)
                index = torch.arange(part.k).expand(part.rows, part.k)
            else:
                index = matrix.abs().topk(part.k, dim=1, sorted=False).indices.sort(dim=1).values
            positions.append(index.reshape(-1))
            values.append(matrix.gather(1, index).reshape(-1))
            first_chunk += part.rows
        return torch.cat(positions).numpy().astype(np.int64), torch.cat(values)

    def encode(self, flat: torch.Tensor) -> bytes:
        """The payload of a flat float tensor of ``total`` values (float32 on the wire)."""
        flat = flat.detach().reshape(-1).to(torch.float32)
        if flat.numel() != self.total:
            raise ValueError(f"expected {self.total} values, got {flat.numel()}")
        positions, values = self._select(flat)
        if self.bits == 32:
            return self.assemble(np.zeros(0, dtype=np.float32), positions, values.numpy().astype("<f4").tobytes())
        owners = torch.from_numpy(self._chunk_of_values())
        scales = torch.zeros(self.chunks, dtype=torch.float32).scatter_reduce_(
            0, owners, values.abs(), reduce="amax", include_self=True
        )
        levels = (1 << self.bits) - 1
        scale_of_value = scales[owners]
        unit = torch.where(scale_of_value > 0, values / scale_of_value.clamp_min(1e-38), torch.zeros_like(values))
        codes = torch.round((unit.clamp(-1, 1) + 1) * (levels / 2)).to(torch.uint8).numpy()
        return self.assemble(scales.numpy(), positions, _pack(codes, self.bits))

    def assemble(self, scales: np.ndarray, positions: np.ndarray, values: bytes) -> bytes:
        """A payload of these parts: ``positions`` (each chunk's, in chunk order) must be sorted within each chunk
        and each below ``(((n - 1) >> l) + 1) << l`` for its chunk's length n; nothing else is checked (the rogue
        peers of the tests build malformed payloads with it)."""
        header = _HEADER.pack(MAGIC, VERSION, self.bits, 0, self.chunk, self.k, self.total)
        bits, start = [], 0
        for part in self.parts:
            bits.append(part.code(positions[start : start + part.rows * part.k].reshape(part.rows, part.k)))
            start += part.rows * part.k
        position_bytes = np.packbits(np.concatenate(bits)).tobytes() if bits else b""
        return header + np.asarray(scales, dtype="<f4").tobytes() + position_bytes + values

    # -------------------------------------------------------------------------------------------- check

    def split(self, payload: bytes) -> Tuple[np.ndarray, Optional[np.ndarray], bytes]:
        """(scales, each chunk's positions in chunk order, or None where a chunk's upper vector does not have
        exactly k bits set; the value bytes)."""
        offset = _HEADER.size
        scales = np.frombuffer(payload, dtype="<f4", count=self._scale_bytes() // 4, offset=offset)
        offset += self._scale_bytes()
        bits = np.unpackbits(np.frombuffer(payload, dtype=np.uint8, count=self._position_bytes(), offset=offset))
        offset += self._position_bytes()
        positions, start = [], 0
        for part in self.parts:
            read = part.read(bits[start : start + part.position_bits])
            if read is None:
                return scales, None, payload[offset:]
            positions.append(read.reshape(-1))
            start += part.position_bits
        return scales, np.concatenate(positions), payload[offset:]

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
        scales, positions, values = self.split(payload)
        if scales.size and not (np.isfinite(scales).all() and (scales >= 0).all()):
            return "a chunk's scale is NaN, inf or negative"
        if positions is None:
            return "a chunk's position code does not hold exactly its number of positions"
        start = 0
        for part in self.parts:
            matrix = positions[start : start + part.rows * part.k].reshape(part.rows, part.k)
            if (matrix[:, -1] >= part.length).any() or (np.diff(matrix, axis=1) <= 0).any():
                return "a chunk's positions are out of range, unsorted or repeated"
            start += part.rows * part.k
        if self.bits == 32 and not np.isfinite(np.frombuffer(values, dtype="<f4")).all():
            return "it holds NaN/inf values"
        return None

    # ------------------------------------------------------------------------------------------- decode

    def decode(self, payload: bytes) -> torch.Tensor:
        """The dense float32 contribution of a payload that passed ``check`` (call it first: this one trusts)."""
        scales, positions, values = self.split(payload)
        chunk_of = self._chunk_of_values()
        flat_index = torch.from_numpy(chunk_of * self.chunk + positions)
        if self.bits == 32:
            decoded = torch.from_numpy(np.frombuffer(values, dtype="<f4").copy())
        else:
            levels = (1 << self.bits) - 1
            codes = torch.from_numpy(_unpack(values, self.bits, self.kept).astype(np.float32))
            decoded = (codes * (2.0 / levels) - 1.0) * torch.from_numpy(scales[chunk_of].copy())
        out = torch.zeros(self.total, dtype=torch.float32)
        out[flat_index] = decoded
        return out


@dataclass(frozen=True)
class _Part:
    """``rows`` chunks of ``length`` values, each keeping ``k``: the Elias-Fano code of their positions."""

    rows: int
    length: int
    k: int

    @property
    def low_bits(self) -> int:
        """l = floor(log2(length / k)): a position's bits sent as they are."""
        return 0 if self.k == self.length else (self.length // self.k).bit_length() - 1

    @property
    def upper_bits(self) -> int:
        """A chunk's unary-coded high parts: one set bit per position, one clear bit per step of the high part."""
        return 0 if self.k == self.length else ((self.length - 1) >> self.low_bits) + self.k

    @property
    def largest_codable(self) -> int:
        """The largest position the code can hold: ``length - 1`` or more (a hostile payload's may be out of range,
        unless ``length`` is a multiple of 2^l)."""
        return (((self.length - 1) >> self.low_bits) + 1 << self.low_bits) - 1

    @property
    def position_bits(self) -> int:
        return self.rows * (self.upper_bits + self.k * self.low_bits)

    def code(self, positions: np.ndarray) -> np.ndarray:
        """The bits (one uint8 per bit) of ``positions``: (rows, k), each row sorted."""
        if self.k == self.length:
            return np.zeros(0, dtype=np.uint8)
        low = self.low_bits
        upper = np.zeros((self.rows, self.upper_bits), dtype=np.uint8)
        upper[np.arange(self.rows)[:, None], (positions >> low) + np.arange(self.k)] = 1
        lower = np.empty((self.rows, self.k, low), dtype=np.uint8)
        for bit in range(low):
            lower[:, :, bit] = (positions >> (low - 1 - bit)) & 1
        return np.concatenate([upper.reshape(-1), lower.reshape(-1)])

    def read(self, bits: np.ndarray) -> Optional[np.ndarray]:
        """(rows, k) positions from ``code``'s bits; None if a chunk's upper vector has not exactly k bits set (then
        it cannot be read as k positions). Ranges and order are ``SparseCodec.check``'s."""
        if self.k == self.length:
            return np.broadcast_to(np.arange(self.k, dtype=np.int64), (self.rows, self.k))
        low, upper_size = self.low_bits, self.rows * self.upper_bits
        upper = bits[:upper_size].reshape(self.rows, self.upper_bits)
        if (upper.sum(axis=1, dtype=np.int64) != self.k).any():
            return None
        columns = np.nonzero(upper)[1].reshape(self.rows, self.k).astype(np.int64)
        positions = (columns - np.arange(self.k)) << low
        lower = bits[upper_size : upper_size + self.rows * self.k * low].reshape(self.rows, self.k, low)
        for bit in range(low):
            positions |= lower[:, :, bit].astype(np.int64) << (low - 1 - bit)
        return positions


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
