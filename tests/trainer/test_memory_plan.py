"""The memory planner (peer/memory_plan.py): sizes, the plan's choices against real measured steps, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from benchmarks.testbed.processes import REPO_ROOT
from benchmarks.testbed.trainers import tiny_model_config
from model import LeanTransformerConfig
from peer.memory_plan import (
    Candidate,
    ModelShape,
    apply_plan,
    build_for,
    make_plan,
    measure_peak_bytes,
    parse_size,
    predict_peak_bytes,
)
from peer.swarm.config import TrainingArguments

CPU = torch.device("cpu")


def _config(**overrides) -> LeanTransformerConfig:
    fields = dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=128,
        loss_chunk_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return LeanTransformerConfig(**{**fields, **overrides})


def _measured(config, candidate: Candidate, seq_len: int) -> int:
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (candidate.per_device_batch_size, seq_len))
    return measure_peak_bytes(build_for(config, candidate, CPU), ids, None)


def test_sizes_parse_with_units_and_bad_ones_say_how():
    assert parse_size("8GiB") == 8 * 2**30
    assert parse_size("7.5 GB") == 7_500_000_000
    assert parse_size("512mib") == 512 * 2**20
    assert parse_size("1024") == 1024
    for bad in ("eight", "8 parsecs", "", "-1GiB"):
        with pytest.raises(ValueError, match="e.g. 8GiB"):
            parse_size(bad)


@pytest.mark.parametrize(
    "overrides,candidate",
    [
        ({}, Candidate(4, 1, False, 0, 0, 64, "fp32")),
        ({}, Candidate(4, 1, True, 0, 0, 64, "fp32")),
        ({"reversible": True}, Candidate(4, 1, False, 32, 1, 64, "fp32")),
        ({"reversible": True}, Candidate(4, 1, False, 0, 0, 64, "fp32")),
    ],
    ids=["plain", "checkpoint", "reversible_chunked", "reversible_revlib"],
)
def test_uncalibrated_prediction_is_within_ten_percent(overrides, candidate):
    config = _config(**overrides)
    predicted = predict_peak_bytes(ModelShape.from_config(config), candidate, 64)
    assert abs(predicted / _measured(config, candidate, 64) - 1) <= 0.10


def test_plan_keeps_samples_per_step_fits_its_budget_and_prefers_no_recompute():
    config = _config()
    roomy = make_plan(config, budget_bytes=2**30, seq_len=64, samples_per_step=8, device=CPU, precisions=["fp32"])
    chosen = roomy.chosen.candidate
    assert (chosen.per_device_batch_size, chosen.gradient_accumulation_steps) == (8, 1)
    assert not chosen.checkpoint_layers
    # a budget between the smallest and the roomiest need: a smaller micro-batch, same samples per step
    tight_budget = (roomy.needed_bytes + roomy.chosen.predicted_bytes) // 2
    tight = make_plan(
        config, budget_bytes=tight_budget, seq_len=64, samples_per_step=8, device=CPU, precisions=["fp32"]
    )
    chosen = tight.chosen.candidate
    assert chosen.per_device_batch_size * chosen.gradient_accumulation_steps == 8
    assert chosen.per_device_batch_size < 8
    measured = _measured(config, chosen, 64)
    assert measured <= tight_budget
    assert abs(tight.chosen.predicted_bytes / measured - 1) <= 0.10
    line = json.loads(tight.to_json())
    assert line["fits"] and line["chosen"]["per_device_batch_size"] == chosen.per_device_batch_size


def test_nothing_fits_says_which_budget_is_needed():
    plan = make_plan(_config(), budget_bytes=1024, seq_len=64, samples_per_step=4, device=CPU, precisions=["fp32"])
    assert plan.chosen is None and plan.needed_bytes > 1024
    assert "NOTHING FITS" in plan.table()
    with pytest.raises(ValueError, match="raise --memory_budget to at least"):
        apply_plan(TrainingArguments(), plan, reversible=False)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--plan_only"], "give --memory_budget too"),
        (["--memory_budget", "auto"], "on CPU the memory planner needs an explicit budget"),
        (["--memory_budget", "eight"], "cannot read the memory size 'eight'"),
        (["--memory_budget", "1KiB"], "no configuration fits the memory budget"),
        (["--reversible_chunk_heads", "-1"], "reversible_chunk_heads must be an integer >= 0"),
    ],
)
def test_bad_planner_flags_exit_2_with_a_message(args, message, tmp_path, capsys):
    from peer.cli import parse_config

    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--model_config", str(tiny_model_config(tmp_path)), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_budget_sets_the_training_arguments(tmp_path):
    from peer.cli import parse_config

    config = parse_config(
        [
            "--model_config",
            str(tiny_model_config(tmp_path)),
            "--per_device_batch_size",
            "2",
            "--gradient_accumulation_steps",
            "3",
            "--memory_budget",
            "4GiB",
        ]
    )
    training = config.training
    assert (training.per_device_batch_size, training.gradient_accumulation_steps) == (6, 1)
    assert training.checkpoint_layers is False and training.precision == "fp32"


@pytest.mark.timeout(120)
def test_plan_only_prints_a_json_line_and_a_table_then_exits(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "run_trainer.py"),
            "--model_config",
            str(tiny_model_config(tmp_path)),
            "--memory_budget",
            "1GiB",
            "--plan_only",
        ],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    first, *rest = result.stdout.strip().splitlines()
    plan = json.loads(first)
    assert plan["fits"] and plan["budget_bytes"] == 2**30 and plan["device"] == "cpu"
    assert any("CHOSEN" in line for line in rest)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the planner measures max_memory_allocated")
def test_cuda_plan_fits_and_predicts_within_ten_percent():
    cuda = torch.device("cuda")
    config = _config()
    roomy = make_plan(config, budget_bytes=2**34, seq_len=64, samples_per_step=8, device=cuda, precisions=["fp16"])
    budget = (roomy.needed_bytes + roomy.chosen.predicted_bytes) // 2
    plan = make_plan(config, budget_bytes=budget, seq_len=64, samples_per_step=8, device=cuda, precisions=["fp16"])
    chosen = plan.chosen.candidate
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (chosen.per_device_batch_size, 64), device=cuda)
    measured = measure_peak_bytes(build_for(config, chosen, cuda), ids, chosen.autocast_dtype)
    assert measured <= budget
    assert abs(plan.chosen.predicted_bytes / measured - 1) <= 0.10
