"""Trainer-specific helpers on top of ``peers``: start a trainer, read its epochs, compare final parameters."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from helpers.peers import TINY_MODEL, PeerProcess

EPOCH_DONE_RE = re.compile(r"Global epoch (\d+) done: loss ([\d.naif]+) over (\d+) micro-steps")


def tiny_model_config(folder: Path) -> Path:
    path = Path(folder) / "tiny_model.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(TINY_MODEL))
    return path


def start_trainer(folder: Path, name: str, run_id: str, *, initial_peers: Sequence[str] = (),
                  extra: Sequence[str] = (), env: Optional[Dict[str, str]] = None) -> PeerProcess:
    """A trainer with the tiny run preset; its output_dir, identity and log live in folder/name."""
    folder = Path(folder)
    args = ["--config", "tiny", "--model_config", tiny_model_config(folder), "--run_id", run_id,
            "--output_dir", folder / name, "--identity_path", folder / name / "identity.key"]
    if initial_peers:
        args += ["--initial_peers", *initial_peers]
    return PeerProcess([*args, *extra], name=name, log_path=folder / f"{name}.log", env=env).start()


def wait_for_epoch(peer: PeerProcess, epoch: int, timeout: float) -> int:
    """Wait until the peer has finished global epoch ``epoch`` or a later one; return the epoch it finished.

    "or a later one": a peer in a swarm may skip an epoch (it catches up by downloading the state), so waiting
    for one exact epoch could wait for a line that never comes.
    """
    match = peer.wait_for(EPOCH_DONE_RE.pattern, timeout, where=lambda m: int(m.group(1)) >= epoch)
    return int(match.group(1))


def epoch_losses(log: str) -> Dict[int, float]:
    """Mean loss of every global epoch the peer finished, from its per-epoch summary lines."""
    return {int(m.group(1)): float(m.group(2)) for m in EPOCH_DONE_RE.finditer(log)}


def final_params(folder: Path) -> Dict[str, torch.Tensor]:
    payload = torch.load(Path(folder) / "final_params.pt", map_location="cpu", weights_only=True)
    return payload["params"]


def final_epoch(folder: Path) -> int:
    return torch.load(Path(folder) / "final_params.pt", map_location="cpu", weights_only=True)["epoch"]


def max_param_difference(folders: List[Path]) -> float:
    """Largest absolute difference of any parameter between the first peer and each other peer."""
    reference = final_params(folders[0])
    worst = 0.0
    for folder in folders[1:]:
        other = final_params(folder)
        assert other.keys() == reference.keys()
        for name, tensor in reference.items():
            worst = max(worst, float((tensor - other[name]).abs().max()))
    return worst
