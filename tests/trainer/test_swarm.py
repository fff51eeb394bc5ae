"""Real trainer peers as separate processes on 127.0.0.1 (one multi-peer test at a time).

Settings that hold up on a busy 2-core machine come from the ``tiny`` run preset (matchmaking 1 s,
averaging timeout 3 s, target batch 64 with 16 per step, one torch thread per peer). Parameter
agreement is checked on the final parameters each peer writes when it stops at ``--max_epochs``,
with uncompressed averaging (lossy codecs make peers differ by design).
"""

from __future__ import annotations

import math
import signal

import pytest
import torch

from benchmarks.testbed.faults.injection import FAIL_ALLREDUCE_ROUNDS_ENV, NAN_GRAD_STEPS_ENV, NAN_PARAM_EPOCHS_ENV
from benchmarks.testbed.processes import kill_all, wait_all
from benchmarks.testbed.trainers import (
    LOCAL_MODE,
    epoch_losses,
    final_epoch,
    final_params,
    max_param_difference,
    param_dump_env,
    round_param_differences,
    start_trainer,
    wait_for_epoch,
)
from peer.swarm.agreement import LOSSY_TOLERANCE

pytestmark = pytest.mark.slow

EXACT = ["--compression", "none"]
STARTUP = 120  # seconds for a peer to import, start its DHT and report how to join it on a loaded machine


@pytest.fixture
def swarm():
    """Collects the peers a test starts and kills whatever is left of them afterwards."""
    peers = []
    yield peers
    kill_all(peers)


def _validation_loss(folder, model_config_path) -> float:
    from model import LeanGPTForCausalLM, load_config
    from peer.swarm.data import DataArguments, build_validation_dataset, load_tokenizer

    data_args = DataArguments(max_sequence_length=64, seq_warmup_start_length=0, max_validation_blocks=256)
    blocks = build_validation_dataset(data_args, load_tokenizer(data_args))
    model = LeanGPTForCausalLM(load_config(str(model_config_path)))
    model.load_state_dict(final_params(folder))
    model.eval()
    losses = []
    with torch.no_grad():
        for start in range(0, len(blocks), 32):
            input_ids = torch.stack([b["input_ids"] for b in blocks[start : start + 32]])
            losses.append(float(model(input_ids=input_ids, labels=input_ids).loss) * len(input_ids))
    return sum(losses) / len(blocks)


@pytest.mark.timeout(420)
def test_two_peers_agree_and_match_one_peer(tmp_path, swarm):
    """Two peers advance together, end with equal parameters, and learn as well as one peer on as many samples."""
    epochs = "16"
    solo = start_trainer(tmp_path, "solo", "solo_run", extra=["--max_epochs", epochs, *EXACT])
    first = start_trainer(tmp_path, "a", "pair_run", extra=["--max_epochs", epochs, "--min_peers", "2", *EXACT])
    swarm += [solo, first]
    second = start_trainer(
        tmp_path, "b", "pair_run", initial_peers=first.initial_peers(STARTUP), extra=["--max_epochs", epochs, *EXACT]
    )
    swarm.append(second)
    assert wait_all([first, second, solo], timeout=360) == [0, 0, 0]

    for peer in (first, second):
        assert final_epoch(tmp_path / peer.name) == int(epochs)
        losses = epoch_losses(peer)
        assert max(losses) == int(epochs) - 1, f"{peer.name} did not take part up to the last epoch"
        early, late = losses[min(losses)], losses[max(losses)]
        assert late < early - 0.3, f"{peer.name}: training loss did not fall ({early} -> {late})"
    # both peers took part in (almost) every epoch: epochs advanced together, not one peer alone (an epoch's number
    # alone does not show it: a peer that trained alone also ends epochs 0..15; its tracker then counted 1 peer)
    for peer in (first, second):
        together = [e["epoch"] for e in peer.events.all("epoch_done") if e["peers"] >= 2]
        assert len(together) >= int(epochs) // 2, f"{peer.name} ended most epochs alone: only {together} with 2 peers"
    assert len(set(epoch_losses(first)) & set(epoch_losses(second))) >= int(epochs) // 2
    assert max_param_difference([tmp_path / "a", tmp_path / "b"]) <= 1e-6

    model_config = tmp_path / "tiny_model.json"
    pair_loss = _validation_loss(tmp_path / "a", model_config)
    solo_loss = _validation_loss(tmp_path / "solo", model_config)
    print(
        f"\nvalidation loss after {epochs} epochs x 64 samples: 1 peer {solo_loss:.4f}, 2 peers {pair_loss:.4f} "
        f"(relative difference {abs(pair_loss - solo_loss) / solo_loss:.2%})"
    )
    assert abs(pair_loss - solo_loss) <= 0.03 * solo_loss


