"""State downloads from hostile peers, the final barrier's priority, and a download timeout that follows the state's
size.

Real peers on 127.0.0.1: an honest trainer, a hostile state server (benchmarks/testbed/hostile_state_server.py) that
serves a broken copy of the honest state with priority 1e9, and a joining trainer that must take the honest state.
The other broken states run in the fault matrix (``python -m benchmarks.faults``, scenario "s").
"""

from __future__ import annotations

import pytest

from benchmarks.testbed.faults import hostile_state
from peer.swarm.joining import _final_priority


@pytest.mark.slow
@pytest.mark.parametrize("mode", hostile_state.FAST_MODES)
@pytest.mark.timeout(600)
def test_a_joiner_skips_a_broken_state_and_loads_the_honest_one(tmp_path, mode):
    details = hostile_state.hostile_state_server(tmp_path, mode)
    assert details["error"] is None, details
    assert details["loaded_epoch"] <= details["a_epoch_at_join"] + 1, details  # before: 10**12 was applied
    # before: a broadcast 1-element tensor made b differ for good (relative difference ~1, not ~0.05)
    assert details["equal_epochs"], details
    assert details["named_hostile"], details


def test_the_final_barrier_priority_does_not_wrap():
    """Earlier arrival = higher priority, also across a multiple of 1e5 s (``% 1e5`` wrapped every 28 hours)."""
    for epoch in (3, 100, 10**5):
        for earlier, later in ((99_999.0, 100_001.0), (1.7e9, 1.7e9 + 1.0), (1.8e9 - 0.5, 1.8e9 + 0.5)):
            assert _final_priority(epoch, earlier) > _final_priority(epoch, later), (epoch, earlier, later)
        assert epoch + 0.5 <= _final_priority(epoch, 1.8e9) < epoch + 1  # above training priorities, below the next


def test_the_state_download_time_follows_the_state_size():
    """A state of any size that arrives at 20 Mbit/s fits the bound (load_state_timeout is only the first chunk's)."""
    from peer.swarm.hivemind_seam.averaging import state_download_seconds

    for state_bytes in (10**6, 500 * 10**6, 4 * 10**9):
        assert state_download_seconds(state_bytes, 120.0) >= 120.0 + 2 * state_bytes / (20e6 / 8)
