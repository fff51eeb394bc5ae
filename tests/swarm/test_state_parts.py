"""The state as parts (``peer.swarm.state_parts``): the partition, the digests, the manifest a joiner checks, and the
schedule that spreads parts over donors, moves a failed donor's parts and resumes a cut-off download."""

from __future__ import annotations

import pytest
import torch

from peer.swarm.state_parts import (
    DEFAULT_PART_BYTES,
    MIN_PART_BYTES,
    SPREAD_PARTS,
    Manifest,
    PartSchedule,
    flatten,
    group_by_root,
    part_bytes_for,
    part_ranges,
    resume_from,
    unflatten,
)


def _state():
    torch.manual_seed(0)
    return [
        torch.randn(33, 7),
        torch.randint(0, 255, (101,), dtype=torch.uint8),
        torch.randn(5).double(),
        torch.randn(()),
    ]


def test_the_partition_covers_the_state_once_in_order():
    for total, size in ((10, 3), (9, 3), (1, 100), (0, 4), (1 << 20, 1 << 16)):
        ranges = part_ranges(total, size)
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(end - start <= size for start, end in ranges)
    with pytest.raises(ValueError, match="part_bytes"):
        part_ranges(10, 0)


def test_a_small_state_is_cut_into_enough_parts_for_several_donors():
    small_preset, tiny_preset = 746_700_000, 5_600_000
    assert part_bytes_for(small_preset) == DEFAULT_PART_BYTES
    assert len(part_ranges(tiny_preset, part_bytes_for(tiny_preset))) == SPREAD_PARTS  # not 2 parts of 4 MiB
    assert part_bytes_for(1000) == MIN_PART_BYTES
    for total in (1, 1000, tiny_preset, 200 << 20, small_preset):
        assert MIN_PART_BYTES <= part_bytes_for(total) <= DEFAULT_PART_BYTES


def test_flatten_and_unflatten_give_back_every_tensor_bit_for_bit():
    tensors = _state()
    layout = [(t.shape, t.dtype) for t in tensors]
    back = unflatten(flatten(tensors), layout)
    assert all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(tensors, back))
    with pytest.raises(ValueError, match="bytes"):
        unflatten(flatten(tensors)[:-1], layout)


def test_the_manifest_digests_change_with_any_byte_and_are_checked_on_receipt():
    buffer = flatten(_state())
    honest = Manifest.build(3, b"meta", buffer, part_bytes=64)
    assert Manifest.build(3, b"meta", buffer.clone(), part_bytes=64) == honest  # deterministic
    wrong = buffer.clone()
    wrong[100] ^= 1
    changed = Manifest.build(3, b"meta", wrong, part_bytes=64)
    assert changed.root != honest.root
    assert [i for i, (a, b) in enumerate(zip(honest.parts, changed.parts)) if a != b] == [100 // 64]
    assert Manifest.build(4, b"meta", buffer, 64).root != honest.root  # the epoch counts
    assert Manifest.build(3, b"other", buffer, 64).root != honest.root  # so do the hyper-parameters
    raw = honest.to_dict()
    raw["part_bytes"] = 1 << 14  # the smallest allowed; the digests no longer fit this partition
    with pytest.raises(ValueError):
        Manifest.from_dict(raw, buffer.numel())
    big = Manifest.build(3, b"meta", torch.zeros(1 << 16, dtype=torch.uint8), part_bytes=1 << 14)
    assert Manifest.from_dict(big.to_dict(), 1 << 16) == big
    with pytest.raises(ValueError, match="bytes"):
        Manifest.from_dict(big.to_dict(), 1 << 15)  # another state size
    forged = big.to_dict()
    forged["parts"][1] = bytes(32)  # a part digest changed without the root
    with pytest.raises(ValueError, match="root"):
        Manifest.from_dict(forged, 1 << 16)


def test_donors_of_the_majority_root_are_used_and_an_outlier_is_outvoted():
    buffer = flatten(_state())
    honest = Manifest.build(3, b"m", buffer, 64)
    wrong = buffer.clone()
    wrong[0] ^= 0xFF
    rogue = Manifest.build(3, b"m", wrong, 64)
    groups = group_by_root({"a": honest, "r": rogue, "b": honest})
    assert sorted(groups[0]) == ["a", "b"] and groups[1] == ["r"]


def test_each_part_goes_to_one_donor_until_none_is_left_then_the_oldest_is_duplicated_once():
    schedule = PartSchedule(count=4, max_donors=3)
    got = {donor: schedule.next_for(donor, now=t) for t, donor in enumerate("abc")}
    assert sorted(got.values()) == [0, 1, 2]
    assert schedule.complete(got["b"], "b")
    assert schedule.next_for("b", now=5) == 3
    # nothing left: c duplicates the part fetched longest by another donor (a's, started at 0), only once
    assert schedule.complete(got["c"], "c")
    assert schedule.next_for("c", now=6) == got["a"]
    assert schedule.complete(got["a"], "c") and not schedule.complete(got["a"], "a")  # first copy kept
    assert schedule.complete(3, "b") and schedule.finished


def test_a_failed_donors_parts_move_to_the_others():
    schedule = PartSchedule(count=3, max_donors=2)
    first_a, first_b = schedule.next_for("a"), schedule.next_for("b")
    schedule.exclude("a")
    assert schedule.next_for("a") is None
    assert schedule.complete(first_b, "b")
    rest = {schedule.next_for("b") for _ in range(2)}
    assert first_a in rest
    for part in rest:
        schedule.complete(part, "b")
    assert schedule.finished and set(schedule.donors_per_part()) == {"b"}


def test_a_resumed_schedule_fetches_only_the_missing_parts():
    schedule = resume_from(5, 3, done={0, 2, 3})
    assert schedule.missing() == [1, 4]
    parts = [schedule.next_for("a"), schedule.next_for("b")]
    assert sorted(parts) == [1, 4]
    with pytest.raises(ValueError, match="max_donors"):
        PartSchedule(count=2, max_donors=0)
