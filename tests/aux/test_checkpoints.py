"""Checkpoint write / verify / rotate / corrupt-handling on a tiny model (no swarm)."""

import json
import logging
import time

import pytest
import torch

from aux_monitor.checkpoints import MANIFEST, OPTIMIZER_FILE, CheckpointError, CheckpointManager, TrainingState
from model import LeanGPTForCausalLM, LeanTransformerConfig

TINY = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
)


def trained_state(epoch: int, seed: int = 0) -> TrainingState:
    """A model + AdamW + scheduler after one real step, so optimizer state is non-trivial."""
    torch.manual_seed(seed)
    model = LeanGPTForCausalLM(LeanTransformerConfig(**TINY))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    ids = torch.randint(0, 128, (2, 16))
    model(ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    return TrainingState(
        model=model,
        optimizer_state=opt.state_dict(),
        scheduler_state=sched.state_dict(),
        epoch=epoch,
        loss=3.5 + epoch,
        time=time.time(),
    )


def manager(tmp_path, keep=3):
    return CheckpointManager(tmp_path / "ckpt", keep=keep, model_class=LeanGPTForCausalLM)


def test_checkpoint_round_trip(tmp_path):
    state = trained_state(epoch=3)
    info = manager(tmp_path).save(state)
    assert info.epoch == 3 and info.path.endswith("epoch_000003")

    reloaded = LeanGPTForCausalLM.from_pretrained(info.path)  # a plain from_pretrained works
    for name, tensor in state.model.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name

    loaded = manager(tmp_path).load(info.path).state
    assert (loaded.epoch, loaded.loss, loaded.time) == (3, 6.5, state.time)
    exp_avg = loaded.optimizer_state["state"][0]["exp_avg"]
    assert torch.equal(exp_avg, state.optimizer_state["state"][0]["exp_avg"]) and exp_avg.abs().sum() > 0
    assert loaded.scheduler_state["last_epoch"] == 1
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".tmp")]


def test_rotation_keeps_the_newest(tmp_path):
    mgr = manager(tmp_path, keep=2)
    for epoch in (1, 2, 3, 4):
        mgr.save(trained_state(epoch))
    assert [p.name for p in mgr.list_checkpoints()] == ["epoch_000004", "epoch_000003"]


def test_corrupt_newest_falls_back_to_previous_and_deletes_nothing(tmp_path, caplog):
    mgr = manager(tmp_path, keep=2)
    mgr.save(trained_state(1))
    good = trained_state(2, seed=1)
    mgr.save(good)
    newest = mgr.save(trained_state(3, seed=2))
    weights = next(p for p in (tmp_path / "ckpt" / "epoch_000003").iterdir() if p.suffix == ".safetensors")
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated, as by a crash or full disk

    fresh = manager(tmp_path, keep=2)  # a restarted aux peer
    with caplog.at_level(logging.ERROR, logger="aux_monitor.checkpoints"):
        loaded = fresh.load_newest_valid()
    assert loaded.state.epoch == 2
    assert torch.equal(loaded.state.model.lm_head.weight, good.model.lm_head.weight)
    assert any("epoch_000003" in r.getMessage() and "corrupt" in r.getMessage() for r in caplog.records)
    assert [p.name for p in fresh.list_checkpoints()] == ["epoch_000003", "epoch_000002"]  # nothing deleted

    # the swarm reaches epoch 3 again: the damaged directory is neither overwritten nor counted by rotation
    info = fresh.save(trained_state(3, seed=3))
    assert info.path.endswith("epoch_000003.1") and info.path != newest.path
    assert [p.name for p in fresh.list_checkpoints()] == ["epoch_000003.1", "epoch_000003", "epoch_000002"]
    fresh.save(trained_state(4))
    assert [p.name for p in fresh.list_checkpoints()] == ["epoch_000004", "epoch_000003.1", "epoch_000003"]


@pytest.mark.parametrize("damage", ["bitflip", "manifest", "optimizer"])
def test_each_kind_of_damage_is_detected(tmp_path, damage):
    mgr = manager(tmp_path)
    path = tmp_path / "ckpt" / "epoch_000001"
    mgr.save(trained_state(1))
    if damage == "bitflip":
        weights = next(p for p in path.iterdir() if p.suffix == ".safetensors")
        data = bytearray(weights.read_bytes())
        data[-5] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "manifest":
        (path / MANIFEST).write_text("{not json")
    else:
        (path / OPTIMIZER_FILE).write_bytes(b"garbage")
    with pytest.raises(CheckpointError):
        mgr.load(path)
    assert manager(tmp_path).load_newest_valid() is None


def test_a_checkpoint_that_fails_verification_is_never_promoted(tmp_path):
    class BrokenWriter(CheckpointManager):
        def _write(self, directory, state):
            super()._write(directory, state)
            (directory / OPTIMIZER_FILE).write_bytes(b"truncated")

    mgr = BrokenWriter(tmp_path / "ckpt", keep=2, model_class=LeanGPTForCausalLM)
    with pytest.raises(CheckpointError):
        mgr.save(trained_state(5))
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_unfinished_writes_are_cleaned_and_foreign_directories_ignored(tmp_path):
    root = tmp_path / "ckpt"
    (root / ".tmp-epoch_000007-abc").mkdir(parents=True)
    (root / "epoch_000009").mkdir()  # no manifest: not a finished checkpoint
    (root / "notes").mkdir()
    mgr = manager(tmp_path)
    assert not (root / ".tmp-epoch_000007-abc").exists()
    assert mgr.load_newest_valid() is None
    mgr.save(trained_state(8))
    assert json.loads((root / "epoch_000008" / MANIFEST).read_text())["epoch"] == 8
    assert (root / "epoch_000009").exists() and (root / "notes").exists()


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        CheckpointManager(tmp_path, keep=0, model_class=LeanGPTForCausalLM)


def test_a_state_with_nan_parameters_is_never_written(tmp_path):
    state = trained_state(3)
    with torch.no_grad():
        state.model.transformer.embeddings.weight[0, 0] = float("nan")
    mgr = manager(tmp_path)
    with pytest.raises(CheckpointError, match="NaN/inf"):
        mgr.save(state)
    assert mgr.list_checkpoints() == [] and list((tmp_path / "ckpt").iterdir()) == []
