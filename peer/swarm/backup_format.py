"""The trainer's backup file format, shared by the trainer (peer/backup.py writes and restores backups) and the
aux peer's export (aux_monitor/export.py turns one into a Hugging Face model folder)."""

from __future__ import annotations

from pathlib import Path

import torch

from peer.swarm.tensors import all_finite, tensor_digest

BACKUP_NAME = "backup.pt"
PREVIOUS_BACKUP_NAME = "backup.prev.pt"  # the backup before the newest one, used if the newest is damaged


def backup_schema(model: torch.nn.Module) -> list:
    """(name, shape) of every tensor: a backup fits a model only if the schemas are equal."""
    return [(name, list(param.shape)) for name, param in model.state_dict().items()]


class BackupError(ValueError):
    """A backup file that cannot be used; the message says why."""


def read_backup(path: Path, model: torch.nn.Module) -> dict:
    """The backup's contents (model, optimizer, schema, epoch) if it is intact and fits ``model``; else BackupError."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        reason = "the file is empty" if path.stat().st_size == 0 else (str(e).strip().splitlines() or [repr(e)])[0]
        raise BackupError(f"it is unreadable ({reason[:160]}); delete it or fix it to silence this") from None
    if not isinstance(payload, dict) or "model" not in payload or "optimizer" not in payload:
        raise BackupError("it is not a LeanHive backup")
    digest = payload.pop("digest", None)
    if digest is not None and digest != tensor_digest(payload):
        raise BackupError("it is damaged: its contents do not match its checksum")
    if payload.get("schema") != backup_schema(model):
        raise BackupError(
            "it was written for a different model config (use another --output_dir for a different model)"
        )
    if not all_finite(payload["model"].values()):
        raise BackupError("it contains NaN/inf parameters")
    return payload
