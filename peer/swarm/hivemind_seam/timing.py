"""Phase observers: callbacks told when the parts of hivemind's global epoch that LeanHive cannot time from outside
start and end (the swarm benchmark's timers), so that no code outside this seam wraps hivemind's private methods.

``observe_phases(observer)`` registers ``observer(phase, start, end)`` (unix times) for every phase this process
runs, and the averager processes it forks afterwards (register before building the optimizer):

- ``grad_allreduce`` / ``state_allreduce``: one all-reduce round of the gradient (or pseudo-gradient) / state
  averager, measured in the averager's own process (around ``_run_allreduce_inplace_``);
- ``grad_wait``: the training loop waiting for the gradient all-reduce, matchmaking included (around
  ``hivemind.Optimizer._average_gradients_and_load_into_optimizer``).

With no observer registered, a phase costs two clock reads.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Callable, Iterator, List

from hivemind.optim.state_averager import TrainingStateAverager

logger = logging.getLogger(__name__)

PHASES = ("grad_allreduce", "state_allreduce", "grad_wait")

PhaseObserver = Callable[[str, float, float], None]
_observers: List[PhaseObserver] = []


def observe_phases(observer: PhaseObserver) -> Callable[[], None]:
    """Call ``observer(phase, start, end)`` after each phase (see the module docstring); returns the function that
    unregisters it. An observer that raises is logged, never allowed to fail the phase it observed."""
    _observers.append(observer)
    return functools.partial(_observers.remove, observer)


@contextlib.contextmanager
def timed_phase(phase: str) -> Iterator[None]:
    """Report the time the body takes to every observer as ``phase`` (one of ``PHASES``)."""
    start = time.time()
    try:
        yield
    finally:
        end = time.time()
        for observer in list(_observers):
            try:
                observer(phase, start, end)
            except Exception:
                logger.warning("A phase observer failed on %s", phase, exc_info=True)


def timed_allreduce(method: Callable) -> Callable:
    """Decorates an averager's ``_run_allreduce_inplace_``: each round is a ``state_allreduce`` phase for the state
    averager and a ``grad_allreduce`` one for the gradient averagers."""

    @functools.wraps(method)
    async def timed(self, *args, **kwargs):
        with timed_phase("state_allreduce" if isinstance(self, TrainingStateAverager) else "grad_allreduce"):
            return await method(self, *args, **kwargs)

    return timed
