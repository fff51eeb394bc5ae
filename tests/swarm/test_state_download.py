"""The state download's one retry policy (``peer.swarm.hivemind_seam.StateDownloadSettings``): counted on the real
download loop of ``LeanHiveStateAverager`` over fake peers (no averager process, no network), and the flags that set
it reaching a real optimizer's state averager."""

from __future__ import annotations

import asyncio
from typing import Dict, List

import pytest
import torch

from peer.swarm.hivemind_seam import LeanHiveStateAverager, StateDownloadSettings
from peer.swarm.hivemind_seam import averaging as seam_averaging


class _Peers(LeanHiveStateAverager):
    """``LeanHiveStateAverager._download_checked_state`` over fake peers: ``answers[peer]`` lists what the peer does
    each time it is asked ("ok": a state at epoch 3, "behind": one at epoch 1, "error": no answer)."""

    def __init__(self, settings: StateDownloadSettings, peers: List[str], answers: Dict[str, List[str]]):
        # none of hivemind's construction: only what the download loop reads
        self.download_settings = settings
        self._max_download_epoch, self._min_download_epoch, self._progress_key = None, 3, None
        self.peers, self.answers, self.asked = peers, answers, []

    def state_bytes(self) -> int:
        return 1000

    async def _download_in_parts(self, candidates, excluded, deadline):
        raise seam_averaging.NoPartDonors()  # these fake peers serve the whole state only (hivemind's stream)

    def _state_candidates(self):
        return list(self.peers)

    async def _download_from(self, peer, expected_bytes, first_chunk_timeout):
        self.asked.append(peer)
        answer = self.answers.get(peer, ["error"]).pop(0) if self.answers.get(peer) else "error"
        if answer == "error":
            raise ConnectionError(f"{peer} does not answer")
        return {"epoch": 3 if answer == "ok" else 1}, [torch.zeros(1)]

    def check_downloaded_state(self, metadata, tensors):
        if metadata["epoch"] < self._min_download_epoch:  # the real check: a state behind this peer is refused
            return super().check_downloaded_state(metadata, tensors)
        return None

    def download(self):
        return asyncio.run(self._download_checked_state())


@pytest.fixture
def pauses(monkeypatch):
    """The pauses the download loop makes (not slept)."""
    made = []

    async def no_sleep(seconds):
        made.append(seconds)

    monkeypatch.setattr(seam_averaging.asyncio, "sleep", no_sleep)
    return made


@pytest.mark.parametrize("attempts", [1, 3, 5])
def test_a_request_makes_at_most_the_configured_peer_downloads_each_from_the_next_best_peer(attempts, pauses):
    """--load_state_attempts N: at most N peer downloads per request, best peer first, never one peer twice while
    another was not asked (it was up to 18 downloads behind a flag that said 3)."""
    peers = [f"peer{i}" for i in range(8)]
    averager = _Peers(StateDownloadSettings(attempts=attempts), peers, {})
    assert averager.download() is None
    assert averager.asked == peers[:attempts]
    assert pauses == []


def test_state_download_is_retried_while_the_peers_catch_up(pauses):
    """The only peer may be a moment behind (its state is refused): it is asked again after a pause, within the
    same N attempts."""
    late = _Peers(StateDownloadSettings(attempts=3), ["a"], {"a": ["behind", "behind", "ok"]})
    metadata, _ = late.download()
    assert metadata["epoch"] == 3 and late.asked == ["a", "a", "a"]
    assert pauses == [2.0, 4.0]  # as the joining retries paused before
    never = _Peers(StateDownloadSettings(attempts=2), ["a"], {"a": ["behind"] * 5})
    assert never.download() is None and never.asked == ["a", "a"]


def test_every_peer_is_asked_once_before_any_is_asked_again(pauses):
    averager = _Peers(StateDownloadSettings(attempts=5), ["a", "b"], {"a": ["error", "error"], "b": ["behind", "ok"]})
    metadata, _ = averager.download()
    assert metadata["epoch"] == 3 and averager.asked == ["a", "b", "a", "b"]
    assert pauses == [2.0]


def test_with_no_peer_declared_each_attempt_looks_again_after_a_pause(pauses):
    averager = _Peers(StateDownloadSettings(attempts=3, retry_pause=2.0), [], {})
    assert averager.download() is None and averager.asked == []
    assert pauses == [2.0, 4.0]


def test_the_request_budget_covers_every_attempt_and_pause():
    settings = StateDownloadSettings(attempts=4, first_chunk_timeout=10.0, retry_pause=2.0)
    one_peer = seam_averaging.state_download_seconds(10**6, 10.0)
    assert settings.request_seconds(10**6) == pytest.approx(4 * one_peer + 2.0 + 4.0 + 5.0)
    with pytest.raises(ValueError, match="attempts"):
        StateDownloadSettings(attempts=0)


@pytest.mark.timeout(120)
def test_the_collaboration_flags_set_the_state_averagers_download_settings():
    """--load_state_attempts and --load_state_timeout reach the averager that downloads (one settings object)."""
    import hivemind

    from benchmarks.testbed.processes import share_tensors_by_file_descriptor
    from peer.swarm.config import CollaborationArguments, OptimizerArguments
    from peer.swarm.network import make_validators
    from peer.swarm.optimizer import build_optimizer

    share_tensors_by_file_descriptor()
    key = hivemind.utils.crypto.RSAPrivateKey()
    dht = hivemind.DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=make_validators("dl", key)[0]
    )
    collab = CollaborationArguments(target_batch_size=4, matchmaking_time=1.0, load_state_attempts=5)
    collab.load_state_timeout = 7.0
    opt = build_optimizer(
        model=torch.nn.Linear(4, 4),
        dht=dht,
        run_id="dl",
        signing_key=key,
        batch_size_per_step=4,
        collab=collab,
        optim=OptimizerArguments(),
        client_mode=False,
    )
    try:
        expected = StateDownloadSettings(attempts=5, first_chunk_timeout=7.0)
        assert opt.download_settings == opt.state_averager.download_settings == expected
        assert opt.load_state_timeout == 7.0
    finally:
        opt.shutdown()
        dht.shutdown()
