"""benchmarks/outer_sim.py: local mode's math in one process (issue 28's exploration tool), on the tiny model."""

from __future__ import annotations

import json

import pytest

from benchmarks import outer_sim

TINY = ["--model_config", "tiny", "--local_steps", "2", "--rounds", "2", "--per_device_batch_size", "4"]
TINY += ["--gradient_accumulation_steps", "1", "--max_sequence_length", "32", "--eval_batches", "1"]


def test_a_lossless_sparse_row_with_the_dense_outer_step_is_the_dense_row(tmp_path, capsys):
    lossless = ["--sparse_density", "1", "--sparse_bits", "32", "--sparse_feedback_decay", "1"]
    lossless += ["--sparse_outer_learning_rate", "0.7", "--sparse_outer_momentum", "0.9"]
    assert outer_sim.main([*TINY, *lossless, "--json", str(tmp_path / "rows.json")]) == 0
    dense, sparse = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert len(dense["losses"]) == 2 and dense["losses"] == sparse["losses"]
    printed = capsys.readouterr().out
    assert "| sparse | outer_learning_rate 0.7, outer_momentum 0.9, density 1, bits 32" in printed
    # rows run apart (one per core) are printed together, with the gap to the dense row
    assert outer_sim.main(["--from_json", str(tmp_path / "rows.json")]) == 0
    assert capsys.readouterr().out.strip() == printed.split("\n\n", 1)[1].strip()
    assert "(+0.0 %)" in printed


def test_bad_settings_are_refused_with_what_to_give(capsys):
    with pytest.raises(SystemExit):
        outer_sim.parse_args(["--rows", "dense,sparce"])
    assert "choose from dense, sparse" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        outer_sim.parse_args(["--sparse_bits", "9"])
    assert "--sparse_bits 2" in capsys.readouterr().err


def test_fragments_are_staggered_through_the_round_and_cover_every_parameter_once():
    blocking = outer_sim.FragmentSchedule(local_steps=16, fragments=4)
    assert blocking.send == blocking.apply == [4, 8, 12, 16]
    overlapped = outer_sim.FragmentSchedule(local_steps=16, fragments=4, overlap=True)
    # each sent one fragment-round before it lands; the round's last landing is its end
    assert overlapped.send == [0, 4, 8, 12] and overlapped.apply == [4, 8, 12, 16]
    assert outer_sim.FragmentSchedule(local_steps=5, fragments=3).apply == [2, 3, 5]
    spans = overlapped.ranges(4_200_001)
    assert spans[0].start == 0 and spans[-1].stop == 4_200_001
    assert all(a.stop == b.start for a, b in zip(spans, spans[1:]))
    assert max(map(len, spans)) - min(map(len, spans)) <= 1
    assert outer_sim.FragmentSchedule(local_steps=16).send == [16]  # one fragment: today's round


def test_one_fragment_is_the_round_without_fragments_and_overlapped_fragments_train(tmp_path, capsys):
    """--fragments 1 is the loop before fragments existed (checked once when they landed: the same losses to the
    last bit, dense and sparse at two densities); two overlapped fragments are another run that still learns."""
    assert outer_sim.main([*TINY, "--json", str(tmp_path / "one.json"), "--rows", "dense"]) == 0
    fragments = ["--fragments", "2", "--fragment_overlap", "--fragment_mix", "0.5"]
    assert outer_sim.main([*TINY, *fragments, "--json", str(tmp_path / "two.json")]) == 0
    printed = capsys.readouterr().out
    assert "density 0.05, bits 2, feedback_decay 0.95, fragments 2, overlap 1, mix 0.5 |" in printed
    one = json.loads((tmp_path / "one.json").read_text())["rows"][0]
    dense, sparse = json.loads((tmp_path / "two.json").read_text())["rows"]
    assert dense["settings"]["fragments"] == 2 and dense["losses"] != one["losses"]
    # a peer's largest transfer is a fragment's: half the values, and half a sparse payload (the header aside)
    assert dense["largest_send"] == -(-one["largest_send"] // 2)
    assert sparse["largest_send"] < 0.55 * one["largest_send"] * 0.42 / 8
    assert all(loss < 8.5 for loss in dense["losses"] + sparse["losses"])  # ln(vocab 8192) = 9.0 untrained


def test_bad_fragment_settings_are_refused_with_what_to_give(capsys):
    for bad, hint in (
        (["--fragments", "3"], "--fragments must be between 1 and --local_steps (2), got 3"),
        (["--fragment_overlap"], "--fragment_overlap needs --fragments 2 or more"),
        (["--fragments", "2", "--fragment_mix", "1"], "--fragment_mix must be in [0, 1), got 1.0; e.g. 0.5"),
    ):
        with pytest.raises(SystemExit):
            outer_sim.parse_args([*TINY, *bad])
        assert hint in capsys.readouterr().err
