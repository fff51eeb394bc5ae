"""Tensor helpers both peers use: finiteness, content digests, atomic and verified saves."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch


def all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


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
