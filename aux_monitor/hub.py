"""Upload checkpoints to the Hugging Face Hub in the background, one at a time."""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from aux_monitor.state import CheckpointInfo

logger = logging.getLogger(__name__)


class HubUploader:
    """Pushes a checkpoint folder to a model repo; a new checkpoint waits if an upload is still running.

    Failures (network, auth) are logged and do not stop the aux peer: the checkpoint stays on disk and
    the next one is uploaded as usual.
    """

    def __init__(self, repo_id: str, *, private: bool = True):
        from huggingface_hub import HfApi  # imported only when uploading is on

        self.repo_id = repo_id
        self.private = private
        self._api = HfApi()
        self._thread: Optional[threading.Thread] = None
        self._pending: Optional[CheckpointInfo] = None
        # True from the moment a drain thread is started until it finds nothing pending (both under the lock):
        # a thread that has seen nothing pending but is still alive must not be counted on for a new checkpoint
        self._draining = False
        self._lock = threading.Lock()
        self._repo_ready = False
        self.uploaded: list = []  # CheckpointInfo of every successful upload, oldest first

    def submit(self, checkpoint: CheckpointInfo) -> None:
        """Upload ``checkpoint`` soon; if several arrive during one upload, only the newest waiting one is sent."""
        with self._lock:
            self._pending = checkpoint
            if not self._draining:
                self._draining = True
                self._thread = threading.Thread(target=self._drain, name="hub-upload", daemon=True)
                self._thread.start()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Until no upload is running or waiting (or ``timeout`` seconds have passed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            thread = self._thread
            if thread is None:
                return
            thread.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            if thread.is_alive() or self._thread is thread:  # timed out, or nothing newer was started
                return

    def _drain(self) -> None:
        while True:
            with self._lock:
                checkpoint, self._pending = self._pending, None
                if checkpoint is None:
                    self._draining = False
                    return
            self._upload(checkpoint)

    def _upload(self, checkpoint: CheckpointInfo) -> None:
        loss = f", loss {checkpoint.loss:.4f}" if checkpoint.loss is not None else ""
        try:
            if not self._repo_ready:
                self._api.create_repo(self.repo_id, repo_type="model", private=self.private, exist_ok=True)
                self._repo_ready = True
            self._api.upload_folder(
                repo_id=self.repo_id,
                repo_type="model",
                folder_path=checkpoint.path,
                commit_message=f"LeanHive checkpoint: epoch {checkpoint.epoch}{loss}",
            )
        except Exception as e:  # the Hub being down must not take the aux peer down
            logger.error(
                "Uploading %s to the Hub repo %s failed (%s); it stays on disk, the next checkpoint will "
                "be uploaded as usual. Check HF_TOKEN / `huggingface-cli login` and the repo name.",
                checkpoint.path,
                self.repo_id,
                e,
            )
            return
        self.uploaded.append(checkpoint)
        logger.info("Uploaded the checkpoint of epoch %d to https://huggingface.co/%s", checkpoint.epoch, self.repo_id)
