"""The trainer as ``benchmarks/swarm.py`` runs it: ``run_trainer.py`` plus timers around the parts of a global epoch.

Run from the repository root (same flags as ``run_trainer.py``)::

    LEANHIVE_BENCH_TIMINGS=timings.jsonl python -m benchmarks.swarm_peer --config tiny ...

Each timed interval is appended to the file named by ``LEANHIVE_BENCH_TIMINGS`` as one JSON line
``{"kind": ..., "start": <unix time>, "end": <unix time>, "pid": ...}``; the benchmark sums them per epoch.
Kinds: ``compute`` (forward and backward of a local step), ``blocked`` (the training loop inside
``optimizer.step``: everything the swarm makes it wait for), ``grad_wait`` (waiting for the gradient all-reduce,
matchmaking included), ``grad_allreduce`` / ``state_allreduce`` (one all-reduce round of the gradient / state
averager, measured in the averager process), ``optimizer_step`` (8-bit LAMB; in ``--sync_mode local`` the inner
LAMB after every local step plus the outer SGD step) and ``state_download``.

With ``LEANHIVE_BENCH_PARAMS_DIR`` and ``LEANHIVE_BENCH_PARAMS_EVERY=k`` the peer also saves its parameters after
every k-th global epoch (``epoch_<epoch>.pt``, the format of the final parameters), for the benchmark's validation
curve; in local mode those are the shared parameters the round ended with.

Nothing here changes what the trainer does: the timers wrap public methods and return their results untouched
(saving parameters only adds time to the first peer's epoch ends). The all-reduce rounds and the wait for the
gradient all-reduce are timed by the seam's phase observers (``observe_phases``), registered before the trainer
builds its optimizer, so the forked averager processes inherit them.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

import peer.cli
from peer import backup
from peer.swarm import process_guard
from peer.swarm.hivemind_seam import observe_phases
from peer.swarm.lifecycle import configure_logging, run_peer
from peer.trainer import EpochStats, TrainerPeer

TIMINGS_ENV = "LEANHIVE_BENCH_TIMINGS"
PARAMS_DIR_ENV = "LEANHIVE_BENCH_PARAMS_DIR"
PARAMS_EVERY_ENV = "LEANHIVE_BENCH_PARAMS_EVERY"


def record(kind: str, start: float, end: float) -> None:
    """Append one interval (O_APPEND writes of one short line: safe from several processes and threads)."""
    path = os.environ.get(TIMINGS_ENV)
    if not path:
        return
    line = json.dumps({"kind": kind, "start": start, "end": end, "pid": os.getpid()}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def timed(kind: str, function: Callable) -> Callable:
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        start = time.time()
        try:
            return function(*args, **kwargs)
        finally:
            record(kind, start, time.time())

    return wrapper


class TimedTrainerPeer(TrainerPeer):
    @classmethod
    def build(cls, config, control, parts) -> "TimedTrainerPeer":
        self = super().build(config, control, parts)
        optimizer = self.optimizer
        # instance attributes: hivemind looks these up on the optimizer each time it calls them
        optimizer.step = timed("blocked", optimizer.step)
        optimizer.state_averager.optimizer.step = timed("optimizer_step", optimizer.state_averager.optimizer.step)
        optimizer.load_state_from_peers = timed("state_download", optimizer.load_state_from_peers)
        inner = getattr(self.strategy, "inner_optimizer", None)  # --sync_mode local
        if inner is not None:
            inner.step = timed("optimizer_step", inner.step)
        return self

    def _end_epoch(self, stats: EpochStats) -> None:
        super()._end_epoch(stats)
        folder, every = os.environ.get(PARAMS_DIR_ENV), int(os.environ.get(PARAMS_EVERY_ENV) or 0)
        if folder and every and (stats.epoch + 1) % every == 0:
            save_params(self.model, stats.epoch, Path(folder))

    def _accumulate_gradients(self) -> float:
        start = time.time()
        try:
            return super()._accumulate_gradients()
        finally:
            record("compute", start, time.time())


def save_params(model: torch.nn.Module, epoch: int, folder: Path) -> Path:
    """The parameters after global epoch ``epoch``, in the format of the final parameters (``peer.backup``)."""
    return backup.save_params(folder / f"epoch_{epoch:06d}.pt", model, epoch)


def main() -> int:
    observe_phases(record)  # grad_allreduce, state_allreduce (in the averager processes, forked later) and grad_wait
    config = peer.cli.parse_config(sys.argv[1:])
    configure_logging()
    process_guard.install()  # before any hivemind process exists
    return run_peer(functools.partial(TimedTrainerPeer.build, config), events_file=config.events.events_file)


if __name__ == "__main__":
    sys.exit(main())