@pytest.mark.timeout(420)
def test_three_peers_with_a_late_joiner(tmp_path, swarm):
    """Two peers start, a third joins later: it reaches their global epoch and all end with equal parameters."""
    # the pair must still be training once the late joiner has imported and started: that takes 10-40 s on a
    # loaded 2-core machine, and the pair does an epoch every ~1.6 s
    epochs = "40"
    first = start_trainer(tmp_path, "a", "trio", extra=["--max_epochs", epochs, "--min_peers", "2", *EXACT])
    swarm.append(first)
    initial_peers = first.initial_peers(STARTUP)
    second = start_trainer(tmp_path, "b", "trio", initial_peers=initial_peers, extra=["--max_epochs", epochs, *EXACT])
    swarm.append(second)
    wait_for_epoch(second, 1, timeout=240)  # the late joiner's start-up takes longer than another epoch
    initial_peers += second.initial_peers()
    late = start_trainer(tmp_path, "c", "trio", initial_peers=initial_peers, extra=["--max_epochs", epochs, *EXACT])
    swarm.append(late)
    joined_at = int(
        late.events.wait(
            "state_loaded", timeout=STARTUP, where=lambda e: e["source"] == "swarm" and e["reason"] == "join"
        )["epoch"]
    )
    assert joined_at >= 2

    assert wait_all([first, second, late], timeout=300) == [0, 0, 0]
    for name in "abc":
        assert final_epoch(tmp_path / name) == int(epochs)
    # a slower peer may skip an epoch now and then (it catches up by downloading the state), but it trains along
    contributed = [epoch for epoch in epoch_losses(late) if epoch >= joined_at]
    assert len(contributed) >= 3, f"the late joiner hardly trained after joining: {contributed}"
    assert max_param_difference([tmp_path / "a", tmp_path / "b", tmp_path / "c"]) <= 1e-6


@pytest.mark.timeout(300)
def test_sigkilled_peer_leaves_nothing_and_others_go_on(tmp_path, swarm):
    """A peer killed with SIGKILL leaves no process behind; the others keep advancing (compressed averaging)."""
    first = start_trainer(tmp_path, "a", "kill", extra=["--max_epochs", "10", "--min_peers", "3"])
    swarm.append(first)
    initial_peers = first.initial_peers(STARTUP)
    others = [
        start_trainer(tmp_path, name, "kill", initial_peers=initial_peers, extra=["--max_epochs", "10"])
        for name in ("b", "victim")
    ]
    swarm += others
    second, victim = others
    victim.events.wait("epoch_done", timeout=180, count=2)
    tree = victim.snapshot_tree()
    assert len(tree) >= 3, "expected the peer, its DHT and averager processes"
    killed_at = max(epoch_losses(victim))
    victim.kill()
    survivors = victim.wait_until_gone(timeout=10)
    assert not survivors, f"processes of the killed peer are still running: {survivors}"

    assert wait_all([first, second], timeout=240) == [0, 0]
    for peer in (first, second):
        assert final_epoch(tmp_path / peer.name) == 10
        assert max(epoch_losses(peer)) > killed_at + 1


