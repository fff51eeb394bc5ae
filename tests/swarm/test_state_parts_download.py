"""State downloads against real donor processes on 127.0.0.1 (benchmarks/testbed/state_donor.py: LeanHive's real
optimizer and state averager over a small model): a stream cut short is refused before anything is reshaped; the
state comes from several donors at once, part by part; a killed donor's parts move; a rogue donor's wrong part is
found; a cut-off download resumes; a donor serves a bounded number of joiners."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from benchmarks.testbed.processes import kill_all
from benchmarks.testbed.state_donor import Joiner, parts_from, same_state, start_donor, start_donors, wait_ready

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


@pytest.mark.timeout(300)
def test_three_donors_send_disjoint_parts_and_the_joiner_ends_with_their_state(tmp_path):
    run_id = "three_donors"
    peers = start_donors(tmp_path, run_id, [(name, []) for name in ("d1", "d2", "d3")])
    joiner = None
    try:
        joiner = Joiner(run_id, peers[0].join, tmp_path / "joiner.log")
        assert not same_state(joiner, tmp_path / "d1.pt")
        assert joiner.optimizer.load_state_checked()
        assert same_state(joiner, tmp_path / "d1.pt")
        parts = parts_from(joiner.log())
        assert set(parts) == {p.peer_id for p in peers} and sum(parts.values()) == 25, joiner.log()
    finally:
        if joiner is not None:
            joiner.close()
        kill_all(peers)


@pytest.mark.timeout(300)
def test_a_donor_killed_mid_download_has_its_parts_moved_to_the_others(tmp_path):
    run_id = "killed_donor"
    slow = ["--serve_rate", str(500_000)]  # ~4 s of parts per donor: time to kill one in the middle
    peers = start_donors(tmp_path, run_id, [(name, slow) for name in ("d1", "d2", "d3")])
    joiner = None
    try:
        joiner = Joiner(run_id, peers[0].join, tmp_path / "joiner.log")
        killer = threading.Timer(1.5, peers[2].kill_tree)
        killer.start()
        assert joiner.optimizer.load_state_checked()
        killer.join()
        text = joiner.log()
        assert same_state(joiner, tmp_path / "d1.pt")
        assert f"of the state from {peers[2].peer_id}" in text and "its parts go to the other donors" in text, text
        parts = parts_from(text)
        killed = parts.pop(peers[2].peer_id, 0)  # the parts it delivered before it died are verified and kept
        assert killed + sum(parts.values()) == 25 and all(n > killed for n in parts.values()), text
    finally:
        if joiner is not None:
            joiner.close()
        kill_all(peers)


@pytest.mark.timeout(300)
def test_donors_a_moment_behind_are_waited_for_and_share_the_download_of_the_newest_epoch(tmp_path):
    """Two of three donors still announce the epoch before (they end their round a moment after the first) for 2.5 s
    after the joiner's first ask, then the same state at the newest epoch: the joiner asks them again, and all three
    serve it the newest epoch. (Without the wait the two lagging donors outnumber the first, and the joiner took their
    older state.) Two donors far behind (epoch 0, another state) are candidates too: they neither count as holding
    the newest epoch nor are waited for."""
    run_id = "lagging_donors"
    lag = ["--epoch", "3", "--lag_seconds", "2.5"]
    far = ["--seed", "3"]
    specs = [("d1", ["--epoch", "3"]), ("d2", lag), ("d3", lag), ("old1", far), ("old2", far)]
    peers = start_donors(tmp_path, run_id, specs)
    joiner = None
    try:
        joiner = Joiner(run_id, peers[0].join, tmp_path / "joiner.log")
        assert joiner.optimizer.load_state_checked()
        text = joiner.log()
        assert "Downloaded the state (" in text and ", epoch 3) in 25 parts from 3 donor(s)" in text, text
        assert re.search(r"2 donor\(s\) reached epoch 3 after \d+\.\d s", text), text
        assert set(parts_from(text)) == {p.peer_id for p in peers[:3]}, text
        assert same_state(joiner, tmp_path / "d1.pt") and joiner.optimizer.local_epoch == 3
    finally:
        if joiner is not None:
            joiner.close()
        kill_all(peers)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["wrong_part", "wrong_manifest"])
def test_a_donor_serving_one_wrong_part_is_found_and_the_joiner_ends_with_the_honest_state(tmp_path, mode):
    """A real rogue donor serves one part with every byte flipped (well formed: the right size): the first part it
    is asked for, announcing the honest digests (caught by the part's digest), or part 3, announcing the digests of
    its wrong state (outvoted by the two honest donors)."""
    run_id = f"rogue_{mode}"
    wrong = "-1" if mode == "wrong_part" else "3"
    specs = [("d1", []), ("rogue", ["--mode", mode, "--wrong_part", wrong]), ("d2", [])]
    peers = start_donors(tmp_path, run_id, specs)
    rogue = peers[1].peer_id
    joiner = None
    try:
        joiner = Joiner(run_id, peers[0].join, tmp_path / "joiner.log")
        assert joiner.optimizer.load_state_checked()
        assert same_state(joiner, tmp_path / "d1.pt")
        text = joiner.log()
        if mode == "wrong_part":
            assert re.search(f"Donor {rogue} served part \\d+ of the state whose digest differs", text), text
            assert sum(parts_from(text).values()) == 25, text
        else:
            assert f"Not using the state from {rogue}: its digest" in text and "outvoted" in text, text
            assert rogue not in parts_from(text)
    finally:
        if joiner is not None:
            joiner.close()
        kill_all(peers)


@pytest.mark.timeout(300)
def test_a_download_cut_off_resumes_with_the_missing_parts_only(tmp_path):
    """The only donor is killed mid-download (the request fails, the verified parts are kept); a donor of the same
    state (same epoch, same digests) appears: the next request fetches only the parts still missing."""
    run_id = "resume"
    peers = start_donors(tmp_path, run_id, [("d1", ["--serve_rate", str(500_000)])])
    joiner = None
    try:
        joiner = Joiner(run_id, peers[0].join, tmp_path / "joiner.log", load_state_attempts=1)
        killer = threading.Timer(3.0, peers[0].kill_tree)
        killer.start()
        assert not joiner.optimizer.load_state_checked()
        killer.join()
        kept = re.search(r"Downloaded (\d+) of 25 parts", joiner.log())
        assert kept and 0 < int(kept.group(1)) < 25, joiner.log()
        peers += start_donors(
            tmp_path, run_id, [("d2", ["--initial_peers", *[str(m) for m in joiner.dht.get_visible_maddrs()]])]
        )
        assert joiner.optimizer.load_state_checked()
        text = joiner.log()
        assert f"Resuming the download of epoch 0: {kept.group(1)} of 25 parts here" in text, text
        assert parts_from(text) == {peers[1].peer_id: 25 - int(kept.group(1))}, text
        assert same_state(joiner, tmp_path / "d2.pt")
    finally:
        if joiner is not None:
            joiner.close()
        kill_all(peers)


@pytest.mark.timeout(300)
def test_the_only_donor_whose_part_was_cut_is_asked_again_and_the_download_resumes(tmp_path):
    """The only donor cuts one part's stream (none of its bytes: a home donor's connection at its epoch's end): the
    next try of the same request asks it again and fetches only the parts still missing. It used to be excluded for
    the whole request, so every try failed and the peer trained on from its own state, missing rounds."""
    run_id = "cut_part"
    peers = start_donors(tmp_path, run_id, [("d1", ["--mode", "cut_part", "--wrong_part", "3"])])
    joiner = None
    try:
        joiner = Joiner(run_id, peers[0].join, tmp_path / "joiner.log", load_state_attempts=3)
        assert joiner.optimizer.load_state_checked()
        text = joiner.log()
        assert "Could not download part 3 of the state" in text and "(a cut connection)" in text, text
        kept = re.search(r"Downloaded (\d+) of 25 parts", text)
        assert kept and 0 < int(kept.group(1)) < 25, text
        assert f"Resuming the download of epoch 0: {kept.group(1)} of 25 parts here" in text, text
        assert parts_from(text) == {peers[0].peer_id: 25 - int(kept.group(1))}, text
        assert same_state(joiner, tmp_path / "d1.pt")
    finally:
        if joiner is not None:
            joiner.close()
        kill_all(peers)


@pytest.mark.timeout(300)
def test_a_donor_serves_at_most_its_bound_of_joiners_and_tells_the_others_it_is_busy(tmp_path):
    run_id = "busy"
    peers = start_donors(tmp_path, run_id, [("d1", ["--max_joiners", "1", "--serve_rate", str(1_000_000)])])
    first = second = None
    try:
        first = Joiner(run_id, peers[0].join, tmp_path / "first.log")
        second = Joiner(run_id, peers[0].join, tmp_path / "second.log", load_state_attempts=1)
        downloading = threading.Thread(target=first.optimizer.load_state_checked)
        downloading.start()
        time.sleep(1.5)
        assert not second.optimizer.load_state_checked()  # refused at once, not queued behind the first
        downloading.join()
        assert same_state(first, tmp_path / "d1.pt")
        assert "it answered 'busy'" in second.log(), second.log()
        assert "Busy serving 1 joiners" in peers[0].log(), peers[0].tail()
    finally:
        for joiner in (first, second):
            if joiner is not None:
                joiner.close()
        kill_all(peers)


@pytest.mark.timeout(300)
def test_serving_yields_to_the_donors_averaging_round(tmp_path):
    """The donor's round starts after it served 5 parts and lasts 3 s: it sends nothing meanwhile (the download takes
    that much longer) and the download completes once the round is over."""
    run_id = "yield"
    peers = start_donors(tmp_path, run_id, [("d1", ["--round_after_parts", "5", "--round_seconds", "3"])])
    joiner = None
    try:
        joiner = Joiner(run_id, peers[0].join, tmp_path / "joiner.log")
        started = time.monotonic()
        assert joiner.optimizer.load_state_checked()
        assert time.monotonic() - started >= 3.0
        assert same_state(joiner, tmp_path / "d1.pt")
        paused = peers[0].wait_for(r"serving went on after ([\d.]+) s paused", timeout=30)
        assert float(paused.group(1)) >= 2.5, peers[0].tail()
    finally:
        if joiner is not None:
            joiner.close()
        kill_all(peers)
