"""Local backups of the training state: written atomically, never replaced by a broken one.

The newest backup and the one before it are kept, each with a checksum of its contents: a backup
damaged on disk (truncated, or bytes changed, which ``torch.load`` may not notice) is reported and
the previous one is used instead.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

BACKUP_NAME = "backup.pt"
PREVIOUS_BACKUP_NAME = "backup.prev.pt"  # the backup before the newest one, used if the newest is damaged
FINAL_PARAMS_NAME = "final_params.pt"


def all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _schema(model: torch.nn.Module) -> list:
    return [(name, list(param.shape)) for name, param in model.state_dict().items()]


def tensor_digest(obj) -> str:
    """SHA-256 over a nested structure of tensors and plain values, in a fixed order."""
    digest = hashlib.sha256()
    _feed(digest, obj)
    return digest.hexdigest()


def _feed(digest, obj) -> None:
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach().cpu().contiguous().reshape(-1)
        digest.update(f"T{tensor.dtype}{tuple(obj.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        digest.update(b"{")
        for key in sorted(obj, key=repr):
            _feed(digest, key)
            _feed(digest, obj[key])
        digest.update(b"}")
    elif isinstance(obj, (list, tuple)):
        digest.update(b"[")
        for item in obj:
            _feed(digest, item)
        digest.update(b"]")
    else:
        digest.update(repr(obj).encode())


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
    # a delayed optimizer step runs in hivemind's background thread under this lock: no half-updated snapshot
    lock = getattr(getattr(optimizer, "state_averager", None), "lock_optimizer", None) or contextlib.nullcontext()
    with lock:
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
        payload["digest"] = tensor_digest(payload)
        if path.exists():  # the newest becomes the previous one; a crash before the next line leaves that one
            os.replace(path, path.with_name(PREVIOUS_BACKUP_NAME))
        atomic_torch_save(payload, path)
        logger.info("Wrote a local backup at global epoch %d to %s", optimizer.local_epoch, path)
        return path


def load_backup(output_dir: str, model: torch.nn.Module, optimizer) -> bool:
    """Restore the newest usable backup (the newest, else the previous one) that matches this model; False
    (with a log line per unusable file) if there is none."""
    for path in (Path(output_dir) / BACKUP_NAME, Path(output_dir) / PREVIOUS_BACKUP_NAME):
        payload = _read_backup(path, model) if path.exists() else None
        if payload is None:
            continue
        with torch.no_grad():
            model.load_state_dict(payload["model"])
            optimizer.load_state_dict(payload["optimizer"])
            sync_offloaded_parameters(optimizer)
        logger.info("Restored the local backup from %s (global epoch %d)", path, optimizer.local_epoch)
        return True
    return False


def _read_backup(path: Path, model: torch.nn.Module) -> Optional[dict]:
    """The backup's contents if it is intact and fits this model, else None with a log line that says why."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        reason = "the file is empty" if path.stat().st_size == 0 else (str(e).strip().splitlines() or [repr(e)])[0]
        logger.error("Ignoring the unreadable backup %s (%s); delete it or fix it to silence this", path, reason[:160])
        return None
    if not isinstance(payload, dict) or "model" not in payload or "optimizer" not in payload:
        logger.error("Ignoring the backup %s: it is not a LeanHive backup", path)
        return None
    digest = payload.pop("digest", None)
    if digest is not None and digest != tensor_digest(payload):
        logger.error("Ignoring the damaged backup %s: its contents do not match its checksum", path)
        return None
    if payload.get("schema") != _schema(model):
        logger.error("Ignoring the backup %s: it was written for a different model config "
                     "(use another --output_dir for a different model)", path)
        return None
    if not all_finite(payload["model"].values()):
        logger.error("Ignoring the backup %s: it contains NaN/inf parameters", path)
        return None
    return payload


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