@pytest.mark.timeout(360)
def test_a_sync_peer_that_missed_a_round_takes_the_swarm_state(tmp_path, swarm):
    """One peer's gradient round breaks off after its group formed; hivemind then steps with that peer's own
    gradients, a gap its LAMB statistics keep for many epochs (0.04 to the end of a run with --missed_round_resync_mb
    0, the default). With --missed_round_resync_mb 64 it downloads the swarm's state: the tiny state is below that, and
    a download takes far less than an epoch here. The peer re-syncs only while its last download (the join's) took at
    most RESYNC_EPOCH_SHARE of an epoch, so epochs are 1536 samples (about 6.5 s with two busy loops beside, against
    join downloads of 0.4 s): with two busy loops, 768-sample epochs of 3.6 to 5.4 s came with downloads of 0.3 to 1.3
    s, and a busy CI machine did not re-sync at 768 (at 256: a 0.6 s join download, an epoch of 2.2 s). Both then end
    with the same parameters (8-bit averaging; measured 0.0006 to 0.0007 after it). The epochs around the broken
    round may differ (the other peer's round breaks off too, and each may re-sync from the other once), and so may
    epochs after a later miss within three epochs of the last re-sync (RESYNC_EVERY_EPOCHS: a busy CI machine missed
    the last two rounds that way)."""
    common = ["--max_epochs", "8", "--min_peers", "2", "--target_batch_size", "1536", "--missed_round_resync_mb", "64"]
    first = start_trainer(tmp_path, "a", "missed", extra=common, env=param_dump_env(tmp_path, "a"))
    swarm.append(first)
    initial_peers = first.initial_peers(STARTUP)
    faulty = {**param_dump_env(tmp_path, "b"), FAIL_ALLREDUCE_ROUNDS_ENV: "4"}
    second = start_trainer(tmp_path, "b", "missed", initial_peers=initial_peers, extra=common, env=faulty)
    swarm.append(second)
    assert wait_all([first, second], timeout=300) == [0, 0]
    resyncs = [
        int(e["epoch"])
        for peer in (first, second)
        for e in peer.events.all("state_loaded")
        if e["source"] == "swarm" and e["reason"] == "missed_round"
    ]
    decisions = [
        f"{peer.name}: {line}"
        for peer in (first, second)
        for line in peer.log().splitlines()
        if "Missed the all-reduce" in line or "re-syncing" in line or "No peer gave" in line
    ]
    assert resyncs, ("no peer re-synced after the broken round", decisions)
    differences = round_param_differences(tmp_path, ["a", "b"])
    # a re-sync brings the two together: within the two epochs after one of them (a round missed right after a
    # re-sync is not repaired for RESYNC_EVERY_EPOCHS)
    after = [differences[e] for r in resyncs for e in sorted(differences) if r < e <= r + 2]
    assert after, (resyncs, sorted(differences))
    assert min(after) <= LOSSY_TOLERANCE, (resyncs, differences)


@pytest.mark.timeout(420)
def test_a_trainer_that_missed_a_round_takes_its_result_from_the_peers_that_took_it(tmp_path, swarm):
    """A client-mode trainer's 4th gradient round breaks off on its side after its group formed; the two full
    peers go on without it and take the round's result. It fetches that result from them (both answers agree bit
    for bit) and takes the same optimizer step: with 8-bit averaging the three then hold the same parameters (0.0012
    apart, the state averaging's 8-bit deltas, as in a run without the fault), with no state download (hivemind's
    fallback step left such a trainer 0.04 apart to the end of a run)."""
    common = ["--max_epochs", "10", "--min_peers", "3", "--target_batch_size", "256", "--averaging_timeout", "10"]
    first = start_trainer(tmp_path, "a", "repair", extra=common, env=param_dump_env(tmp_path, "a"))
    swarm.append(first)
    initial_peers = first.initial_peers(STARTUP)
    second = start_trainer(
        tmp_path, "b", "repair", initial_peers=initial_peers, extra=common, env=param_dump_env(tmp_path, "b")
    )
    swarm.append(second)
    faulty = {**param_dump_env(tmp_path, "c"), FAIL_ALLREDUCE_ROUNDS_ENV: "4"}
    client = start_trainer(
        tmp_path, "c", "repair", initial_peers=initial_peers, extra=[*common, "--client_mode"], env=faulty
    )
    swarm.append(client)
    assert wait_all([first, second, client], timeout=360) == [0, 0, 0]
    assert "FAULT INJECTION: this peer's all-reduce round 4 fails" in client.log()
    repaired = [int(e["epoch"]) for e in client.events.all("epoch_done") if e.get("repaired_rounds")]
    assert repaired, "the client did not take the result of the round it missed"
    assert not client.events.all("state_loaded", where=lambda e: e["reason"] == "missed_round")
    differences = round_param_differences(tmp_path, ["a", "b", "c"])
    # the first dump after the repaired round (a busy CI machine may miss a later round nobody could repair: one run
    # measured 0.027 at one later epoch and 0.0013 again at the next)
    after = [e for e in sorted(differences) if e > repaired[0]]
    assert after, (repaired, differences)
    assert differences[after[0]] <= LOSSY_TOLERANCE, (repaired, differences)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", pytest.param("local", marks=pytest.mark.local_mode)])
