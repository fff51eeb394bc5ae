"""What the aux peer knows at a given moment; shared (read-only) by the exporter and the dashboard."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Optional

from aux_monitor.aggregation import SwarmSnapshot


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint that was written and verified (or loaded) by this aux peer."""

    epoch: int
    time: float  # unix time the state was taken
    path: str
    loss: Optional[float] = None  # swarm training loss at that epoch, if known


@dataclass(frozen=True)
class EvalResult:
    epoch: int
    loss: float
    perplexity: float
    time: float


@dataclass(frozen=True)
class SampleText:
    """A continuation of a fixed prompt generated from one checkpoint (to watch the model learn)."""

    epoch: int  # the checkpoint's global epoch
    prompt: str
    text: str  # the continuation only, without the prompt
    time: float  # unix time it was generated
    seconds: float  # how long loading and generating took


@dataclass(frozen=True)
class MonitorState:
    run_id: str
    initial_peers: str  # the "--initial_peers ..." line that joins this swarm
    swarm: SwarmSnapshot
    checkpoint: Optional[CheckpointInfo] = None
    evaluation: Optional[EvalResult] = None
    sample: Optional[SampleText] = None
    generation: int = 0  # bumped by every update, so readers can tell two states apart


class StateHolder:
    """The current MonitorState; writers replace fields atomically, readers get a consistent copy."""

    def __init__(self, initial: MonitorState):
        self._lock = threading.Lock()
        self._state = initial

    def get(self) -> MonitorState:
        with self._lock:
            return self._state

    def update(self, **changes) -> MonitorState:
        with self._lock:
            self._state = dataclasses.replace(self._state, generation=self._state.generation + 1, **changes)
            return self._state
