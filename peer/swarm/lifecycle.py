"""The lifecycle every peer's entry point shares: logging set up once, signals, build/run/shutdown, exit.

``run_peer`` builds a peer (trainer or aux) with its builder, runs it until it is done or signalled, always shuts
it down, and ends the process with the right exit status. Entry points: parse, ``configure_logging()``,
``process_guard.install()``, then ``run_peer(builder)``.

A builder (``Builder``) makes a peer whole: it creates each part (DHT, optimizer, data, ...) and registers that
part's shutdown on an ``ExitStack`` as soon as the part exists, then hands the finished parts to the peer's
constructor. The stack is the one shutdown path of both peers: it closes in reverse order of building (the last
part built is shut down first), also when the build was interrupted halfway, and every step runs even if an
earlier one raised.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Tuple, Type

from peer.swarm import events
from peer.swarm.errors import NetworkSetupError

if TYPE_CHECKING:  # imported lazily, like hivemind in configure_logging: a test peer needs neither
    from peer.swarm.watchdog import DHTWatchdog

logger = logging.getLogger(__name__)

LOG_LEVEL_ENV = "LEANHIVE_LOG_LEVEL"
DEBUG_LOGGERS_ENV = "LEANHIVE_DEBUG_LOGGERS"


def configure_logging() -> None:
    """Once per process: our format and level (LEANHIVE_LOG_LEVEL, default INFO) for us and hivemind, and DEBUG for
    the loggers named in LEANHIVE_DEBUG_LOGGERS (comma-separated, e.g. ``hivemind.averaging.matchmaking`` to see
    why averaging rounds find no group, without the flood of a global DEBUG)."""
    from hivemind.utils.logging import use_hivemind_log_handler

    level = os.environ.get(LOG_LEVEL_ENV, "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s [%(name)s] %(message)s", force=True)
    use_hivemind_log_handler("in_root_logger")
    for name in os.environ.get(DEBUG_LOGGERS_ENV, "").split(","):
        if name.strip():
            logging.getLogger(name.strip()).setLevel(logging.DEBUG)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    # hivemind replays the LR schedule on joining, before any optimizer step: expected, not a mistake
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")


@dataclass
class PeerControl:
    """What a peer shares with ``run_peer`` and its signal handler, from before the peer is built until it ends."""

    stop_requested: threading.Event = field(default_factory=threading.Event)
    """Set by a stop request: the peer finishes its current step (or wait), then returns from ``run``."""
    running: bool = False
    """False while the peer is being built (joining): a stop signal then interrupts at once."""
    watchdog: Optional[DHTWatchdog] = None
    """The swarm's watchdog, set by the builder once the DHT is up (None: none runs, as with --rejoin_period 0).
    After the build a dead DHT stops the peer like a signal; its failure makes the exit status 1."""

    def request_stop(self) -> None:
        """Finish the current step, then stop (signal handlers call this)."""
        self.stop_requested.set()


class Peer(Protocol):
    """What run_peer needs of a built trainer or aux peer."""

    def run(self) -> None: ...


Builder = Callable[[PeerControl, contextlib.ExitStack], Peer]
"""Builds a peer whole (joining included) and registers each part's shutdown on the stack as it creates it."""


STOP_GRACE_SECONDS = 20.0  # after a stop signal, the current step may take this long; shutdown gets the rest of 30 s
STOP_RETRY_SECONDS = 5.0  # an interrupt that was swallowed is raised again this much later


