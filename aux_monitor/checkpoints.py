"""Checkpoint directories of the swarm's state: atomic writes, verification, rotation, resume.

A checkpoint is a directory ``epoch_000012/`` holding the model (``save_pretrained``, so
``from_pretrained`` loads it), ``optimizer.pt``, ``scheduler.pt`` (if any) and ``leanhive_checkpoint.json``
(epoch, loss, time, the run's facts when known, and a SHA-256 of every file). It is written under a temporary
name, loaded back and compared with the state it came from, and only then renamed into place, so a crash or a bad
write never leaves something that looks like a checkpoint. Rotation deletes only checkpoints that
verify and are older than the ``keep`` newest verified ones: a damaged checkpoint is reported and
left in place for a human to inspect, never deleted and never overwritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Type

import torch
from transformers import PreTrainedModel

from aux_monitor.state import CheckpointInfo
from peer.swarm import events
from peer.swarm.events import finite_or_none

logger = logging.getLogger(__name__)

MANIFEST = "leanhive_checkpoint.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
FORMAT_VERSION = 1
_NAME = re.compile(r"^epoch_(\d{6,})(?:\.(\d+))?$")
_TMP_PREFIX = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing files, damaged, or does not match the model."""


@dataclass
class TrainingState:
    """The swarm's state at one epoch: what a checkpoint stores and what a resume restores."""

    model: PreTrainedModel
    optimizer_state: dict  # torch.optim.Optimizer.state_dict() of the swarm's optimizer
    scheduler_state: Optional[dict]  # LR scheduler state_dict, None if the run has no scheduler
    epoch: int  # global epoch the state belongs to
    loss: Optional[float]  # swarm training loss at that epoch, if known
    time: float  # unix time the state was taken
    # what the aux peer knew about the run (run_id, samples_seen, validation_loss, ...); shown by exports
    facts: Dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadedCheckpoint:
    path: Path
    state: TrainingState

    def info(self) -> CheckpointInfo:
        return CheckpointInfo(epoch=self.state.epoch, time=self.state.time, path=str(self.path), loss=self.state.loss)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_tree(directory: Path) -> None:
    for path in directory.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sort_key(path: Path):
    match = _NAME.match(path.name)
    return int(match.group(1)), int(match.group(2) or 0)


