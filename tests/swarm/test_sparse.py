"""--outer_compression sparse: the codec (top-k per chunk, low-bit values, per-chunk scales), its checks of untrusted
payloads, the error-feedback invariants and the options' validation."""

from __future__ import annotations

import struct

import pytest
import torch

from peer.swarm.config import CollaborationArguments
from peer.swarm.sparse import ErrorFeedback, SparseCodec

# ------------------------------------------------------------------------------------------------ options


def test_sparse_options_are_validated_with_a_fix():
    args = CollaborationArguments(sync_mode="local", outer_compression="sparse")
    assert (args.sparse_density, args.sparse_bits, args.sparse_chunk) == (0.05, 2, 4096)
    with pytest.raises(ValueError, match="add --sync_mode local"):
        CollaborationArguments(outer_compression="sparse")
    with pytest.raises(ValueError, match=r"sparse_density must be in \(0, 1\].*--sparse_density 0.05"):
        CollaborationArguments(sync_mode="local", outer_compression="sparse", sparse_density=0)
    with pytest.raises(ValueError, match="sparse_bits must be one of .*--sparse_bits 2"):
        CollaborationArguments(sync_mode="local", outer_compression="sparse", sparse_bits=16)
    with pytest.raises(ValueError, match="sparse_chunk must be an integer in .*one float32 scale"):
        CollaborationArguments(sync_mode="local", outer_compression="sparse", sparse_chunk=65537)
    with pytest.raises(ValueError, match=r"sparse_feedback_decay must be in \[0, 1\].*0.95"):
        CollaborationArguments(sync_mode="local", outer_compression="sparse", sparse_feedback_decay=1.5)
    with pytest.raises(ValueError, match="outer_compression must be dense or sparse"):
        CollaborationArguments(sync_mode="local", outer_compression="topk")


# ------------------------------------------------------------------------------------------------ codec


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8, 32])
@pytest.mark.parametrize("total", [1, 999, 4096, 10_007])
def test_round_trip_keeps_the_largest_values_of_each_chunk(bits, total):
    codec = SparseCodec(total=total, density=0.03, bits=bits, chunk=1000)
    values = torch.randn(total, generator=torch.Generator().manual_seed(total))
    payload = codec.encode(values)
    assert len(payload) == codec.payload_bytes and codec.check(payload) is None
    decoded = codec.decode(payload)
    assert int((decoded != 0).sum()) == codec.kept
    for start in range(0, total, 1000):  # each chunk: exactly its k largest magnitudes are sent
        chunk, sent = values[start : start + 1000], decoded[start : start + 1000] != 0
        k = min(codec.k, chunk.numel())
        assert set(sent.nonzero().flatten().tolist()) == set(chunk.abs().topk(k).indices.tolist())
        kept = chunk[sent]
        scale = float(kept.abs().max())
        # quantized on a grid of 2^bits levels over [-scale, scale]: error at most half a step
        step = 0.0 if bits == 32 else 2 * scale / ((1 << bits) - 1)
        assert float((decoded[start : start + 1000][sent] - kept).abs().max()) <= step / 2 + 1e-6 * scale
        if bits > 1:  # the largest magnitude is a grid point: sent exactly (up to float32 rounding)
            assert abs(float(decoded[start : start + 1000][sent].abs().max()) - scale) <= 1e-6 * scale


def test_density_one_with_32_bits_is_exact():
    codec = SparseCodec(total=12_345, density=1.0, bits=32, chunk=4096)
    values = torch.randn(12_345)
    assert torch.equal(codec.decode(codec.encode(values)), values)
    assert codec.lossless and not SparseCodec(total=12_345, density=1.0, bits=8, chunk=4096).lossless
    assert not SparseCodec(total=12_345, density=0.5, bits=32, chunk=4096).lossless


def test_payloads_are_small():
    def bits_per_value(density: float) -> float:
        codec = SparseCodec(total=10_000_000, density=density, bits=2, chunk=4096)
        return codec.payload_bytes * 8 / codec.total

    # 2 % x (Elias-Fano position: 5 low bits + at most 2.6 upper bits; 2-bit value) + a float32 scale per 4096 values
    assert bits_per_value(0.02) < 0.2
    # 5 % costs about what 2 % did with version 1's uint16 positions (2 % x (16 + 2) bits + scales: 0.37)
    assert bits_per_value(0.05) < 0.43


# ------------------------------------------------------------------------------------------------ error feedback