class _SignalHandler:
    """First SIGINT/SIGTERM: finish the current step, then leave. A second one, a signal while still joining, or
    a step still running STOP_GRACE_SECONDS later (e.g. an all-reduce waiting out averaging_timeout) stop at once
    (KeyboardInterrupt in the main thread); shutdown still writes the backup."""

    def __init__(self, peer: PeerControl):
        self.peer = peer
        self.shutting_down = False
        self._deadline: Optional[threading.Timer] = None
        signal.signal(signal.SIGINT, self)
        signal.signal(signal.SIGTERM, self)

    def __call__(self, signum, _frame):
        if self.shutting_down:
            logger.info("Received %s: already shutting down", signal.Signals(signum).name)
            return
        stop_now = self.peer.stop_requested.is_set() or not self.peer.running  # a second signal, or still joining
        self.peer.request_stop()
        if stop_now:
            # The request above is made before raising: a KeyboardInterrupt that lands in an at-fork hook or a
            # __del__ (hivemind forks while joining) is printed as "Exception ignored" and lost. The run loop then
            # still sees the request, and the re-armed deadline raises again if the main thread is stuck elsewhere.
            self._arm_deadline(signum, STOP_RETRY_SECONDS, "The stop signal has not taken effect yet: raising it again")
            raise KeyboardInterrupt
        logger.info(
            "Received %s: finishing the current step, then leaving the swarm (a second signal stops at once)",
            signal.Signals(signum).name,
        )
        self._arm_deadline(
            signum,
            STOP_GRACE_SECONDS,
            f"The current step is still running {STOP_GRACE_SECONDS:.0f} s after the stop signal: interrupting it",
        )

    def _arm_deadline(self, signum: int, seconds: float, message: str) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = threading.Timer(seconds, self._overran, args=(signum, message))
        self._deadline.daemon = True
        self._deadline.start()

    def _overran(self, signum: int, message: str) -> None:
        if not self.shutting_down:
            logger.warning("%s", message)
            # aimed at the main thread so that a wait it is blocked in is interrupted; runs the stop-now branch
            signal.pthread_kill(threading.main_thread().ident, signum)

    def stop_for(self, reason: str) -> None:
        """Stop the peer from any thread as a first stop signal would (finish the step, then leave), for ``reason``."""
        if self.shutting_down or self.peer.stop_requested.is_set():
            return
        self.peer.request_stop()
        self._arm_deadline(
            signal.SIGTERM,
            STOP_GRACE_SECONDS,
            f"The current step is still running {STOP_GRACE_SECONDS:.0f} s after {reason}: interrupting it",
        )

    def begin_shutdown(self) -> None:
        self.shutting_down = True
        if self._deadline is not None:
            self._deadline.cancel()


def run_peer(
    build: Builder,
    *,
    setup_errors: Tuple[Type[BaseException], ...] = (NetworkSetupError,),
    events_file: Optional[str] = None,
) -> int:
    """Build, run until done or signalled, always shut down, then end the process (exit 1 on a setup error).

    ``events_file``: where the peer's lifecycle events go (peer.swarm.events), if anywhere."""
    events.open_events(events_file)
    control = PeerControl()
    signals = _SignalHandler(control)
    code = 0
    parts = contextlib.ExitStack()
    try:
        peer = build(control, parts)
        control.running = True
        # a dead DHT or p2pd (peer.swarm.watchdog) stops the peer like a signal would, and the exit status says so
        if control.watchdog is not None:
            control.watchdog.add_failure_callback(lambda _reason: signals.stop_for("the swarm was lost"))
        peer.run()
    except setup_errors as e:
        logger.error("%s", e)
        code = 1
    except KeyboardInterrupt:
        logger.warning("Interrupted: leaving without finishing the current step")
    finally:
        signals.begin_shutdown()
        parts.close()
    failure = control.watchdog.failure if control.watchdog is not None else None
    if failure is not None:
        logger.error("Exiting with status 1: %s", failure)
        code = 1
    events.emit("exiting", code=code)
    events.close_events()
    return exit_despite_stray_threads(code)


def exit_despite_stray_threads(code: int) -> int:
    """End the process with ``code`` once our own shutdown has run (backup written, DHT and averagers stopped).

    A signal that interrupts hivemind.Optimizer's constructor while joining leaves parts it already started
    (its ProgressTracker thread, an averager process) without an owner, and the interpreter's exit would wait
    for them forever (multiprocessing joins its children at exit). So the CLI exits explicitly; hivemind's
    child processes die with us (process_guard).
    """
    stray = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    if stray:
        logger.debug("Exiting with threads still running: %s", ", ".join(stray))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
