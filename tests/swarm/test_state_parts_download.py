"""State downloads against real donor processes on 127.0.0.1 (benchmarks/testbed/state_donor.py: LeanHive's real
optimizer and state averager over a small model): a stream cut short is refused before anything is reshaped."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import List

import hivemind
import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.testbed.processes import PeerProcess, kill_all, share_tensors_by_file_descriptor
from benchmarks.testbed.state_donor import make_model, make_optimizer
from peer.swarm.network import make_validators

seam_logger = logging.getLogger("peer.swarm.hivemind_seam.averaging")


def start_donor(folder: Path, name: str, run_id: str, *args, initial_peers=()) -> PeerProcess:
    ready = folder / f"{name}.ready"
    extra = ["--initial_peers", *initial_peers] if initial_peers else []
    peer = PeerProcess(
        ["--run_id", run_id, "--ready", ready, "--state_out", folder / f"{name}.pt", *extra, *args],
        name=name,
        log_path=folder / f"{name}.log",
        module="benchmarks.testbed.state_donor",
    ).start()
    peer.ready_path = ready
    return peer


def wait_ready(peer: PeerProcess, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while not peer.ready_path.exists():
        if peer.poll() is not None:
            raise RuntimeError(f"{peer.name} exited with {peer.poll()}:\n{peer.tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{peer.name} was not ready within {timeout:.0f} s:\n{peer.tail()}")
        time.sleep(0.2)
    return json.loads(peer.ready_path.read_text())


class Joiner:
    """A joining peer in the test process: the same model from another seed, LeanHive's real optimizer."""

    def __init__(self, run_id: str, initial_peers: List[str], log_path: Path, **collab):
        share_tensors_by_file_descriptor()
        # the download runs in the averager process (forked below): it inherits this handler
        self.log_path = log_path
        self.handler = logging.FileHandler(log_path)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        seam_logger.addHandler(self.handler)
        key = RSAPrivateKey()
        self.dht = hivemind.DHT(
            start=True,
            initial_peers=initial_peers,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            record_validators=make_validators(run_id, key)[0],
        )
        self.optimizer = make_optimizer(make_model(seed=2), self.dht, run_id, key, **collab)

    def state(self) -> list:
        _, tensors, _ = self.optimizer.state_averager.get_current_state()
        return tensors

    def log(self) -> str:
        return self.log_path.read_text()

    def close(self):
        self.optimizer.shutdown()
        self.dht.shutdown()
        seam_logger.removeHandler(self.handler)
        self.handler.close()


@pytest.mark.timeout(240)
def test_a_state_stream_cut_short_is_refused_before_it_is_reshaped(tmp_path):
    """A donor whose stream ends cleanly at 128 KiB (a relay-v2 circuit's data limit): the joiner names the cut
    (the tensor, the bytes it got of its size) instead of hivemind's ``shape '[4096, 128]' is invalid``, applies
    nothing, and keeps its own state."""
    run_id = "cut_stream"
    peers = [start_donor(tmp_path, "cut", run_id, "--mode", "cut", "--cut_bytes", str(128 * 1024))]
    joiner = None
    try:
        join = wait_ready(peers[0])["initial_peers"]
        joiner = Joiner(run_id, join, tmp_path / "joiner.log", load_state_attempts=1)
        before = [t.clone() for t in joiner.state()]
        assert not joiner.optimizer.load_state_checked()
        text = joiner.log()
        assert "is invalid for input of size" not in text, text
        assert "of its" in text and "bytes (a cut connection" in text, text
        assert all(torch.equal(a, b) for a, b in zip(before, joiner.state()))
    finally:
        if joiner is not None:
            joiner.close()
        kill_all(peers)
