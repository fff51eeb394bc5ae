"""Local backups of the training state: written atomically, never replaced by a broken one."""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

BACKUP_NAME = "backup.pt"
FINAL_PARAMS_NAME = "final_params.pt"


def all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _schema(model: torch.nn.Module) -> list:
    return [(name, list(param.shape)) for name, param in model.state_dict().items()]


def atomic_torch_save(obj, path: Path) -> None:
    """Write to a temp file in the same folder, check it loads back, then rename over the target."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        torch.load(tmp, map_location="cpu", weights_only=True)  # a file that does not load must not win
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_backup(output_dir: str, model: torch.nn.Module, optimizer) -> Optional[Path]:
    """Parameters + optimizer state + epoch; refuses (returns None) if anything is NaN/inf."""
    opt_state = optimizer.state_dict()
    opt_tensors = [t for state in opt_state["state"].values() if isinstance(state, dict)
                   for t in state.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not all_finite(model.parameters()) or not all_finite(opt_tensors):
        logger.error("Not writing a backup: parameters or optimizer statistics are NaN/inf; "
                     "the previous backup is kept")
        return None
    path = Path(output_dir) / BACKUP_NAME
    payload = dict(model=model.state_dict(), optimizer=opt_state, schema=_schema(model),
                   epoch=optimizer.local_epoch)
    atomic_torch_save(payload, path)
    logger.info("Wrote a local backup at global epoch %d to %s", optimizer.local_epoch, path)
    return path


def load_backup(output_dir: str, model: torch.nn.Module, optimizer) -> bool:
    """Restore a backup if one exists and matches this model; False (with a log line) otherwise."""
    path = Path(output_dir) / BACKUP_NAME
    if not path.exists():
        return False
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        logger.error("Ignoring the unreadable backup %s (%s); delete it or fix it to silence this", path, e)
        return False
    if payload.get("schema") != _schema(model):
        logger.error("Ignoring the backup %s: it was written for a different model config "
                     "(use another --output_dir for a different model)", path)
        return False
    if not all_finite(payload["model"].values()):
        logger.error("Ignoring the backup %s: it contains NaN/inf parameters", path)
        return False
    with torch.no_grad():
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
        sync_offloaded_parameters(optimizer)
    logger.info("Restored the local backup from %s (global epoch %d)", path, optimizer.local_epoch)
    return True


@torch.no_grad()
def sync_offloaded_parameters(optimizer) -> None:
    """After changing the model's parameters in place, copy them into hivemind's offloaded copies."""
    averager = optimizer.state_averager
    offloaded = [param for group in averager.optimizer.param_groups for param in group["params"]]
    for main, copy in zip(averager.main_parameters, offloaded):
        if main is not copy:
            copy.copy_(main.detach().to(copy.device, copy.dtype))
    if not averager.reuse_tensors:
        averager._load_local_tensors_into_averager_()  # what hivemind itself does after loading a state
    averager._update_scheduler()


def save_final_params(output_dir: str, model: torch.nn.Module, epoch: int) -> Path:
    """The parameters a peer ends with (tests compare these across peers)."""
    path = Path(output_dir) / FINAL_PARAMS_NAME
    atomic_torch_save(dict(params={k: v.detach().cpu() for k, v in model.state_dict().items()}, epoch=epoch), path)
    logger.info("Wrote final parameters (global epoch %d) to %s", epoch, path)
    return path
