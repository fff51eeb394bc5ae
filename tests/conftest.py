"""Shared fixtures: every test leaves no child process behind (hivemind DHT/averager processes, p2pd)."""

import logging
import os
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


@pytest.fixture(autouse=True)
def cleanup_children():
    """Kill whatever a test left running, as hivemind's own test-suite does, and delete the shared-memory files its
    killed processes left behind (they would fill the machine's RAM over many runs)."""
    started = time.time() - 1.0  # file times are coarser than the clock
    yield
    leftovers = _kill_children()
    if leftovers:
        logging.getLogger(__name__).info("killed %d leftover child processes", len(leftovers))
    removed = remove_orphaned_shared_memory(since=started)
    if removed:
        logging.getLogger(__name__).info("removed %d shared-memory files of processes that are gone", removed)