class CheckpointManager:
    """Writes, verifies, lists, rotates and loads the checkpoints in one directory."""

    def __init__(self, directory: str | os.PathLike, *, keep: int, model_class: Type[PreTrainedModel]):
        if keep < 1:
            raise ValueError(f"keep must be at least 1 (the number of newest checkpoints kept), got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.model_class = model_class
        self._verified: Dict[str, bool] = {}  # file-level verification results by directory name
        self._symlinks_reported: set = set()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_unfinished_writes()

    # ---------------------------------------------------------------- listing
    def list_checkpoints(self) -> List[Path]:
        """Promoted checkpoint directories, newest first (damaged ones included)."""
        paths = []
        for path in self.directory.iterdir():
            if not _NAME.match(path.name):
                continue
            if path.is_symlink():
                # not written by this manager: never loaded, counted, rotated or deleted (it may point anywhere)
                if path.name not in self._symlinks_reported:
                    self._symlinks_reported.add(path.name)
                    logger.warning(
                        "Ignoring %s: it is a symbolic link, not a checkpoint this aux peer wrote; "
                        "copy the directory in instead if it should be used",
                        path,
                    )
                continue
            if path.is_dir():
                paths.append(path)
        return sorted(paths, key=_sort_key, reverse=True)

    # ---------------------------------------------------------------- writing
    def save(self, state: TrainingState) -> CheckpointInfo:
        """Write, verify and promote a checkpoint, then rotate; raises CheckpointError if it does not verify."""
        broken = [name for name, tensor in state.model.state_dict().items() if not torch.isfinite(tensor).all()]
        if broken:
            raise CheckpointError(f"the state of epoch {state.epoch} has NaN/inf parameters ({', '.join(broken[:3])})")
        tmp = None
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}epoch_{state.epoch:06d}-", dir=self.directory))
            self._write(tmp, state)
            loaded = self.load(tmp)
            _check_same_model(state.model, loaded.state.model)
            final = self._free_name(state.epoch)
            os.rename(tmp, final)
            _fsync_dir(self.directory)
        except BaseException as e:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, Exception) and not isinstance(e, CheckpointError):
                # a full disk (torch.save and safetensors report it as their own errors), a read-only folder: the
                # caller logs it and tries again at a later epoch; the checkpoints already written are untouched
                raise CheckpointError(
                    f"writing the checkpoint of epoch {state.epoch} to {self.directory} failed "
                    f"({str(e).strip()[:200] or type(e).__name__}); if the disk is full, free disk space there "
                    "or change --checkpoint_dir"
                ) from e
            raise
        self._verified[final.name] = True
        logger.info("Saved checkpoint of epoch %d to %s", state.epoch, final)
        events.emit("checkpoint_saved", epoch=state.epoch, path=str(final))
        try:
            self.rotate()
        except OSError as e:  # the new checkpoint is in place: an old one that cannot be deleted is not fatal
            logger.error("Could not delete old checkpoints in %s (%s); they are left in place", self.directory, e)
        return CheckpointInfo(epoch=state.epoch, time=state.time, path=str(final), loss=state.loss)

    def _write(self, directory: Path, state: TrainingState) -> None:
        state.model.save_pretrained(directory)
        torch.save(state.optimizer_state, directory / OPTIMIZER_FILE)
        if state.scheduler_state is not None:
            torch.save(state.scheduler_state, directory / SCHEDULER_FILE)
        manifest = dict(
            format=FORMAT_VERSION,
            epoch=state.epoch,
            loss=finite_or_none(state.loss),
            time=state.time,
            model_class=type(state.model).__name__,
            run=state.facts,
            files={p.name: _sha256(p) for p in sorted(directory.iterdir())},
        )
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))
        _fsync_tree(directory)

    def _free_name(self, epoch: int) -> Path:
        """``epoch_000012``, or ``epoch_000012.1`` etc. if a (possibly damaged) one already exists."""
        path, suffix = self.directory / f"epoch_{epoch:06d}", 0
        while os.path.lexists(path):  # a dangling symlink takes the name too (renaming onto it fails)
            suffix += 1
            path = self.directory / f"epoch_{epoch:06d}.{suffix}"
        return path

    # ---------------------------------------------------------------- verifying and loading
    def verify_files(self, path: Path) -> None:
        """Cheap check: the manifest parses and every file it lists is present with its checksum."""
        verify_checkpoint_files(path)

    def load(self, path: str | os.PathLike) -> LoadedCheckpoint:
        """Fully load a checkpoint (model, optimizer, scheduler, metadata); raises CheckpointError."""
        return load_checkpoint(path, self.model_class)

    def load_newest_valid(self) -> Optional[LoadedCheckpoint]:
        """The newest checkpoint that loads; damaged ones are logged and skipped (never deleted)."""
        for path in self.list_checkpoints():
            try:
                loaded = self.load(path)
            except CheckpointError as e:
                self._verified[path.name] = False
                logger.error(
                    "Checkpoint %s is corrupt and will not be used (%s); trying an older one. "
                    "It is left in place for inspection.",
                    path,
                    e,
                )
                continue
            self._verified[path.name] = True
            return loaded
        return None

    # ---------------------------------------------------------------- rotation
    def rotate(self) -> List[Path]:
        """Delete verified checkpoints older than the ``keep`` newest verified ones; returns what was deleted."""
        kept, deleted = 0, []
        for path in self.list_checkpoints():
            if not self._files_ok(path):
                continue
            if kept < self.keep:
                kept += 1
                continue
            try:
                shutil.rmtree(path)
            except OSError as e:
                logger.error("Could not delete the old checkpoint %s (%s); it is left in place", path, e)
                continue
            self._verified.pop(path.name, None)
            deleted.append(path)
            logger.info("Deleted old checkpoint %s (keeping the %d newest)", path, self.keep)
        return deleted

    def _files_ok(self, path: Path) -> bool:
        if path.name not in self._verified:
            try:
                self.verify_files(path)
                self._verified[path.name] = True
            except CheckpointError as e:
                self._verified[path.name] = False
                logger.warning("Checkpoint %s is damaged (%s); it is not counted and not deleted", path, e)
        return self._verified[path.name]

    def _remove_unfinished_writes(self) -> None:
        for path in self.directory.iterdir():
            if path.name.startswith(_TMP_PREFIX):
                logger.warning("Removing %s: an unfinished checkpoint write (never promoted)", path)
                shutil.rmtree(path, ignore_errors=True)


