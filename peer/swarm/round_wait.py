"""How long the training loop waits for a gradient averaging round: long enough for the rounds this peer's link
really carries.

hivemind waits ``averaging_timeout`` and then steps with the local gradients, while the round goes on in the
background and usually completes a moment later: on a 10 Mbit/s home uplink a ``tiny`` round takes about as long
as the preset's 3 s, and half the rounds were thrown away although every byte had been exchanged. The wait is
therefore ``averaging_timeout`` at least, and ``SLACK`` times the slowest of the last ``HISTORY`` rounds that
succeeded, timed until they really completed (late ones included), at most ``CAP`` times ``averaging_timeout``.
A round that fails or never completes does not lengthen the wait: a peer that vanished mid-round costs no more
than it did.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Deque

HISTORY = 5
SLACK = 1.5
CAP = 5.0


class RoundWait:
    """Tracks the duration of completed rounds and gives the wait for the next one (module docstring)."""

    def __init__(self, averaging_timeout: float):
        self.averaging_timeout = averaging_timeout
        self._durations: Deque[float] = collections.deque(maxlen=HISTORY)
        self._lock = threading.Lock()

    def seconds(self) -> float:
        with self._lock:
            slowest = max(self._durations, default=0.0)
        return min(CAP * self.averaging_timeout, max(self.averaging_timeout, SLACK * slowest))

    def completed(self, seconds: float) -> None:
        """A round succeeded ``seconds`` after the training loop began waiting for it."""
        with self._lock:
            self._durations.append(seconds)

    def watch(self, control) -> None:
        """Time ``control`` (a hivemind ``StepControl``, an MPFuture made in this process) from now until it
        completes, if it succeeds; the callback runs in hivemind's future thread."""
        began = time.monotonic()

        def done(future) -> None:
            if not future.cancelled() and future.exception() is None:
                self.completed(time.monotonic() - began)

        control.add_done_callback(done)
