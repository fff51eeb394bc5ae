"""Shared fixtures and markers: every test leaves no child process behind (hivemind DHT/averager processes, p2pd);
opt-in suites run only when ``-m`` names them; ``netns`` tests are skipped where namespaces are unavailable."""

import logging
import os
import re
import sys
import time

import psutil
import pytest

from benchmarks.testbed.processes import remove_orphaned_shared_memory

# One torch thread per process: multi-peer tests run several peers on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")


# Long-lived helpers of the test process itself, not leftovers: torch's shared-memory manager serves every
# later share_memory_() call (datasets uses it), so killing it breaks the tests that come after.
KEEP = {"torch_shm_manager"}


def _kill_children(timeout: float = 5.0) -> list:
    children = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.name() not in KEEP:
                children.append(child)
        except psutil.NoSuchProcess:
            pass
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=timeout)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    return children


def reset_hivemind_locks() -> None:
    """New locks for hivemind's MPFuture and SharedBytes, as hivemind's own test-suite makes after killing children.

    They are ``multiprocessing`` locks: one semaphore shared by the test process and every process forked from it
    (the DHT and averager processes of in-process tests). A child killed while it held one (``MPFuture._send_update``
    holds ``_update_lock`` for a whole pipe write, a state included) leaves it locked for good, and every later
    test's peers block on it: one such kill once turned the rest of a CI run into timeouts (tests/test_conftest.py).
    After a test no child is left that could use the old locks."""
    mpfuture = sys.modules.get("hivemind.utils.mpfuture")
    if mpfuture is not None:
        mpfuture.MPFuture.reset_backend()


@pytest.fixture(autouse=True)
def cleanup_children():
    """Kill whatever a test left running, as hivemind's own test-suite does, and delete the shared-memory files its
    killed processes left behind (they would fill the machine's RAM over many runs)."""
    started = time.time() - 1.0  # file times are coarser than the clock
    yield
    leftovers = _kill_children()
    if leftovers:
        logging.getLogger(__name__).info("killed %d leftover child processes", len(leftovers))
    reset_hivemind_locks()
    removed = remove_orphaned_shared_memory(since=started)
    if removed:
        logging.getLogger(__name__).info("removed %d shared-memory files of processes that are gone", removed)


# Opt-in suites (registered in pyproject.toml): deselected unless the -m expression names them, so the default run
# and `-m "not slow"` leave them out while `-m docker` or `-m "faults or swarm_bench"` selects them.
OPT_IN_MARKERS = ("faults", "local_mode", "swarm_bench", "docker", "home_net")
_OPT_IN_LEFT_OUT = pytest.StashKey[dict]()  # marker -> how many tests it left out of this run


def pytest_collection_modifyitems(config, items):
    expression = config.getoption("markexpr") or ""
    named = {name for name in OPT_IN_MARKERS if re.search(rf"\b{name}\b", expression)}
    kept, dropped = [], []
    for item in items:
        opt_in = {mark.name for mark in item.iter_markers()}.intersection(OPT_IN_MARKERS)
        (dropped if opt_in - named else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
        counts = {}
        for item in dropped:
            for mark in {m.name for m in item.iter_markers()}.intersection(OPT_IN_MARKERS):
                counts[mark] = counts.get(mark, 0) + 1
        config.stash[_OPT_IN_LEFT_OUT] = counts
    if any(item.get_closest_marker("netns") for item in items):
        from benchmarks.testbed.netem.hosts import netns_unavailable_reason

        reason = netns_unavailable_reason()
        if reason:
            for item in items:
                if item.get_closest_marker("netns"):
                    item.add_marker(pytest.mark.skip(reason=reason))


def pytest_report_collectionfinish(config):
    counts = config.stash.get(_OPT_IN_LEFT_OUT, {})
    if counts:
        listed = ", ".join(f"{name} ({count})" for name, count in sorted(counts.items()))
        return f"opt-in suites left out: {listed}; select one with -m NAME"