def checkpoint_dirs(directory: Path) -> List[Path]:
    """The checkpoint directories in ``directory`` (symbolic links left out), newest first; no side effects."""
    found = [p for p in directory.iterdir() if _NAME.match(p.name) and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=_sort_key, reverse=True)


def verify_checkpoint_files(path: Path) -> None:
    """Cheap check: the manifest parses and every file it lists is present with its checksum."""
    manifest = _read_manifest(path)
    files = manifest.get("files")
    if not isinstance(files, dict) or "config.json" not in files or OPTIMIZER_FILE not in files:
        raise CheckpointError(f"{path / MANIFEST} lists no model/optimizer files")
    for name, digest in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing")
        if _sha256(file) != digest:
            raise CheckpointError(f"{file} does not match its checksum (damaged or modified)")


def load_checkpoint(path: str | os.PathLike, model_class: Type[PreTrainedModel]) -> LoadedCheckpoint:
    """Verify and fully load one checkpoint directory (also outside a CheckpointManager, e.g. to export it)."""
    path = Path(path)
    verify_checkpoint_files(path)
    manifest = _read_manifest(path)
    try:
        model, info = model_class.from_pretrained(path, output_loading_info=True)
    except Exception as e:
        raise CheckpointError(f"the model in {path} does not load: {e}") from e
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        raise CheckpointError(f"the model in {path} does not match {model_class.__name__}: {problems}")
    try:
        optimizer_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        scheduler_file = path / SCHEDULER_FILE
        scheduler_state = (
            torch.load(scheduler_file, map_location="cpu", weights_only=True) if scheduler_file.exists() else None
        )
    except Exception as e:
        raise CheckpointError(f"the optimizer/scheduler state in {path} does not load: {e}") from e
    epoch, loss, taken = manifest.get("epoch"), manifest.get("loss"), manifest.get("time")
    if not isinstance(epoch, int) or epoch < 0 or not isinstance(taken, (int, float)):
        raise CheckpointError(f"{path / MANIFEST} has no valid epoch/time")
    facts = manifest.get("run")  # absent in checkpoints written before the run's facts were recorded
    return LoadedCheckpoint(
        path=path,
        state=TrainingState(
            model=model,
            optimizer_state=optimizer_state,
            scheduler_state=scheduler_state,
            epoch=epoch,
            loss=loss,
            time=float(taken),
            facts=facts if isinstance(facts, dict) else {},
        ),
    )


def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {MANIFEST} (not a finished LeanHive checkpoint)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / MANIFEST} is unreadable: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path / MANIFEST} is not a format-{FORMAT_VERSION} LeanHive manifest")
    return manifest


def _check_same_model(expected: PreTrainedModel, loaded: PreTrainedModel) -> None:
    want, got = expected.state_dict(), loaded.state_dict()
    if want.keys() != got.keys():
        raise CheckpointError(f"the written model has different tensors: {sorted(set(want) ^ set(got))[:5]}")
    for name, tensor in want.items():
        if not torch.equal(tensor.detach().cpu(), got[name]):
            raise CheckpointError(f"the written model differs from the swarm state in {name}")
