"""Fault injection for tests, driven by environment variables (no CLI flag: users never need it).

Only the test entry point ``benchmarks/testbed/fault_trainer.py`` acts on these (its ``FaultyTrainerPeer`` and
``FaultyGradientAverager`` subclasses call the functions below); ``run_trainer.py`` cannot inject faults.
``benchmarks.testbed.trainers.start_trainer`` starts that entry point whenever the environment it is given holds one of
these variables.

- ``LEANHIVE_FAULT_NAN_GRAD_STEPS=3,4``: after backward at these local steps, one gradient becomes NaN.
- ``LEANHIVE_FAULT_NAN_PARAM_EPOCHS=2``: the first time the peer reaches these global epochs, one parameter
  becomes NaN.

What a broken or hostile peer puts on the wire (its own local checks never see it):

- ``LEANHIVE_FAULT_SEND_GRAD_SCALE=1e6``: the gradients this peer sends for averaging are multiplied by this.
- ``LEANHIVE_FAULT_SEND_NONFINITE_GRADS=1``: the gradients this peer sends are NaN (first half) and inf.
- ``LEANHIVE_FAULT_DIE_IN_ALLREDUCE=3``: SIGKILL the whole peer in the middle of its 3rd gradient all-reduce
  (after the first averaged tensor came back, while the rest is still in flight); ``=/some/file``: in the
  first gradient all-reduce after that file exists (tests decide when). Several peers may share one file: the
  first to get there renames it (``.fired``), so exactly one of them dies.
- ``LEANHIVE_FAULT_FAIL_ALLREDUCE=1``: every gradient all-reduce breaks off on this peer's side after its group
  formed; ``LEANHIVE_FAULT_FAIL_ALLREDUCE_ROUNDS=3,4``: only its 3rd and 4th (counted from 1 in its averager
  process). Such a peer does not retry a round that broke off (hivemind would join the others' next round).
- ``LEANHIVE_FAULT_SIT_OUT_ROUNDS=3``: this peer's 3rd gradient round (its averager's 3rd step, counted from 1 in
  its averager process) neither leads nor joins a group: it waits out the round and finds none, while online.
- ``LEANHIVE_FAULT_SEND_WEIGHT=inf``: the sample weight this peer claims in every gradient all-reduce.
- ``LEANHIVE_FAULT_SEND_BAD_SHAPE=1``: every gradient part this peer sends to another peer's reducer is a
  1-element tensor instead of the shard's part.
- ``LEANHIVE_FAULT_RECORD_AVERAGING=/path.jsonl``: (an observation, no fault) after each gradient all-reduce,
  append {ok, error, cosine, change} comparing what this peer sent with the average it applied.
- ``LEANHIVE_TEST_PARAMS_DIR=/path``: after each global epoch, write the parameters to
  ``/path/epoch_000012.pt`` (tests compare peers epoch by epoch).
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import FrozenSet

import torch

from benchmarks.testbed import hivemind_faults

logger = logging.getLogger(__name__)

FAULT_ENV_PREFIX = "LEANHIVE_FAULT_"
NAN_GRAD_STEPS_ENV = "LEANHIVE_FAULT_NAN_GRAD_STEPS"
NAN_PARAM_EPOCHS_ENV = "LEANHIVE_FAULT_NAN_PARAM_EPOCHS"
SEND_GRAD_SCALE_ENV = "LEANHIVE_FAULT_SEND_GRAD_SCALE"
SEND_NONFINITE_GRADS_ENV = "LEANHIVE_FAULT_SEND_NONFINITE_GRADS"
DIE_IN_ALLREDUCE_ENV = "LEANHIVE_FAULT_DIE_IN_ALLREDUCE"
SEND_WEIGHT_ENV = "LEANHIVE_FAULT_SEND_WEIGHT"
SEND_BAD_SHAPE_ENV = "LEANHIVE_FAULT_SEND_BAD_SHAPE"
RECORD_AVERAGING_ENV = "LEANHIVE_FAULT_RECORD_AVERAGING"
FAIL_ALLREDUCE_ENV = "LEANHIVE_FAULT_FAIL_ALLREDUCE"
FAIL_ALLREDUCE_ROUNDS_ENV = "LEANHIVE_FAULT_FAIL_ALLREDUCE_ROUNDS"
SIT_OUT_ROUNDS_ENV = "LEANHIVE_FAULT_SIT_OUT_ROUNDS"
PARAMS_DIR_ENV = "LEANHIVE_TEST_PARAMS_DIR"


def _numbers(env_name: str) -> FrozenSet[int]:
    text = os.environ.get(env_name, "")
    return frozenset(int(part) for part in text.replace(",", " ").split())


def _first_tensor(model: torch.nn.Module, attribute: str):
    for param in model.parameters():
        tensor = param if attribute == "data" else param.grad
        if tensor is not None:
            return tensor
    return None


@torch.no_grad()
def maybe_corrupt_gradients(model: torch.nn.Module, local_step: int) -> None:
    if local_step in _numbers(NAN_GRAD_STEPS_ENV):
        grad = _first_tensor(model, "grad")
        if grad is not None:
            logger.warning("FAULT INJECTION: NaN gradient at local step %d", local_step)
            grad.view(-1)[0] = float("nan")


_corrupted_epochs = set()  # a recovered peer reaches the same epoch again: inject only once


@torch.no_grad()
def maybe_corrupt_parameters(model: torch.nn.Module, global_epoch: int) -> None:
    if global_epoch in _numbers(NAN_PARAM_EPOCHS_ENV) and global_epoch not in _corrupted_epochs:
        _corrupted_epochs.add(global_epoch)
        logger.warning("FAULT INJECTION: NaN parameter at global epoch %d", global_epoch)
        _first_tensor(model, "data").view(-1)[0] = float("nan")


@torch.no_grad()
def corrupt_sent_gradients(averager) -> None:
    """For a hivemind GradientAverager, right after ``load_accumulators_into_averager_``: what this peer sends
    is scaled or made non-finite (env-driven)."""
    scale = float(os.environ.get(SEND_GRAD_SCALE_ENV, "1"))
    nonfinite = os.environ.get(SEND_NONFINITE_GRADS_ENV, "") not in ("", "0")
    if scale == 1 and not nonfinite:
        return
    with averager.get_tensors() as averaged_grads:
        for grad in averaged_grads:
            flat = grad.view(-1)
            if nonfinite:
                flat[: flat.numel() // 2] = float("nan")
                flat[flat.numel() // 2 :] = float("inf")
            else:
                flat.mul_(scale)
    logger.warning("FAULT INJECTION: sending %s gradients for averaging", "NaN/inf" if nonfinite else f"{scale:g}x")


def weight_to_send(weight):
    """The sample weight a hostile peer claims instead of its own (``LEANHIVE_FAULT_SEND_WEIGHT``)."""
    claimed = os.environ.get(SEND_WEIGHT_ENV, "").strip()
    if not claimed:
        return weight
    logger.warning("FAULT INJECTION: claiming sample weight %s instead of %s", claimed, weight)
    return float(claimed)


_rounds_begun = 0  # gradient all-reduce rounds this averager process began (maybe_fail_allreduce)


def fails_allreduce_rounds() -> bool:
    """Whether this peer breaks some of its gradient rounds off (``LEANHIVE_FAULT_FAIL_ALLREDUCE[_ROUNDS]``); it then
    does not retry a round that broke off (``benchmarks.testbed.fault_trainer``)."""
    return os.environ.get(FAIL_ALLREDUCE_ENV, "") not in ("", "0") or bool(_numbers(FAIL_ALLREDUCE_ROUNDS_ENV))


def maybe_fail_allreduce() -> None:
    """Called in the averager process before each gradient all-reduce round: the round breaks off on this peer's
    side, every time (``LEANHIVE_FAULT_FAIL_ALLREDUCE``) or in the listed rounds (``..._ROUNDS``); the others finish
    theirs without it."""
    global _rounds_begun
    _rounds_begun += 1
    if os.environ.get(FAIL_ALLREDUCE_ENV, "") not in ("", "0") or _rounds_begun in _numbers(FAIL_ALLREDUCE_ROUNDS_ENV):
        raise RuntimeError(f"FAULT INJECTION: this peer's all-reduce round {_rounds_begun} fails")


_steps_begun = 0  # gradient averaging steps (rounds) this averager process began (sits_out_step)


def sits_out_step() -> bool:
    """Called in the averager process as each gradient averaging step begins: whether this one sits the round out
    (``LEANHIVE_FAULT_SIT_OUT_ROUNDS``)."""
    global _steps_begun
    _steps_begun += 1
    if _steps_begun not in _numbers(SIT_OUT_ROUNDS_ENV):
        return False
    logger.warning("FAULT INJECTION: this peer sits out its round %d (it joins no group)", _steps_begun)
    return True


def maybe_send_bad_shapes() -> None:
    """Called in the averager process: from now on every part sent to another reducer is a 1-element tensor."""
    if os.environ.get(SEND_BAD_SHAPE_ENV, "") in ("", "0"):
        return
    hivemind_faults.send_bad_shapes()


def snapshot_sent(tensors):
    """What this peer is about to send (``LEANHIVE_FAULT_RECORD_AVERAGING``), or None when not recording."""
    if not os.environ.get(RECORD_AVERAGING_ENV):
        return None
    return torch.cat([t.detach().flatten().float() for t in tensors]).clone()


def record_averaging(sent, tensors, error=None) -> None:
    """Append how the applied average compares with what this peer sent (cosine, relative change)."""
    if sent is None:
        return
    import json

    applied = torch.cat([t.detach().flatten().float() for t in tensors])
    norm = float(sent.norm())
    cosine = float(torch.nn.functional.cosine_similarity(sent, applied, dim=0)) if norm > 0 else None
    line = {
        "ok": error is None,
        "error": None if error is None else repr(error)[:300],
        "cosine": cosine,
        "change": float((applied - sent).norm()) / norm if norm > 0 else None,
        "finite": bool(torch.isfinite(applied).all()),
    }
    with open(os.environ[RECORD_AVERAGING_ENV], "a") as file:
        file.write(json.dumps(line) + "\n")


_allreduce_rounds = 0  # gradient all-reduce rounds this averager process took part in


def maybe_die_in_allreduce_rounds(averager) -> None:
    """Called in the averager process before each all-reduce round (``LEANHIVE_FAULT_DIE_IN_ALLREDUCE``): from then
    on, every averaged tensor this process receives from a round's runner goes through ``maybe_die_in_allreduce``
    (counted from 1 in each round). The runner class of this process alone is wrapped."""
    from hivemind.averaging.allreduce import AllReduceRunner

    from peer.swarm.hivemind_seam import BoundedAllReduceRunner

    if not os.environ.get(DIE_IN_ALLREDUCE_ENV, "").strip() or getattr(BoundedAllReduceRunner, "_counted", False):
        return

    async def counted(self):
        received = 0
        async for update in AllReduceRunner.run(self):
            received += 1
            maybe_die_in_allreduce(averager, received)
            yield update

    BoundedAllReduceRunner.run = counted
    BoundedAllReduceRunner._counted = True


def maybe_die_in_allreduce(averager, tensors_received: int) -> None:
    """For every averaged tensor the averager process receives; SIGKILLs the peer when told to."""
    global _allreduce_rounds
    from hivemind.optim.grad_averager import GradientAverager

    setting = os.environ.get(DIE_IN_ALLREDUCE_ENV, "").strip()
    if not setting or not isinstance(averager, GradientAverager) or tensors_received != 1:
        return
    _allreduce_rounds += 1
    armed = _claim(Path(setting)) if setting.startswith("/") else _allreduce_rounds in _numbers(DIE_IN_ALLREDUCE_ENV)
    if armed:
        logger.warning("FAULT INJECTION: SIGKILL in the middle of gradient all-reduce round %d", _allreduce_rounds)
        os.kill(os.getppid(), signal.SIGKILL)  # the trainer; its other helpers follow it (process_guard)
        os.kill(os.getpid(), signal.SIGKILL)


def _claim(trigger: Path) -> bool:
    try:
        trigger.rename(trigger.with_name(trigger.name + ".fired"))  # atomic: one peer wins
        return True
    except FileNotFoundError:
        return False


def maybe_save_parameters(model: torch.nn.Module, global_epoch: int) -> None:
    folder = os.environ.get(PARAMS_DIR_ENV)
    if folder:
        from peer.swarm.tensors import atomic_torch_save

        params = {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
        atomic_torch_save(params, Path(folder) / f"epoch_{global_epoch:06d}.pt")
