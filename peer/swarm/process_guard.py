"""Make a peer's helper processes die with it, even when it is killed with SIGKILL.

hivemind runs the DHT and each averager in a forked ``multiprocessing`` child, and the DHT child runs
the ``p2pd`` daemon. None of them notice when the peer is SIGKILLed, so without this they linger.

``install()`` registers a multiprocessing after-fork hook: every multiprocessing child of the peer starts
a watchdog thread that, once its parent is gone (``getppid()`` changes), kills its own descendants
(``p2pd``) and exits. A kernel parent-death signal alone would not do: it would kill the DHT child
before it could take ``p2pd`` down with it.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import threading

import psutil

logger = logging.getLogger(__name__)

_WATCH_PERIOD = 0.25  # seconds between checks of the parent's liveness


class _Guard:
    """The object multiprocessing keeps a weak reference to; it must live as long as the module."""

    installed = False


_GUARD = _Guard()


def _kill_descendants() -> None:
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass


def _watch_parent(parent_pid: int) -> None:
    stop = threading.Event()
    while not stop.wait(_WATCH_PERIOD):
        if os.getppid() != parent_pid:
            _kill_descendants()
            os._exit(1)


def _after_fork(_guard: _Guard) -> None:
    parent = multiprocessing.parent_process()
    parent_pid = parent.pid if parent is not None else os.getppid()
    if os.getppid() != parent_pid:  # the parent died before we got here
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()


def install() -> None:
    """Call once, early, in the peer's main process (before the DHT and the optimizer are created)."""
    if _GUARD.installed:
        return
    multiprocessing.util.register_after_fork(_GUARD, _after_fork)
    _GUARD.installed = True