def test_error_feedback_keeps_what_was_not_sent():
    codec = SparseCodec(total=5000, density=0.02, bits=2, chunk=1000)
    feedback = ErrorFeedback(codec)
    generator = torch.Generator().manual_seed(1)
    sent_total, owed_total = torch.zeros(5000), torch.zeros(5000)
    for _ in range(20):
        pseudo = torch.randn(5000, generator=generator)
        owed_total += pseudo
        before = feedback.buffer.clone()
        payload, decoded, residual = feedback.compress(pseudo)
        assert torch.equal(feedback.buffer, before), "compress alone changes nothing (a failed round sent nothing)"
        torch.testing.assert_close(residual, pseudo + before - decoded)  # residual = pseudo + buffer - decoded
        assert torch.equal(decoded, codec.decode(payload))
        feedback.commit(residual)
        sent_total += decoded
    # nothing is lost, only delayed: what was sent plus what is still owed is everything
    torch.testing.assert_close(sent_total + feedback.buffer, owed_total, rtol=1e-4, atol=1e-4)
    # and the buffer stays bounded (top-k with error feedback is a contraction)
    assert float(feedback.buffer.norm()) < 20 * float(torch.randn(5000, generator=generator).norm())


def test_a_decaying_buffer_adds_only_its_decayed_part():
    codec = SparseCodec(total=2000, density=0.01, bits=2, chunk=500)
    feedback = ErrorFeedback(codec, decay=0.95)
    feedback.buffer.copy_(torch.randn(2000))
    before = feedback.buffer.clone()
    pseudo = torch.randn(2000)
    _, decoded, residual = feedback.compress(pseudo)
    torch.testing.assert_close(residual, pseudo + 0.95 * before - decoded)


def test_error_feedback_is_exactly_zero_at_density_one_and_32_bits():
    feedback = ErrorFeedback(SparseCodec(total=3000, density=1.0, bits=32, chunk=1024))
    pseudo = torch.randn(3000)
    payload, decoded, residual = feedback.compress(pseudo)
    assert torch.equal(decoded, pseudo) and not residual.any()


def test_a_saved_buffer_is_loaded_only_if_it_fits():
    feedback = ErrorFeedback(SparseCodec(total=100, density=0.1, bits=2, chunk=50))
    assert feedback.load(torch.ones(100)) and torch.equal(feedback.buffer, torch.ones(100))
    assert not feedback.load(torch.ones(99)) and not feedback.buffer.any()
    assert not feedback.load(torch.full((100,), float("nan"))) and not feedback.buffer.any()


# ------------------------------------------------------------------------------------------------ untrusted payloads


def _corrupt(payload: bytes, offset: int, data: bytes) -> bytes:
    return payload[:offset] + data + payload[offset + len(data) :]


def _malformed(codec: SparseCodec, payload: bytes) -> dict:
    header = struct.calcsize("<4sBBHIIQ")
    scales, positions, values = codec.split(payload)
    full, tail = codec.parts  # 5 chunks of 1000 keeping 20, one of 500 keeping 10

    def with_positions(changes: dict) -> bytes:
        changed = positions.copy()
        for index, position in changes.items():
            changed[index] = position
        return codec.assemble(scales, changed, values)

    assert codec.assemble(scales, positions, values) == payload
    last_of_first, last = codec.k - 1, codec.kept - 1
    assert (full.largest_codable, tail.largest_codable) == (1023, 511)  # both beyond their chunk: out of range
    low_mask = (1 << full.low_bits) - 1
    assert positions[1] & low_mask != low_mask  # so that the first position can be made larger, in the same bucket
    position_bits = header + 4 * codec.chunks
    return {
        "truncated": payload[:-1],
        "oversized": payload + b"\0",
        "empty": b"",
        "bad magic": _corrupt(payload, 0, b"EVIL"),
        "other version": _corrupt(payload, 4, bytes([1])),
        "other bits": _corrupt(payload, 5, bytes([4])),
        "other chunk": _corrupt(payload, 8, struct.pack("<I", 999)),
        "nan scale": _corrupt(payload, header, struct.pack("<f", float("nan"))),
        "inf scale": _corrupt(payload, header, struct.pack("<f", float("inf"))),
        "negative scale": _corrupt(payload, header, struct.pack("<f", -1.0)),
        "a position bit flipped": _corrupt(payload, position_bits, bytes([payload[position_bits] ^ 0x80])),
        "position out of range": with_positions({last_of_first: full.largest_codable}),
        "repeated position": with_positions({0: positions[1]}),
        "unsorted": with_positions({0: positions[1] | low_mask}),
        "tail out of range": with_positions({last: tail.largest_codable}),
    }


def test_malformed_payloads_are_refused_before_decoding():
    codec = SparseCodec(total=5500, density=0.02, bits=2, chunk=1000)
    # seeded: "unsorted" needs the second position's low bits not all ones (1 in 32 draws have them)
    payload = codec.encode(torch.randn(5500, generator=torch.Generator().manual_seed(0)))
    assert codec.check(payload) is None
    for name, bad in _malformed(codec, payload).items():
        reason = codec.check(bad)
        assert reason is not None, name
        if "position" in name or name in ("unsorted", "tail out of range"):  # read as positions, then refused
            assert "position" in reason, (name, reason)


def test_nonfinite_32_bit_values_are_refused():
    codec = SparseCodec(total=100, density=1.0, bits=32, chunk=100)
    payload = codec.encode(torch.randn(100))
    bad = _corrupt(payload, len(payload) - 4, struct.pack("<f", float("inf")))
    assert "NaN/inf" in codec.check(bad)
