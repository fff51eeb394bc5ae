"""State downloads against real donor processes on 127.0.0.1 (benchmarks/testbed/state_donor.py: LeanHive's real
optimizer and state averager over a small model): a stream cut short is refused before anything is reshaped."""

from __future__ import annotations

import json
import logging
import re
import threading
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
        seam_logger.setLevel(logging.INFO)  # the download's summary line (parts per donor) is INFO
        key = RSAPrivateKey()
        self.dht = hivemind.DHT(
            start=True,
            initial_peers=initial_peers,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            record_validators=make_validators(run_id, key)[0],
        )
        self.optimizer = make_optimizer(make_model(seed=2), self.dht, run_id, key, **collab)
        seam_logger.removeHandler(self.handler)  # the forked averager process keeps its copy; other joiners log apart
        self.optimizer.state_averager.allow_state_sharing = False  # its own fresh state is no one's to take

    def state(self) -> list:
        _, tensors, _ = self.optimizer.state_averager.get_current_state()
        return tensors

    def log(self) -> str:
        return self.log_path.read_text()

    def close(self):
        self.optimizer.shutdown()
        self.dht.shutdown()
        self.handler.close()


PART = str(256 << 10)
"""Donors cut their ~6.3 MB state into 25 parts of 256 KiB (the default 4 MiB would make it two)."""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", ["parts", "whole"])
def test_a_state_stream_cut_short_is_refused_before_it_is_reshaped(tmp_path, path):
    """A donor whose streams end cleanly at 128 KiB (a relay-v2 circuit's data limit), serving parts or (an older
    peer) only hivemind's whole-state stream: the joiner names the cut (the tensor or part, the bytes it got of its
    size) instead of hivemind's ``shape '[4096, 128]' is invalid``, applies nothing, and keeps its own state."""
    run_id = f"cut_stream_{path}"
    extra = ["--no_parts"] if path == "whole" else ["--part_bytes", PART]
    peers = [start_donor(tmp_path, "cut", run_id, "--mode", "cut", "--cut_bytes", str(128 * 1024), *extra)]
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


def _donors(folder: Path, run_id: str, specs) -> List[PeerProcess]:
    """Donors from ``specs`` (name, extra args), the first one the others' initial peer; all ready."""
    peers, join = [], []
    for name, args in specs:
        peers.append(start_donor(folder, name, run_id, "--part_bytes", PART, *args, initial_peers=join))
        info = wait_ready(peers[-1])
        peers[-1].peer_id = info["peer_id"]
        join = join or info["initial_peers"]
    peers[0].join = join
    return peers


def _same_state(joiner: Joiner, donor_file: Path) -> bool:
    served = torch.load(donor_file, weights_only=True)
    got = joiner.state()
    return len(served) == len(got) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(served, got))


def _parts_from(text: str) -> dict:
    """peer ID -> parts it delivered, from the joiner's last 'Downloaded the state ... in N parts' line."""
    line = [row for row in text.splitlines() if "Downloaded the state" in row][-1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"(12D3\w+): (\d+) parts", line)}


@pytest.mark.timeout(300)
def test_three_donors_send_disjoint_parts_and_the_joiner_ends_with_their_state(tmp_path):
    run_id = "three_donors"
    peers = _donors(tmp_path, run_id, [(name, []) for name in ("d1", "d2", "d3")])
    joiner = None
    try:
        joiner = Joiner(run_id, peers[0].join, tmp_path / "joiner.log")
        assert not _same_state(joiner, tmp_path / "d1.pt")
        assert joiner.optimizer.load_state_checked()
        assert _same_state(joiner, tmp_path / "d1.pt")
        parts = _parts_from(joiner.log())
        assert set(parts) == {p.peer_id for p in peers} and sum(parts.values()) == 25, joiner.log()
    finally:
        if joiner is not None:
            joiner.close()
        kill_all(peers)


@pytest.mark.timeout(300)
def test_a_donor_killed_mid_download_has_its_parts_moved_to_the_others(tmp_path):
    run_id = "killed_donor"
    slow = ["--serve_rate", str(500_000)]  # ~4 s of parts per donor: time to kill one in the middle
    peers = _donors(tmp_path, run_id, [(name, slow) for name in ("d1", "d2", "d3")])
    joiner = None
    try:
        joiner = Joiner(run_id, peers[0].join, tmp_path / "joiner.log")
        killer = threading.Timer(1.5, peers[2].kill_tree)
        killer.start()
        assert joiner.optimizer.load_state_checked()
        killer.join()
        text = joiner.log()
        assert _same_state(joiner, tmp_path / "d1.pt")
        assert f"of the state from {peers[2].peer_id}" in text and "its parts go to the other donors" in text, text
        parts = _parts_from(text)
        killed = parts.pop(peers[2].peer_id, 0)  # the parts it delivered before it died are verified and kept
        assert killed + sum(parts.values()) == 25 and all(n > killed for n in parts.values()), text
    finally:
        if joiner is not None:
            joiner.close()
        kill_all(peers)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["wrong_part", "wrong_manifest"])
