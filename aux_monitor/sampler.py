"""Generate a short continuation of a fixed prompt from each new checkpoint, off the aux peer's critical path.

One background thread loads the checkpoint from disk (never the replica the swarm's state lives in), generates
greedily for a bounded time and publishes the text in the monitor state (dashboard and ``/api/state``). If
checkpoints arrive faster than samples are made, only the newest waiting one is sampled. Failures are logged
and never reach the aux peer's loop.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch

from aux_monitor.state import CheckpointInfo, SampleText, StateHolder
from model import LeanGPTForCausalLM

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplerSettings:
    prompt: str
    max_new_tokens: int
    max_seconds: float  # generation stops after this long (transformers' max_time), whatever the token count
    tokenizer: str  # folder or Hub name, as the trainers' --tokenizer


class CheckpointSampler:
    """``submit(checkpoint)`` queues it (replacing an older waiting one); ``shutdown()`` stops the thread."""

    def __init__(self, settings: SamplerSettings, holder: StateHolder):
        self.settings, self.holder = settings, holder
        self._tokenizer = None
        self._pending: Optional[CheckpointInfo] = None
        self._busy = False
        self._stopping = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="checkpoint-sampler", daemon=True)
        self._thread.start()

    def submit(self, checkpoint: CheckpointInfo) -> None:
        with self._changed:
            self._pending = checkpoint
            self._changed.notify_all()

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Until nothing is waiting or being sampled; False if ``timeout`` seconds passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending is not None or self._stopping)
                if self._stopping:
                    return
                checkpoint, self._pending, self._busy = self._pending, None, True
            try:
                self.holder.update(sample=self.sample(checkpoint))
            except Exception as e:  # a bad checkpoint or tokenizer must not take the aux peer down
                logger.error(
                    "Could not generate a sample from %s (%s); the next checkpoint is tried", checkpoint.path, e
                )
            finally:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()

    def sample(self, checkpoint: CheckpointInfo) -> SampleText:
        started = time.monotonic()
        tokenizer = self._load_tokenizer()
        model = LeanGPTForCausalLM.from_pretrained(checkpoint.path).eval()
        prompt_ids = tokenizer(self.settings.prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            output = model.generate(
                prompt_ids,
                max_new_tokens=self.settings.max_new_tokens,
                max_time=self.settings.max_seconds,
                do_sample=False,
                repetition_penalty=1.3,  # an early, barely trained model otherwise repeats one token
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        text = tokenizer.decode(output[0, prompt_ids.shape[1] :], skip_special_tokens=True)
        seconds = time.monotonic() - started
        logger.info("Sample at epoch %d (%.1f s): %s%s", checkpoint.epoch, seconds, self.settings.prompt, text)
        return SampleText(
            epoch=checkpoint.epoch, prompt=self.settings.prompt, text=text, time=time.time(), seconds=seconds
        )

    def _load_tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.settings.tokenizer)
        return self._tokenizer
