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
