"""The trainer's command line, end to end as a subprocess: help, bad values, unreachable peers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.testbed.processes import REPO_ROOT, PeerProcess
from benchmarks.testbed.trainers import tiny_model_config


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "run_trainer.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
    )


@pytest.mark.timeout(150)
def test_help_documents_every_flag():
    from peer.cli import build_parser

    result = _run("--help")
    assert result.returncode == 0, result.stderr
    for flag in build_parser().known_fields():
        assert f"--{flag}" in result.stdout, f"--{flag} is missing from --help"
    for flag in (
        "run_id",
        "initial_peers",
        "host_maddrs",
        "announce_maddrs",
        "identity_path",
        "client_mode",
        "use_ipfs",
        "model_config",
        "output_dir",
        "max_epochs",
        "target_batch_size",
        "max_grad_norm",
        "min_learning_rate",
        "delay_optimizer_step",
        "average_state_every",
        "dataset",
    ):
        assert f"--{flag}" in result.stdout
    assert "global norm" in result.stdout  # help texts come from the field docstrings


BAD_VALUES = [
    (["--target_batch_size", "0"], "target_batch_size must be a positive integer"),
    (["--lr_schedule", "exponential"], "invalid choice: 'exponential'"),
    (["--learning_rate", "fast"], "invalid float value: 'fast'"),
    (["--min_learning_rate", "1", "--learning_rate", "0.1"], "must not exceed learning_rate"),
    (["--precision", "fp16", "--device", "cpu"], "needs a CUDA device"),
    (["--per_block_grad_scaling"], "needs --precision fp16"),
    (["--model_config", "no_such_model"], "available presets"),
    (["--initial_peers", "/ip4/127.0.0.1/tcp/1"], "no /p2p/<peer id> part"),
    (["--delay_grad_averaging"], "requires delay_optimizer_step"),
    (["--config", "no_such_preset"], "available presets: "),
    (["--client_mode", "maybe"], "expected a boolean"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,message", BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_bad_values_exit_2_with_a_message(args, message, tmp_path, capsys):
    from peer.cli import parse_config  # the exact parsing main() does, without paying a process start each

    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--model_config", str(tiny_model_config(tmp_path)), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_tokenizer_problems_exit_2_before_joining(tmp_path, capsys):
    import json

    from benchmarks.testbed.processes import TINY_MODEL
    from peer.cli import parse_config

    small = tmp_path / "small_vocab.json"
    small.write_text(json.dumps({**TINY_MODEL, "vocab_size": 1000}))
    cases = [
        (["--model_config", str(small)], "has 4096 tokens but the model's vocab_size is 1000"),
        (
            ["--model_config", str(tiny_model_config(tmp_path)), "--tokenizer", str(tmp_path / "missing")],
            "could not load tokenizer",
        ),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            parse_config(args)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "preset", ["small_internet", "base_internet", "small_home_internet", "base_home_internet", "tiny", "tiny_home"]
)
def test_print_config_writes_a_preset_that_reads_back(preset, tmp_path, capsys):
    from peer.cli import parse_config

    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--config", preset, "--run_id", "printed", "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "run_id: printed" in printed  # flags override the preset
    written = tmp_path / "printed.yaml"
    written.write_text(printed)
    with pytest.raises(SystemExit):
        parse_config(["--config", str(written), "--print_config"])
    assert capsys.readouterr().out == printed  # every value survives the round trip


@pytest.mark.timeout(150)
def test_bad_preset_exits_2_end_to_end(tmp_path):
    preset = tmp_path / "run.yaml"
    preset.write_text("target_batch_size: 64\nlearning_rat: 0.1\n")
    result = _run("--config", str(preset))
    assert result.returncode == 2
    assert "unknown keys learning_rat" in result.stderr and "learning_rate" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(150)
def test_unreachable_initial_peers_give_a_clear_error(tmp_path):
    unreachable = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWEZrWzHGeS3xwKVK4L3yNE2qkwyACS4Fae5X7SwArB6wy"
    peer = PeerProcess(
        [
            "--config",
            "tiny",
            "--model_config",
            tiny_model_config(tmp_path),
            "--output_dir",
            tmp_path / "out",
            "--initial_peers",
            unreachable,
            "--dht_startup_timeout",
            "10",
        ],
        name="lonely",
        log_path=tmp_path / "lonely.log",
    ).start()
    assert peer.wait(timeout=120) == 1
    log = peer.log()
    assert "could not reach any of the initial peers" in log and unreachable in log
    assert "omit --initial_peers" in log
    assert "Traceback" not in log
    assert not peer.wait_until_gone(timeout=10)


@pytest.mark.slow
@pytest.mark.parametrize("delay", [1.0, 3.0])
def test_sigterm_while_joining_exits_promptly(delay, tmp_path):
    """A signal that lands inside hivemind.Optimizer's constructor must not leave the process hanging at exit."""
    import time

    peer = PeerProcess(
        ["--config", "tiny", "--model_config", tiny_model_config(tmp_path), "--output_dir", tmp_path / "out"],
        name="joining",
        log_path=tmp_path / "joining.log",
    ).start()
    peer.wait_for(r"--initial_peers /ip4/", timeout=120)
    time.sleep(delay)
    assert peer.stop(timeout=30) == 0, peer.tail()
    assert "Shut down cleanly" in peer.log()
    assert not peer.wait_until_gone(timeout=10)
