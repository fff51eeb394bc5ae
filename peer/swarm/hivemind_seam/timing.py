"""Phase observers: callbacks told when the parts of hivemind's global epoch that LeanHive cannot time from outside
start and end (the swarm benchmark's timers), so that no code outside this seam wraps hivemind's private methods.

``observe_phases(observer)`` registers ``observer(phase, start, end)`` (unix times) for every phase this process
runs, and the averager processes it forks afterwards (register before building the optimizer):

- ``grad_allreduce`` / ``state_allreduce``: one all-reduce round of the gradient (or pseudo-gradient) / state
  averager, measured in the averager's own process (around ``_run_allreduce_inplace_``);
- ``grad_wait``: the training loop waiting for the gradient all-reduce, matchmaking included (around
  ``hivemind.Optimizer._average_gradients_and_load_into_optimizer``).

With no observer registered, a phase costs two clock reads.

``observe_rounds(observer)`` registers ``observer(outcome, group_size)`` for every gradient (or pseudo-gradient)
averaging round the training loop waited for: ``ok`` (an average came back, even if the group lost a member on
the way), ``no_group`` (matchmaking found nobody in time), ``timeout`` or ``failed`` (the round broke off after the
group formed), from ``round_outcome``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Callable, Iterator, List, Tuple

from hivemind.optim.state_averager import TrainingStateAverager

logger = logging.getLogger(__name__)

PHASES = ("grad_allreduce", "state_allreduce", "grad_wait")

PhaseObserver = Callable[[str, float, float], None]
_observers: List[PhaseObserver] = []
ROUND_EVENTS = ("ok", "no_group", "timeout", "failed")
RoundObserver = Callable[[str, int], None]
_round_observers: List[RoundObserver] = []


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


def observe_rounds(observer: RoundObserver) -> Callable[[], None]:
    """Call ``observer(event, group_size)`` for each averaging round (see the module docstring), in the training
    process; returns the function that unregisters it."""
    _round_observers.append(observer)
    return functools.partial(_round_observers.remove, observer)


def report_round(event: str, group_size: int = 0) -> None:
    for observer in list(_round_observers):
        try:
            observer(event, group_size)
        except Exception:
            logger.warning("A round observer failed on %s", event, exc_info=True)


def round_outcome(control) -> Tuple[str, int]:
    """How the round behind hivemind's ``StepControl`` ended, once the optimizer stopped waiting for it."""
    if not control.done():
        return "timeout", 0  # the optimizer waited averaging_timeout and went on with its local gradients
    try:
        group_info = control.result(timeout=0)
    except (asyncio.TimeoutError, TimeoutError):
        return "timeout", 0
    except BaseException as e:  # hivemind reports a failed matchmaking as an AllreduceException with this text
        return ("no_group" if "could not find a group" in str(e) else "failed"), 0
    return "ok", len(group_info) if group_info is not None else 0
