"""Trainer-specific helpers on top of ``processes``: start a trainer, read its epochs, compare final parameters.

A trainer whose environment holds a fault variable (``LEANHIVE_FAULT_*``, ``LEANHIVE_TEST_PARAMS_DIR``: see
``benchmarks.testbed.faults.injection``) is started through the test entry point
``benchmarks/testbed/fault_trainer.py``, every other one through ``run_trainer.py``, as users start it.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

import torch

from benchmarks.testbed.faults.injection import FAULT_ENV_PREFIX, PARAMS_DIR_ENV
from benchmarks.testbed.processes import TINY_MODEL, PeerProcess

TRAINER_SCRIPT = "run_trainer.py"
FAULT_TRAINER_MODULE = "benchmarks.testbed.fault_trainer"  # benchmarks/testbed/fault_trainer.py, run with -m
LOCAL_MODE = ["--sync_mode", "local", "--target_batch_size", "128"]  # about 4 local steps per peer per round of 2
MIN_PEERS_WAIT = 240.0
"""--startup_wait of a test's trainers: a peer given --min_peers waits this long for the others. The tiny preset's
60 s suits a person's demo; on a loaded 2-core CI machine a second peer can come online later than that, and the
first would then train most of the run alone (a test of what the second one does would see it take a few steps)."""


def tiny_model_config(folder: Path) -> Path:
    path = Path(folder) / "tiny_model.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(TINY_MODEL))
    return path


def injects_faults(env: Optional[Mapping[str, str]]) -> bool:
    """Whether a trainer started with this environment needs the fault-injecting entry point."""
    return any(name.startswith(FAULT_ENV_PREFIX) or name == PARAMS_DIR_ENV for name in (env or {}))


def trainer_entry_point(env: Optional[Mapping[str, str]]) -> dict:
    """``PeerProcess`` keyword arguments for the trainer's entry point: the fault one when ``env`` asks for it."""
    return dict(module=FAULT_TRAINER_MODULE) if injects_faults(env) else dict(script=TRAINER_SCRIPT)


def events_path(folder: Path, name: str) -> Path:
    """Where the peer called ``name`` writes its lifecycle events (next to its log)."""
    return Path(folder) / f"{name}.events.jsonl"


def start_trainer(
    folder: Path,
    name: str,
    run_id: str,
    *,
    initial_peers: Sequence[str] = (),
    extra: Sequence[str] = (),
    env: Optional[Dict[str, str]] = None,
) -> PeerProcess:
    """A trainer with the tiny run preset; its output_dir, identity and log live in folder/name, its events in
    folder/name.events.jsonl (``peer.events``)."""
    folder = Path(folder)
    args = [
        "--config",
        "tiny",
        "--model_config",
        tiny_model_config(folder),
        "--run_id",
        run_id,
        "--output_dir",
        folder / name,
        "--identity_path",
        folder / name / "identity.key",
        "--startup_wait",  # before extra: a test's own value wins
        str(MIN_PEERS_WAIT),
    ]
    if initial_peers:
        args += ["--initial_peers", *initial_peers]
    return PeerProcess(
        [*args, *extra],
        name=name,
        log_path=folder / f"{name}.log",
        env=env,
        events_path=events_path(folder, name),
        **trainer_entry_point(env),
    ).start()


def wait_for_epoch(peer: PeerProcess, epoch: int, timeout: float) -> int:
    """Wait until the peer has finished global epoch ``epoch`` or a later one; return the epoch it finished.

    "or a later one": a peer in a swarm may skip an epoch (it catches up by downloading the state), so waiting
    for one exact epoch could wait for an event that never comes.
    """
    event = peer.events.wait("epoch_done", timeout, where=lambda e: int(e["epoch"]) >= epoch)
    return int(event["epoch"])


def _loss(event: dict) -> float:
    """An epoch's mean loss; an epoch without a finished micro-step has none (null), logged as nan."""
    return math.nan if event.get("loss") is None else float(event["loss"])


def epoch_done_events(peer: PeerProcess) -> List[dict]:
    """The peer's ``epoch_done`` events, oldest first (epoch, loss, mini_steps, samples, steps, skipped, now_at,
    time)."""
    return peer.events.all("epoch_done")


def epoch_losses(peer: PeerProcess) -> Dict[int, float]:
    """Mean loss of every global epoch the peer finished, from its ``epoch_done`` events."""
    return {int(e["epoch"]): _loss(e) for e in epoch_done_events(peer)}


def final_params(folder: Path) -> Dict[str, torch.Tensor]:
    payload = torch.load(Path(folder) / "final_params.pt", map_location="cpu", weights_only=True)
    return payload["params"]


def final_epoch(folder: Path) -> int:
    return torch.load(Path(folder) / "final_params.pt", map_location="cpu", weights_only=True)["epoch"]


def params_dir(folder: Path, name: str) -> Path:
    """Where the trainer called ``name`` dumps its parameters after each global epoch (``param_dump_env``)."""
    return Path(folder) / name / "params"


def param_dump_env(folder: Path, name: str) -> Dict[str, str]:
    """``start_trainer``'s env for a trainer that dumps its parameters after each global epoch into
    ``params_dir(folder, name)`` (the test entry point does it)."""
    return {PARAMS_DIR_ENV: str(params_dir(folder, name))}


def round_param_differences(folder: Path, names: Sequence[str], *, all_pairs: bool = False) -> Dict[int, float]:
    """For every global epoch that all these trainers dumped (``param_dump_env``): the largest absolute difference
    of any parameter between the first trainer and each other one after that epoch (``all_pairs``: between any two
    of them)."""
    dumps = [{int(p.stem.split("_")[1]): p for p in params_dir(folder, name).glob("epoch_*.pt")} for name in names]
    common = sorted(set(dumps[0]).intersection(*dumps[1:]))
    differences = {}
    for epoch in common:
        states = [torch.load(d[epoch], map_location="cpu", weights_only=True) for d in dumps]
        pairs = itertools.combinations(states, 2) if all_pairs else ((states[0], other) for other in states[1:])
        differences[epoch] = max((largest_difference(x, y) for x, y in pairs), default=0.0)
    return differences


def largest_difference(reference: Dict[str, torch.Tensor], other: Dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between each tensor of ``reference`` and ``other``'s tensor of the same name."""
    return max((float((tensor - other[name]).abs().max()) for name, tensor in reference.items()), default=0.0)


def max_param_difference(folders: List[Path]) -> float:
    """Largest absolute difference of any parameter between the first peer and each other peer."""
    reference = final_params(folders[0])
    worst = 0.0
    for folder in folders[1:]:
        other = final_params(folder)
        assert other.keys() == reference.keys()
        worst = max(worst, largest_difference(reference, other))
    return worst
