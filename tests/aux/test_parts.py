"""Aux-peer parts that need no swarm: arguments, scheduling, evaluation on the shipped validation split,
Hub upload (the Hub is mocked: it is the only thing a test may mock), and the CLI's error handling."""

import logging
import math
import subprocess
import sys

import pytest
import torch

from aux_monitor.arguments import AuxArguments
from aux_monitor.evaluation import evaluate
from aux_monitor.hub import HubUploader
from aux_monitor.monitor import is_due
from aux_monitor.state import CheckpointInfo
from benchmarks.testbed.processes import REPO_ROOT
from benchmarks.testbed.trainers import tiny_model_config
from model import LeanGPTForCausalLM, LeanTransformerConfig
from peer.swarm.data import DataArguments, build_validation_dataset, load_tokenizer


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(refresh_period=0), "refresh_period"),
        (dict(metrics_port=70000), "metrics_port"),
        (dict(checkpoint_every=-1), "checkpoint_every"),
        (dict(keep_checkpoints=0), "keep_checkpoints"),
        (dict(eval_batch_size=0), "eval_batch_size"),
        (dict(alive_window=float("nan")), "alive_window"),
        (dict(upload_to_hub="not a repo"), "upload_to_hub"),
        (dict(upload_to_hub="org/name", checkpoint_every=0), "checkpoint_every"),
    ],
)
def test_invalid_arguments_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AuxArguments(**kwargs)


@pytest.mark.parametrize(
    "epoch, last, every, due",
    [
        (0, None, 5, False),  # nothing to save at the very start
        (3, None, 5, True),  # first state we can get
        (4, 3, 5, False),
        (5, 3, 5, True),  # crossed a multiple of 5
        (12, 5, 5, True),  # several multiples at once: one checkpoint
        (9, 5, 5, False),
        (7, None, 0, False),  # disabled
    ],
)
def test_is_due(epoch, last, every, due):
    assert is_due(epoch, last, every) is due


def test_evaluation_on_the_shipped_validation_split():
    data = DataArguments(max_sequence_length=32, max_validation_blocks=40)
    blocks = build_validation_dataset(data, load_tokenizer(data))
    torch.manual_seed(0)
    model = LeanGPTForCausalLM(
        LeanTransformerConfig(
            vocab_size=4096,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
        )
    )
    result = evaluate(model, blocks, epoch=7, batch_size=8, max_batches=3)  # 24 of the 40 blocks

    with torch.no_grad():
        batches = [torch.stack([b["input_ids"] for b in blocks[i : i + 8]]) for i in (0, 8, 16)]
        expected = sum(model(input_ids=x, labels=x).loss.item() for x in batches) / 3
    assert result.epoch == 7
    assert result.loss == pytest.approx(expected, rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(expected), rel=1e-6)
    assert abs(result.loss - math.log(4096)) < 0.5  # an untrained model is near-uniform
    assert model.training  # evaluation puts the model back the way it was


class FakeHfApi:
    """Records calls; fails the uploads listed in ``fail``."""

    def __init__(self, fail=()):
        self.calls, self.fail = [], set(fail)

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, *, repo_id, folder_path, commit_message, **kwargs):
        if folder_path in self.fail:
            raise ConnectionError("the Hub is unreachable")
        self.calls.append(("upload_folder", repo_id, folder_path, commit_message))


def test_hub_upload(monkeypatch, tmp_path, caplog):
    import huggingface_hub

    api = FakeHfApi(fail={str(tmp_path / "epoch_000002")})
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: api)
    uploader = HubUploader("org/leanhive-tiny")
    with caplog.at_level(logging.ERROR, logger="aux_monitor.hub"):
        for epoch, loss in ((2, 5.5), (4, 5.25)):
            uploader.submit(CheckpointInfo(epoch=epoch, time=0.0, path=str(tmp_path / f"epoch_{epoch:06d}"), loss=loss))
            uploader.wait(timeout=10)
    assert api.calls[0] == ("create_repo", "org/leanhive-tiny", dict(repo_type="model", private=True, exist_ok=True))
    assert api.calls[1:] == [
        (
            "upload_folder",
            "org/leanhive-tiny",
            str(tmp_path / "epoch_000004"),
            "LeanHive checkpoint: epoch 4, loss 5.2500",
        )
    ]
    assert [c.epoch for c in uploader.uploaded] == [4]
    assert any("epoch_000002" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records)


def test_cli_help_lists_aux_and_shared_flags_only():
    """The entry point end to end (a subprocess): one parser for the aux's own and the swarm's shared settings."""
    result = subprocess.run(
        [sys.executable, "run_aux_peer.py", "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr
    for flag in (
        "--metrics_port",
        "--checkpoint_every",
        "--resume",
        "--assist_in_averaging",
        "--eval_every",
        "--upload_to_hub",
        "--initial_peers",
        "--target_batch_size",
        "--config",
    ):
        assert flag in result.stdout
    assert "--per_device_batch_size" not in result.stdout  # trainer-only settings are not aux flags


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--checkpoint_every", "-2"], "checkpoint_every must be an integer >= 0"),
        (["--initial_peers", "/ip4/127.0.0.1/tcp/1"], "/p2p/"),
        (["--model_config", "no_such_preset"], "no_such_preset"),
        (["--per_device_batch_size", "8"], "unrecognized arguments"),
    ],
)
def test_cli_rejects_bad_values_with_status_2(argv, message, capsys):
    from aux_monitor.cli import parse_config

    with pytest.raises(SystemExit) as exit_info:
        parse_config(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_trainer_presets_are_shared(tmp_path, capsys):
    """The trainers' run preset configures the aux peer; trainer-only keys are skipped, misspelt keys are not."""
    from aux_monitor.cli import parse_config

    config = parse_config(["--config", "tiny", "--model_config", str(tiny_model_config(tmp_path)), "--run_id", "r"])
    assert (config.collaboration.target_batch_size, config.collaboration.compression_threshold) == (64, 4096)
    assert config.network.host_maddrs == ["/ip4/127.0.0.1/tcp/0"] and config.data.max_sequence_length == 64

    (tmp_path / "typo.yaml").write_text("target_bach_size: 64\n")
    with pytest.raises(SystemExit):
        parse_config(["--config", str(tmp_path / "typo.yaml")])
    assert "unknown keys target_bach_size" in capsys.readouterr().err