def test_a_donor_serving_one_wrong_part_is_found_and_the_joiner_ends_with_the_honest_state(tmp_path, mode):
    """A real rogue donor serves part 3 with every byte flipped (well formed: the right size), announcing the honest
    digests (caught by the part's digest) or digests of its wrong state (outvoted by the two honest donors)."""
    run_id = f"rogue_{mode}"
    specs = [("d1", []), ("rogue", ["--mode", mode, "--wrong_part", "3"]), ("d2", [])]
    peers = _donors(tmp_path, run_id, specs)
    rogue = peers[1].peer_id
    joiner = None
    try:
        joiner = Joiner(run_id, peers[0].join, tmp_path / "joiner.log")
        for _ in range(3):  # the rogue gets part 3 only if the schedule gives it that part: ask until it did
            assert joiner.optimizer.load_state_checked()
            assert _same_state(joiner, tmp_path / "d1.pt")
            text = joiner.log()
            if mode == "wrong_manifest" or f"Donor {rogue} served part 3" in text:
                break
            joiner.optimizer.state_averager.local_epoch = 0
        if mode == "wrong_part":
            assert f"Donor {rogue} served part 3 of the state whose digest differs" in text, text
        else:
            assert f"Not using the state from {rogue}: its digest" in text and "outvoted" in text, text
            assert rogue not in _parts_from(text)
    finally:
        if joiner is not None:
            joiner.close()
        kill_all(peers)


@pytest.mark.timeout(300)
def test_a_download_cut_off_resumes_with_the_missing_parts_only(tmp_path):
    """The only donor is killed mid-download (the request fails, the verified parts are kept); a donor of the same
    state (same epoch, same digests) appears: the next request fetches only the parts still missing."""
    run_id = "resume"
    peers = _donors(tmp_path, run_id, [("d1", ["--serve_rate", str(500_000)])])
    joiner = None
    try:
        joiner = Joiner(run_id, peers[0].join, tmp_path / "joiner.log", load_state_attempts=1)
        killer = threading.Timer(3.0, peers[0].kill_tree)
        killer.start()
        assert not joiner.optimizer.load_state_checked()
        killer.join()
        kept = re.search(r"Downloaded (\d+) of 25 parts", joiner.log())
        assert kept and 0 < int(kept.group(1)) < 25, joiner.log()
        peers += _donors(
            tmp_path, run_id, [("d2", ["--initial_peers", *[str(m) for m in joiner.dht.get_visible_maddrs()]])]
        )
        assert joiner.optimizer.load_state_checked()
        text = joiner.log()
        assert f"Resuming the download of epoch 0: {kept.group(1)} of 25 parts here" in text, text
        assert _parts_from(text) == {peers[1].peer_id: 25 - int(kept.group(1))}, text
        assert _same_state(joiner, tmp_path / "d2.pt")
    finally:
        if joiner is not None:
            joiner.close()
        kill_all(peers)


@pytest.mark.timeout(300)
def test_a_donor_serves_at_most_its_bound_of_joiners_and_tells_the_others_it_is_busy(tmp_path):
    run_id = "busy"
    peers = _donors(tmp_path, run_id, [("d1", ["--max_joiners", "1", "--serve_rate", str(1_000_000)])])
    first = second = None
    try:
        first = Joiner(run_id, peers[0].join, tmp_path / "first.log")
        second = Joiner(run_id, peers[0].join, tmp_path / "second.log", load_state_attempts=1)
        downloading = threading.Thread(target=first.optimizer.load_state_checked)
        downloading.start()
        time.sleep(1.5)
        assert not second.optimizer.load_state_checked()  # refused at once, not queued behind the first
        downloading.join()
        assert _same_state(first, tmp_path / "d1.pt")
        assert "it answered 'busy'" in second.log(), second.log()
        assert "Busy serving 1 joiners" in peers[0].log(), peers[0].tail()
    finally:
        for joiner in (first, second):
            if joiner is not None:
                joiner.close()
        kill_all(peers)
