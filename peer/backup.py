"""Local backups of the training state: written atomically, never replaced by a broken one.

The newest backup and the one before it are kept, each with a checksum of its contents: a backup
damaged on disk (truncated, or bytes changed, which ``torch.load`` may not notice) is reported and
the previous one is used instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Optional

import torch

from peer.swarm import events
from peer.swarm.backup_format import (  # noqa: F401 (BackupError is part of this module's interface)
    BACKUP_NAME,
    PREVIOUS_BACKUP_NAME,
    BackupError,
    backup_schema,
    read_backup,
)
from peer.swarm.hivemind_seam import sync_offloaded_parameters
from peer.swarm.tensors import all_finite, atomic_torch_save, tensor_digest

logger = logging.getLogger(__name__)

FINAL_PARAMS_NAME = "final_params.pt"


def save_backup(output_dir: str, model: torch.nn.Module, optimizer) -> Optional[Path]:
    """Parameters + optimizer state + epoch; returns None (logged) if anything is NaN/inf or the write fails (e.g.
    a full disk): a failed backup never ends training and never removes the last good one."""
    # a delayed optimizer step runs in hivemind's background thread under this lock: no half-updated snapshot
    lock = getattr(getattr(optimizer, "state_averager", None), "lock_optimizer", None) or contextlib.nullcontext()
    with lock:
        opt_state = optimizer.state_dict()
        opt_tensors = [
            t
            for state in opt_state["state"].values()
            if isinstance(state, dict)
            for t in state.values()
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        ]
        if not all_finite(model.parameters()) or not all_finite(opt_tensors):
            logger.error(
                "Not writing a backup: parameters or optimizer statistics are NaN/inf; the previous backup is kept"
            )
            return None
        path = Path(output_dir) / BACKUP_NAME
        payload = dict(
            model=model.state_dict(), optimizer=opt_state, schema=backup_schema(model), epoch=optimizer.local_epoch
        )
        feedback = error_feedback_of(optimizer)
        if feedback is not None:  # --outer_compression sparse: what this peer still owes the swarm
            payload["error_feedback"] = feedback.state()
        payload["digest"] = tensor_digest(payload)
        try:
            if path.exists():  # the newest becomes the previous one; a crash before the next line leaves that one
                os.replace(path, path.with_name(PREVIOUS_BACKUP_NAME))
            atomic_torch_save(payload, path)
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
            # atomic_torch_save removed its partial file; the last good backup is backup.prev.pt (load_backup
            # falls back to it), so nothing is lost and training goes on
            logger.error(
                "Could not write the backup at global epoch %d to %s (%s); the previous backup is kept and the "
                "backup is retried at the next epoch. Free disk space in --output_dir or point it elsewhere.",
                optimizer.local_epoch,
                path,
                str(e).strip().splitlines()[0][:200] if str(e).strip() else repr(e),
            )
            events.emit("backup_failed", epoch=optimizer.local_epoch, path=str(path), error=type(e).__name__)
            return None
        logger.info("Wrote a local backup at global epoch %d to %s", optimizer.local_epoch, path)
        events.emit("backup_written", epoch=optimizer.local_epoch, path=str(path))
        return path


def load_backup(output_dir: str, model: torch.nn.Module, optimizer) -> Optional[Path]:
    """Restore the newest usable backup (the newest, else the previous one) that matches this model; returns its
    path, or None (with a log line per unusable file) if there is none."""
    for path in (Path(output_dir) / BACKUP_NAME, Path(output_dir) / PREVIOUS_BACKUP_NAME):
        payload = _read_backup(path, model) if path.exists() else None
        if payload is None:
            continue
        with torch.no_grad():
            model.load_state_dict(payload["model"])
            optimizer.load_state_dict(payload["optimizer"])
            sync_offloaded_parameters(optimizer)
            _restore_error_feedback(optimizer, payload.get("error_feedback"), path)
        logger.info("Restored the local backup from %s (global epoch %d)", path, optimizer.local_epoch)
        return path
    return None


def error_feedback_of(optimizer):
    """The error-feedback buffer of ``--outer_compression sparse`` (None in the other modes)."""
    return getattr(getattr(optimizer, "grad_averager", None), "feedback", None)


def _restore_error_feedback(optimizer, saved, path: Path) -> None:
    """A backup of the sparse mode restores the buffer; one without it (another mode, or a different model size)
    leaves it at zero: nothing owed is the safe start (at most one round's left-out values are lost)."""
    feedback = error_feedback_of(optimizer)
    if feedback is None:
        return
    if saved is None:
        feedback.reset()
        logger.info("The backup %s has no error-feedback buffer (another --outer_compression): starting from 0", path)
    elif not feedback.load(saved):
        logger.warning("The error-feedback buffer in %s does not fit this run (or is NaN/inf): starting from 0", path)


def _read_backup(path: Path, model: torch.nn.Module) -> Optional[dict]:
    """The backup's contents if it is intact and fits this model, else None with a log line that says why."""
    try:
        return read_backup(path, model)
    except BackupError as e:
        logger.error("Ignoring the backup %s: %s", path, e)
        return None


def save_params(path: Path, model: torch.nn.Module, epoch: int) -> Path:
    """The model's parameters and the global epoch they belong to (the format of the final parameters)."""
    atomic_torch_save(dict(params={k: v.detach().cpu() for k, v in model.state_dict().items()}, epoch=epoch), path)
    return path


def save_final_params(output_dir: str, model: torch.nn.Module, epoch: int) -> Path:
    """The parameters a peer ends with (tests compare these across peers)."""
    path = save_params(Path(output_dir) / FINAL_PARAMS_NAME, model, epoch)
    logger.info("Wrote final parameters (global epoch %d) to %s", epoch, path)
    return path