def test_nan_gradients_and_parameters_are_survived(tmp_path, swarm, mode):
    """NaN gradients are skipped and counted; NaN parameters are restored; every peer stays finite and both end at
    the final epoch with the same parameters (in local mode: the shared ones, after the last round)."""
    faults = {NAN_GRAD_STEPS_ENV: "3,4,9", NAN_PARAM_EPOCHS_ENV: "4"}
    common = ["--max_epochs", "8", "--backup_every_epochs", "2", *EXACT, *(LOCAL_MODE if mode == "local" else [])]
    first = start_trainer(tmp_path, "a", "nan", extra=[*common, "--min_peers", "2"])
    swarm.append(first)
    faulty = start_trainer(
        tmp_path, "faulty", "nan", initial_peers=first.initial_peers(STARTUP), env=faults, extra=common
    )
    swarm.append(faulty)
    assert wait_all([first, faulty], timeout=240) == [0, 0]

    log = faulty.log()
    assert "FAULT INJECTION: NaN gradient at local step 3" in log
    assert "Skipping local step 9: NaN/inf loss or gradients (3 skipped so far)" in log
    assert "FAULT INJECTION: NaN parameter at global epoch 4" in log
    assert "Recovered by loading the swarm's state" in log
    assert faulty.events.all("state_loaded", where=lambda e: e["source"] == "swarm" and e["reason"] == "recovery")
    for name in ("a", "faulty"):
        params = final_params(tmp_path / name)
        assert all(torch.isfinite(t).all() for t in params.values()), f"{name} ended with NaN/inf parameters"
        assert final_epoch(tmp_path / name) == 8
    assert max_param_difference([tmp_path / "a", tmp_path / "faulty"]) <= 1e-6


def _check_published_metrics(initial_peers, run_id):
    """Another peer (here: the test process) reads the trainer's signed per-epoch metrics from the DHT."""
    import hivemind

    from benchmarks.testbed.processes import share_tensors_by_file_descriptor
    from peer.swarm.network import make_validators
    from peer.swarm.records import fetch_metrics

    share_tensors_by_file_descriptor()
    validators, _ = make_validators(run_id, hivemind.utils.crypto.RSAPrivateKey())
    reader = hivemind.DHT(
        start=True,
        initial_peers=initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        client_mode=True,
        record_validators=validators,
    )
    try:
        metrics = fetch_metrics(reader, run_id, timeout=15)
    finally:
        reader.shutdown()
    assert len(metrics) == 1, metrics
    (record,) = metrics.values()
    assert record.epoch >= 1 and record.mini_steps >= 1 and record.samples_accumulated >= 16
    assert 0 < record.loss / record.mini_steps < 10 and record.samples_per_second > 0


@pytest.mark.timeout(240)
def test_lone_peer_recovers_from_backup_stops_on_sigterm_and_resumes(tmp_path, swarm):
    """Alone, NaN parameters come back from the local backup; SIGTERM: backup, exit 0; a restart resumes."""
    peer = start_trainer(tmp_path, "a", "term", env={NAN_PARAM_EPOCHS_ENV: "3"}, extra=["--backup_every_epochs", "2"])
    swarm.append(peer)
    peer.events.wait(
        "state_loaded",
        timeout=STARTUP,
        where=lambda e: e["source"] == "backup" and e["reason"] == "recovery" and e["epoch"] == 2,
    )
    wait_for_epoch(peer, 4, timeout=60)
    _check_published_metrics(peer.initial_peers(), "term")
    assert peer.stop(signal.SIGTERM, timeout=30) == 0
    log = peer.log()
    assert "Received SIGTERM" in log and "Leaving the swarm" in log and "Shut down cleanly" in log
    assert [e["code"] for e in peer.events.all("exiting")] == [0]
    assert not peer.wait_until_gone(timeout=10)
    stopped_at = final_epoch(tmp_path / "a")
    assert stopped_at >= 5

    again = start_trainer(tmp_path, "a", "term", extra=["--max_epochs", str(stopped_at + 1)])
    swarm.append(again)
    again.events.wait(
        "state_loaded",
        timeout=STARTUP,
        where=lambda e: e["source"] == "backup" and e["reason"] == "join" and e["epoch"] == stopped_at,
    )
    assert again.wait(timeout=120) == 0
    assert final_epoch(tmp_path / "a") == stopped_at + 1
    assert math.isfinite(max(epoch_losses(again).values()))
