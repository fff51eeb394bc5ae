"""The suite's own cleanup (tests/conftest.py): a child killed while it held one of hivemind's cross-process locks
does not hang the tests after it. The two tests run in this order: the first leaves such a child to the cleanup, the
second needs the locks."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
from hivemind.utils.mpfuture import MPFuture, SharedBytes

FORK = mp.get_context("fork")  # as hivemind starts its DHT and averager processes: they inherit the locks


def _hold_hivemind_locks(holding) -> None:
    MPFuture._update_lock.acquire()  # as in MPFuture._send_update, for the length of one pipe write
    SharedBytes._lock.acquire()
    holding.set()
    time.sleep(3600)


def _set_result(future: MPFuture) -> None:
    future.set_result(42)


@pytest.mark.timeout(60)
def test_a_child_holding_hivemind_locks_is_left_to_the_cleanup():
    holding = FORK.Event()
    child = FORK.Process(target=_hold_hivemind_locks, args=(holding,), daemon=True)
    child.start()
    assert holding.wait(timeout=30)
    # the cleanup kills it after this test, with both locks held


@pytest.mark.timeout(60)
def test_the_next_test_can_still_use_hivemind_futures_across_processes():
    future = MPFuture()  # takes SharedBytes._lock
    child = FORK.Process(target=_set_result, args=(future,))  # sends through MPFuture._update_lock
    child.start()
    try:
        assert future.result(timeout=30) == 42
    finally:
        child.join(timeout=10)
