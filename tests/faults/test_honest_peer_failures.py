"""What an honest peer meets on its own, without an attacker: a multi-GPU host (samples counted once), a full disk
while checkpointing or backing up, symlinks in the checkpoint folder, a Hub upload racing the stop, a dead p2pd, a
swarm with nobody else yet (no vote for a fresh epoch), a client's epochs."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from aux_monitor.state import CheckpointInfo

# ----------------------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    """A real, small filesystem at ``path`` (needs root); the test is skipped where it cannot be mounted."""
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill up (needs root): {result.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_disk(folder: Path, leave: int = 0) -> Path:
    """Fill the filesystem of ``folder`` with one file until at most ``leave`` bytes are free."""
    filler = folder / "filler.bin"
    with open(filler, "wb") as f:
        while True:
            free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
            if free <= leave:
                break
            try:
                f.write(b"\0" * min(free - leave, 1 << 16))
                f.flush()
            except OSError:
                break
    return filler


# ------------------------------------------------------------------------------------- batch_size_per_step


def test_batch_size_per_step_counts_only_the_device_that_trains(monkeypatch, tmp_path):
    """On a multi-GPU host the model still trains on one device: N GPUs must not multiply the step's samples."""
    from peer.swarm.config import TrainingArguments
    from peer.trainer import batch_size_per_step

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    training = TrainingArguments(output_dir=str(tmp_path), per_device_batch_size=3, gradient_accumulation_steps=2)
    assert batch_size_per_step(training) == 6
    training = TrainingArguments(output_dir=str(tmp_path), per_device_batch_size=3, device="cuda")
    assert batch_size_per_step(training) == 3


# ------------------------------------------------------------------------------------------- Hub uploader


class _GatedLock:
    """A lock that, once armed, holds the upload thread right after it released the lock having uploaded
    something: the moment at which the old uploader had decided to stop but its thread was still alive."""

    def __init__(self, uploads):
        self._lock = threading.Lock()
        self._uploads = uploads
        self.reached, self.proceed = threading.Event(), threading.Event()
        self._done = False

    def acquire(self, *args, **kwargs):
        return self._lock.acquire(*args, **kwargs)

    def release(self):
        self._lock.release()
        in_uploader = threading.current_thread().name == "hub-upload"
        if in_uploader and not self._done and self._uploads():
            self._done = True
            self.reached.set()
            assert self.proceed.wait(10)

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()


def test_a_checkpoint_submitted_while_the_uploader_stops_is_still_uploaded(monkeypatch, tmp_path):
    import huggingface_hub

    from aux_monitor.hub import HubUploader
    from tests.aux.test_parts import FakeHfApi

    api = FakeHfApi()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: api)
    uploader = HubUploader("org/leanhive-tiny")
    uploaded = lambda: [c for c in api.calls if c[0] == "upload_folder"]  # noqa: E731
    gate = uploader._lock = _GatedLock(uploaded)
    first, second = (
        CheckpointInfo(epoch=e, time=0.0, path=str(tmp_path / f"epoch_{e:06d}"), loss=None) for e in (2, 4)
    )
    uploader.submit(first)
    assert gate.reached.wait(10), "the uploader never finished its first upload"
    # the upload thread has found nothing more to do and released the lock, but has not ended yet
    uploader.submit(second)
    gate.proceed.set()
    uploader.wait(timeout=10)
    assert [c[2] for c in uploaded()] == [first.path, second.path]
    assert [c.epoch for c in uploader.uploaded] == [2, 4]


# ---------------------------------------------------------------------------------- aux checkpoint folder


def test_symlinked_checkpoint_entries_neither_break_nor_steer_checkpointing(tmp_path, caplog):
    """A symlinked ``epoch_*`` (to a checkpoint elsewhere, or dangling where the next checkpoint goes) is ignored:
    checkpoints are still written and rotated, the symlink and its target are never deleted."""
    from aux_monitor.checkpoints import CheckpointManager
    from model import LeanGPTForCausalLM
    from tests.aux.test_checkpoints import trained_state

    outside = CheckpointManager(tmp_path / "elsewhere", keep=5, model_class=LeanGPTForCausalLM)
    foreign = Path(outside.save(trained_state(99)).path)
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "epoch_000099").symlink_to(foreign, target_is_directory=True)
    (root / "epoch_000002").symlink_to(tmp_path / "nowhere", target_is_directory=True)  # dangling

    mgr = CheckpointManager(root, keep=1, model_class=LeanGPTForCausalLM)
    assert mgr.load_newest_valid() is None  # the symlinked checkpoint is not offered to joiners
    with caplog.at_level(logging.WARNING, logger="aux_monitor.checkpoints"):
        first = mgr.save(trained_state(1))
        second = mgr.save(trained_state(2))
    assert Path(second.path).name == "epoch_000002.1"  # the dangling link's name is taken: not renamed onto
    assert not Path(first.path).exists()  # rotation still keeps exactly the newest real one
    assert [p.name for p in mgr.list_checkpoints()] == ["epoch_000002.1"]
    assert (root / "epoch_000099").is_symlink() and foreign.is_dir()
    assert (root / "epoch_000002").is_symlink()
    assert any("symbolic link" in r.getMessage() for r in caplog.records)


def test_a_full_disk_while_checkpointing_is_reported_and_keeps_the_previous_checkpoint(tmp_path, caplog):
    from aux_monitor.checkpoints import CheckpointError, CheckpointManager
    from model import LeanGPTForCausalLM
    from tests.aux.test_checkpoints import trained_state

    with small_tmpfs(tmp_path / "disk", "4m") as disk:
        mgr = CheckpointManager(disk / "ckpt", keep=2, model_class=LeanGPTForCausalLM)
        kept = mgr.save(trained_state(1))
        filler = fill_disk(disk, leave=64 * 1024)
        with pytest.raises(CheckpointError, match="free disk space"):
            mgr.save(trained_state(2))
        assert [p.name for p in mgr.list_checkpoints()] == ["epoch_000001"]
        assert not [p for p in (disk / "ckpt").iterdir() if p.name.startswith(".tmp")]
        assert mgr.load(kept.path).state.epoch == 1
        filler.unlink()  # space again: the next attempt works
        assert Path(mgr.save(trained_state(2)).path).name == "epoch_000002"


# ------------------------------------------------------------------------------------------ trainer backup


@pytest.mark.timeout(120)
def test_a_full_disk_during_a_periodic_backup_keeps_training_and_the_previous_backup(tmp_path, caplog):
    """The trainer's periodic backup on a full disk: logged, training goes on, the last good backup stays
    loadable, and the backup is retried at the next epoch once there is space."""
    from benchmarks.testbed.processes import share_tensors_by_file_descriptor
    from peer import backup
    from peer.model_setup import Placement
    from peer.strategies import SyncTraining
    from peer.swarm.config import CollaborationArguments, OptimizerArguments, TrainingArguments
    from peer.swarm.data import DataArguments
    from peer.swarm.lifecycle import PeerControl
    from peer.swarm.network import NetworkArguments
    from peer.trainer import TrainerConfig, TrainerPeer
    from tests.support.optimizers import peer_on

    share_tensors_by_file_descriptor()
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        dht, model, opt = peer_on("fulldisk")
        try:
            config = TrainerConfig(
                NetworkArguments(),
                CollaborationArguments(),
                OptimizerArguments(),
                TrainingArguments(output_dir=str(disk), backup_every_epochs=2),
                DataArguments(),
            )
            peer = TrainerPeer(
                config=config,
                control=PeerControl(),
                dht=dht,
                public_key=b"",
                watchdog=None,
                model=model,
                placement=Placement(device=torch.device("cpu"), autocast_dtype=None),
                optimizer=opt,
                strategy=SyncTraining(opt, 4),
                batches=iter(()),
            )

            def one_epoch():
                model(torch.randn(4, 8)).sum().backward()
                opt.step()  # target 4 = one step: one global epoch
                opt.zero_grad()
                peer._after_update(opt.local_epoch)

            one_epoch()
            one_epoch()  # epoch 2: a backup
            assert (disk / backup.BACKUP_NAME).exists()
            saved = {k: v.clone() for k, v in model.state_dict().items()}
            filler = fill_disk(disk)
            with caplog.at_level(logging.ERROR, logger="peer.backup"):
                one_epoch()
                one_epoch()  # epoch 4: the backup fails, training goes on
            assert opt.local_epoch == 4
            assert any("Could not write the backup" in r.getMessage() for r in caplog.records)
            assert not list(disk.glob("*.tmp"))
            # the last good backup (epoch 2) is still there, as the previous one, and load_backup would use it
            kept = torch.load(disk / backup.PREVIOUS_BACKUP_NAME, weights_only=True)
            assert kept["epoch"] == 2 and all(torch.equal(saved[k], v) for k, v in kept["model"].items())
            assert backup._read_backup(disk / backup.PREVIOUS_BACKUP_NAME, model) is not None
            filler.unlink()
            one_epoch()  # epoch 5: not a backup epoch, but the failed backup is retried
            assert torch.load(disk / backup.BACKUP_NAME, weights_only=True)["epoch"] == opt.local_epoch == 5
        finally:
            opt.shutdown()
            dht.shutdown()


# ------------------------------------------------------------------------------------------------ dead p2pd


def _load_healthcheck():
    import importlib.util

    spec = importlib.util.spec_from_file_location("healthcheck", Path(__file__).parents[2] / "docker/healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_trainer_whose_p2pd_dies_reports_it_and_exits_with_status_1(tmp_path):
    """hivemind does not notice a dead p2pd: the trainer would train alone forever and still look healthy."""
    import psutil

    from benchmarks.testbed.trainers import start_trainer, wait_for_epoch

    healthcheck = _load_healthcheck()
    trainer = start_trainer(tmp_path, "a", "p2pd_dies", extra=["--rejoin_period", "1"])
    try:
        wait_for_epoch(trainer, 1, timeout=120)
        root = psutil.Process(trainer.pid)
        assert healthcheck.trainer_problem(root) is None
        daemons = [p for p in root.children(recursive=True) if p.name() == "p2pd"]
        assert daemons, "no p2pd in the trainer's process tree"
        for daemon in daemons:
            daemon.kill()
        killed = time.monotonic()
        lost = trainer.events.wait("swarm_lost", timeout=30)
        assert "p2pd" in lost["reason"] and "restarted" in lost["reason"]
        assert healthcheck.trainer_problem(root) is not None  # unhealthy from the moment p2pd is gone
        assert trainer.wait(timeout=60) == 1
        assert time.monotonic() - killed < 60
        assert "Exiting with status 1: the p2pd daemon" in trainer.log()
        assert trainer.events.last("exiting")["code"] == 1
        assert not trainer.wait_until_gone(timeout=15), "processes of the trainer outlived it"
    finally:
        trainer.kill_tree()


# ------------------------------------------------------------------------------------ consensus vote at start-up


def test_a_peer_that_found_nobody_yet_does_not_vote_its_fresh_epoch(tmp_path):
    """A peer still waiting for min_peers found no record at its first fetch; meanwhile the other peer trained on
    to epoch 16. In a pair the consensus is the lower of the two votes: had the waiting peer voted its epoch 0, it
    would refuse the other's state as "beyond the swarm's consensus" forever (seen in a real run)."""
    import hivemind
    from hivemind.optim.progress_tracker import LocalTrainingProgress
    from hivemind.utils import ValueWithExpiration, get_dht_time

    from peer.swarm.hivemind_seam import LeanHiveProgressTracker

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        tracker = LeanHiveProgressTracker(dht, "vote_run", 64, start=False)
        assert tracker.consensus_epoch is None  # nobody reports: no consensus, and no vote of its own yet

        def other_at(epoch: int) -> dict:
            now = get_dht_time()
            record = LocalTrainingProgress(
                peer_id=b"other",
                epoch=epoch,
                samples_accumulated=8,
                samples_per_second=100.0,
                time=now,
                client_mode=False,
            )
            return {b"other-key": ValueWithExpiration(record.dict(), now + 60)}

        tracker.global_progress = tracker._parse_swarm_progress_data(other_at(16))
        assert tracker.consensus_epoch == 16 and tracker.global_progress.epoch == 16
        # once it holds the swarm's state (here: it started a collaboration of its own), its epoch votes again
        tracker.mark_in_sync()
        tracker._parse_swarm_progress_data(other_at(16))
        assert tracker.consensus_epoch == 0
        # and a fresh peer that finds another peer at its own epoch is in sync with it
        fresh = LeanHiveProgressTracker(dht, "vote_run_2", 64, start=False)
        fresh._parse_swarm_progress_data(other_at(1))
        assert fresh._in_sync
    finally:
        dht.shutdown()


@pytest.mark.timeout(240)
def test_a_trainer_apart_from_the_swarm_takes_the_consensus_state():
    """Three trainers started at one moment each ran alone until they found one another's records; on a busy CI
    machine one reached epoch 16 while the other two were at 1. The two refused its state as "beyond the swarm's
    consensus" (the lower median, 1), so the swarm stayed split for the rest of the run (the health test ran to its
    timeout). The one apart takes the state of the peers at the consensus, and its schedule goes back with it."""
    from benchmarks.testbed.aux import wait_for
    from benchmarks.testbed.processes import share_tensors_by_file_descriptor
    from peer.swarm.config import OptimizerArguments
    from peer.swarm.hivemind_seam import DOWNLOAD_EPOCH_LEAD
    from peer.swarm.joining import RejoinWhenApart
    from peer.swarm.optimizer import learning_rate_at
    from tests.support.optimizers import peer_on

    share_tensors_by_file_descriptor()
    peers = [peer_on("apart_run")]
    peers += [peer_on("apart_run", peers[0][0].get_visible_maddrs()) for _ in range(2)]
    (_, model_a, opt_a), (_, _, opt_b), (_, _, opt_c) = peers
    apart_epoch = 1 + DOWNLOAD_EPOCH_LEAD + 4

    def at(opt, epoch: int, value: float) -> None:  # a trainer that trained to ``epoch`` with these parameters
        with torch.no_grad():
            for param in opt.state_averager.optimizer.param_groups[0]["params"]:  # the copies that peers download
                param.fill_(value)
        opt.state_averager.parameters_replaced(epoch)
        opt.state_averager._update_scheduler()
        opt.state_averager.state_sharing_priority = epoch
        opt.tracker.mark_in_sync()
        opt.tracker.performance_ema.samples_per_second = 50.0
        opt.tracker.report_local_progress(epoch, samples_accumulated=1)

    try:
        at(opt_b, 1, 2.0)
        at(opt_c, 1, 2.0)
        at(opt_a, apart_epoch, 7.0)
        rejoin = RejoinWhenApart()
        wait_for(lambda: opt_a.tracker.apart_from_swarm() is not None, timeout=60, what="A to see the others")
        consensus, donors = opt_a.tracker.apart_from_swarm()
        assert consensus == 1 and donors == {opt_b.dht.peer_id.to_bytes(), opt_c.dht.peer_id.to_bytes()}
        assert opt_b.tracker.apart_from_swarm() is None  # the peers at the consensus stay

        assert rejoin(opt_a)
        assert opt_a.local_epoch in (1, 2)
        served = opt_a.state_averager.optimizer.param_groups[0]["params"][0]
        assert torch.all(served == 2.0) and torch.all(model_a[0].weight == 2.0)
        assert opt_a.tracker.global_epoch < apart_epoch  # its own old record no longer names the swarm's epoch
        expected = learning_rate_at(opt_a.local_epoch, OptimizerArguments())
        assert opt_a.state_averager.scheduler.get_last_lr() == pytest.approx([expected] * len(opt_a.param_groups))
        assert opt_a.tracker.apart_from_swarm() is None and not rejoin(opt_a)
    finally:
        for dht, _, opt in peers:
            opt.shutdown()
            dht.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_swarms_of_one_run_that_meet_train_on_as_one(tmp_path):
    """Real trainers: a trains alone; b and c, started without it (a swarm of their own), train together. Once a DHT
    node knows both swarms, a, far beyond b's and c's consensus, takes their state (neither of them would take its
    state), and from then on the three average together."""
    import hivemind

    from benchmarks.testbed.aux import swarm_processes
    from benchmarks.testbed.trainers import start_trainer, wait_for_epoch

    with swarm_processes() as procs:
        a = start_trainer(tmp_path, "a", "apart_swarms")
        procs.append(a)
        a_addrs = a.initial_peers(timeout=120)
        wait_for_epoch(a, 8, timeout=180)
        b = start_trainer(tmp_path, "b", "apart_swarms")
        procs.append(b)
        b_addrs = b.initial_peers(timeout=120)
        c = start_trainer(tmp_path, "c", "apart_swarms", initial_peers=b_addrs)
        procs.append(c)
        wait_for_epoch(c, 1, timeout=180)
        bridge = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=a_addrs + b_addrs)
        try:
            rejoined = a.events.wait("state_loaded", 120, where=lambda e: e["reason"] == "rejoin")
            assert "trained apart from them" in a.log()
            assert not b.events.all("state_loaded", where=lambda e: e["epoch"] > rejoined["epoch"] + 4)
            left = max(int(e["epoch"]) for e in a.events.all("epoch_done"))
            assert left > rejoined["epoch"] + 4
            # one swarm from then on: a averages with the others (its next epochs are the swarm's, not its own)
            after = wait_for_epoch(a, int(rejoined["epoch"]) + 3, timeout=120)
            assert wait_for_epoch(b, after, timeout=120) >= after
            assert after < left
        finally:
            bridge.shutdown()


def test_a_trainer_a_few_epochs_ahead_or_beside_one_other_peer_is_not_apart():
    """A fast honest peer is often a few epochs ahead of a slower one's view: within ``DOWNLOAD_EPOCH_LEAD`` the
    others take its state (hivemind's catch-up), so it keeps its own; a serving peer that reports no throughput (an
    anchoring aux) is nobody to take a state from; only a strict majority of the votes puts a peer apart, and only
    live trainers vote."""
    import hivemind

    from peer.swarm.hivemind_seam import DOWNLOAD_EPOCH_LEAD, LeanHiveProgressTracker
    from peer.swarm.hivemind_seam.progress import LIVE_RECORD_SECONDS

    def record(epoch: int, samples_per_second: float = 50.0):
        return _progress_record(epoch=epoch, samples=0, samples_per_second=samples_per_second, client_mode=False)

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        tracker = LeanHiveProgressTracker(dht, "ahead_run", 64, start=False)
        tracker.mark_in_sync()
        tracker.local_progress = tracker._get_local_progress(1 + DOWNLOAD_EPOCH_LEAD, 0)
        tracker._parse_swarm_progress_data({b"b": record(1), b"c": record(1)})
        assert tracker.consensus_epoch == 1 and tracker.apart_from_swarm() is None
        tracker.local_progress = tracker._get_local_progress(2 + DOWNLOAD_EPOCH_LEAD, 0)
        tracker._parse_swarm_progress_data({b"aux": record(1, samples_per_second=0.0)})
        assert tracker.consensus_epoch == 1 and tracker.apart_from_swarm() is None
        tracker._parse_swarm_progress_data({b"b": record(1), b"c": record(1)})
        assert tracker.apart_from_swarm() == (1, frozenset({b"p"}))
        # one other record is one vote: beside it, this peer's own vote keeps it where it is (a hostile record in a
        # pair would otherwise hand a lone honest trainer its state)
        tracker._parse_swarm_progress_data({b"rogue": record(1)})
        assert tracker.consensus_epoch == 1 and tracker.apart_from_swarm() is None
        # crashed trainers' records outlive them by a minute: they are no swarm to rejoin (fault scenario e)
        dead = {key: record(1) for key in (b"b", b"c")}
        for value in dead.values():
            value.value["time"] -= LIVE_RECORD_SECONDS + 1
        tracker._parse_swarm_progress_data(dead)
        assert tracker.consensus_epoch == 1 and tracker.apart_from_swarm() is None
    finally:
        dht.shutdown()


def _progress_record(*, epoch: int, samples: int, samples_per_second: float, client_mode: bool):
    """A peer's progress record as the tracker reads it from the DHT (signed-record checks are not the point here)."""
    from hivemind.optim.progress_tracker import LocalTrainingProgress
    from hivemind.utils import ValueWithExpiration, get_dht_time

    now = get_dht_time()
    progress = LocalTrainingProgress(
        peer_id=b"p",
        epoch=epoch,
        samples_accumulated=samples,
        samples_per_second=samples_per_second,
        time=now,
        client_mode=client_mode,
    )
    return ValueWithExpiration(progress.dict(), now + 60)


def test_an_anchoring_aux_record_votes_only_while_no_serving_trainer_reports(tmp_path):
    """An aux peer that anchored a swarm of client trainers leaves its record (epoch 6, no throughput) up to a
    minute after a serving trainer came. With the trainer at 11, the lower median was 6 and a catching-up client
    refused the trainer's state as "beyond the swarm's consensus" (seen on the home-network testbed, scenario c)."""
    import hivemind

    from peer.swarm.hivemind_seam import LeanHiveProgressTracker

    def record(epoch: int, samples_per_second: float):
        return _progress_record(epoch=epoch, samples=0, samples_per_second=samples_per_second, client_mode=False)

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        client = LeanHiveProgressTracker(dht, "anchor_run", 64, client_mode=True, start=False)
        client._parse_swarm_progress_data({b"aux": record(6, 0.0)})
        assert client.consensus_epoch == 6  # only the anchoring aux serves: its epoch is the swarm's
        client._parse_swarm_progress_data({b"aux": record(6, 0.0), b"trainer": record(11, 90.0)})
        assert client.consensus_epoch == 11
        # two trainers still take the lower median (one peer cannot raise the consensus alone)
        records = {b"aux": record(6, 0.0), b"trainer": record(11, 90.0), b"other": record(7, 80.0)}
        client._parse_swarm_progress_data(records)
        assert client.consensus_epoch == 7
    finally:
        dht.shutdown()


def test_the_other_trainers_a_local_mode_peer_counts_are_live_clients_and_trainers_not_aux_peers():
    """A local-mode trainer whose group held only aux peers besides itself drops the round while other trainers
    train (``_PolicyAveraging._others_data_needed``). It counts them from the progress records: clients and trainers
    (a trainer before its first step reports hivemind's 1e-20 samples/s), not an aux peer (0), not a record older
    than ``LIVE_RECORD_SECONDS`` (a crashed trainer's outlives it by a minute), not its own."""
    import hivemind

    from peer.swarm.hivemind_seam import LeanHiveProgressTracker
    from peer.swarm.hivemind_seam.progress import LIVE_RECORD_SECONDS

    def record(samples_per_second: float, client_mode: bool = False, age: float = 0.0):
        value = _progress_record(epoch=3, samples=0, samples_per_second=samples_per_second, client_mode=client_mode)
        value.value["time"] -= age
        return value

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        tracker = LeanHiveProgressTracker(dht, "count_run", 64, start=False)
        tracker._parse_swarm_progress_data({b"aux": record(0.0)})
        assert tracker.other_live_trainers() == 0
        records = {
            b"aux": record(0.0),
            b"client": record(50.0, client_mode=True),
            b"fresh": record(1e-20),
            b"gone": record(40.0, age=LIVE_RECORD_SECONDS + 5),
            tracker._local_public_key: record(30.0),
        }
        tracker._parse_swarm_progress_data(records)
        assert tracker.other_live_trainers() == 2
    finally:
        dht.shutdown()


def test_an_aux_behind_the_trainers_epoch_is_ready_when_their_epoch_ends_not_at_once(tmp_path):
    """Home testbed b: an assisting aux took the trainers' round k + 1 as its own round k, so it was always one
    epoch behind them. hivemind called it ready at once, and it began each round as soon as its last one ended, about
    an epoch early: its matchmaking window ran out just as the public trainer joined, and the NAT'd volunteers, a
    moment later, found no leader. Behind the trainers, an aux is ready when their epoch ends; a trainer behind the
    swarm still catches up at once (hivemind's rule)."""
    import hivemind
    from hivemind.utils import get_dht_time

    from peer.swarm.hivemind_seam import LeanHiveProgressTracker

    def trainers_at(epoch: int, samples: int) -> dict:  # two trainers (one record may end no epoch alone)
        record = _progress_record(epoch=epoch, samples=samples, samples_per_second=50.0, client_mode=False)
        return {b"trainer0": record, b"trainer1": record}

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        aux = LeanHiveProgressTracker(dht, "aux_behind_run", 512, start=False)
        aux.votes_own_epoch, aux.rounds_follow_trainers_epoch = False, True  # as set for a sync-mode aux
        with aux.pause_updates():
            aux.update_epoch(4)  # its last round ended: the progress it holds is from before that round
        aux.global_progress = aux._parse_swarm_progress_data(trainers_at(5, 128))
        assert aux.global_epoch == 5 and not aux.ready_to_update_epoch  # not fetched since: not yet
        aux.fetched_global_progress_this_epoch.set()
        assert not aux.ready_to_update_epoch  # half the trainers' epoch to go (about 2.6 s at their rate)
        assert aux.estimated_next_update_time > get_dht_time() + 2
        aux.global_progress = aux._parse_swarm_progress_data(trainers_at(5, 256))
        assert aux.ready_to_update_epoch  # their epoch ended: the round is due
        # a lone serving trainer ends its epoch on its own samples: in the aux's view they count in full (capped at
        # half the target, it never ended one and the aux joined no round: home testbed c); a client's stay capped
        record = _progress_record(epoch=5, samples=512, samples_per_second=50.0, client_mode=False)
        aux.global_progress = aux._parse_swarm_progress_data({b"trainer": record})
        assert aux.ready_to_update_epoch
        client = _progress_record(epoch=5, samples=512, samples_per_second=50.0, client_mode=True)
        aux.global_progress = aux._parse_swarm_progress_data({b"trainer": trainers_at(5, 0)[b"trainer0"], b"c": client})
        assert aux.global_progress.samples_accumulated == 256 and not aux.ready_to_update_epoch

        trainer = LeanHiveProgressTracker(dht, "aux_behind_run", 512, start=False)
        trainer.global_progress = trainer._parse_swarm_progress_data(trainers_at(5, 128))
        assert trainer.local_progress.epoch == 0 and trainer.ready_to_update_epoch  # behind: catches up at once
    finally:
        dht.shutdown()


@pytest.mark.timeout(120)
def test_only_a_sync_mode_aux_waits_for_the_trainers_epoch_to_end():
    """The optimizer turns the wait on for an auxiliary peer in sync mode only: a trainer behind the swarm catches up
    at once, and in local mode the group key names the round's epoch, so an aux behind catches up by failing rounds
    one right after the other (waiting for each epoch's end, it would stay behind for good)."""
    from benchmarks.testbed.processes import share_tensors_by_file_descriptor
    from peer.swarm.config import CollaborationArguments
    from tests.support.optimizers import peer_on

    share_tensors_by_file_descriptor()
    for sync_mode, auxiliary, waits in (("sync", True, True), ("sync", False, False), ("local", True, False)):
        collab = CollaborationArguments(target_batch_size=4, matchmaking_time=1.0, sync_mode=sync_mode)
        dht, _, opt = peer_on(f"aux_wait_{sync_mode}_{auxiliary}", collab=collab, auxiliary=auxiliary)
        try:
            assert opt.tracker.rounds_follow_trainers_epoch is waits, (sync_mode, auxiliary)
        finally:
            opt.shutdown()
            dht.shutdown()


def test_a_client_ends_no_epoch_alone_and_counts_its_samples_as_the_others_do(tmp_path):
    """A client-mode joiner of a local-mode swarm started before the only serving trainer had reported (hivemind
    publishes a trainer's progress after its first step) and ended four rounds on its own samples; nobody can
    download a client's state, so that trainer began from the older one and the two never agreed (seen in a real
    run). A client ends no epoch while no serving trainer reports, and counts its own samples as the others count
    them (at most ``MAX_PEER_SHARE`` of the target), so its epochs end when theirs do."""
    import hivemind

    from peer.swarm.hivemind_seam import LeanHiveProgressTracker

    def record(samples: int, client_mode: bool):
        return _progress_record(epoch=0, samples=samples, samples_per_second=50.0, client_mode=client_mode)

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        client = LeanHiveProgressTracker(dht, "client_alone_run", 64, client_mode=True, start=False)
        own = {client._local_public_key: record(640, client_mode=True)}  # ten targets' worth of samples
        client.global_progress = client._parse_swarm_progress_data(own)
        assert client.consensus_epoch is None and not client.ready_to_update_epoch
        client.global_progress = client._parse_swarm_progress_data({**own, b"trainer": record(16, client_mode=False)})
        assert client.consensus_epoch == 0 and client.global_progress.samples_accumulated == 32 + 16
        # a serving trainer's own samples count in full, as before
        trainer = LeanHiveProgressTracker(dht, "client_alone_run", 64, client_mode=False, start=False)
        mine = {trainer._local_public_key: record(40, client_mode=False)}
        trainer.global_progress = trainer._parse_swarm_progress_data({**mine, b"client": record(640, client_mode=True)})
        assert trainer.global_progress.samples_accumulated == 40 + 32
    finally:
        dht.shutdown()


def test_two_clients_an_epoch_apart_both_go_on_and_a_new_peer_is_looked_at_again_soon(tmp_path):
    """Home testbed a: one client's first round failed and it stepped alone into epoch 1, the other stayed at epoch
    0 with the anchoring aux. Each counted only its own samples, capped at half the target, and no epoch ended for
    100 s. A client one epoch on went through the epoch: it counts as its full share, so the one behind (and the
    aux) end epoch 0, while the one ahead waits for them. And a starting peer whose first fetch found a new peer
    with a step's worth of throughput (ETA 68 s) fetched again only 10 s later, after the epoch had ended."""
    import hivemind
    from hivemind.utils import get_dht_time

    from peer.swarm.hivemind_seam import LeanHiveProgressTracker

    def record(epoch: int, samples: int, client_mode: bool = True, samples_per_second: float = 50.0):
        return _progress_record(
            epoch=epoch, samples=samples, samples_per_second=samples_per_second, client_mode=client_mode
        )

    aux = {b"aux": record(0, 0, client_mode=False, samples_per_second=0.0)}
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        behind = LeanHiveProgressTracker(dht, "apart_run", 64, client_mode=True, start=False)
        own = {behind._local_public_key: record(0, 40)}
        behind.global_progress = behind._parse_swarm_progress_data({**aux, **own, b"ahead": record(1, 8)})
        assert behind.global_progress.samples_accumulated == 32 + 32 and behind.ready_to_update_epoch
        # two epochs on is no peer that went through this one
        behind.global_progress = behind._parse_swarm_progress_data({**aux, **own, b"ahead": record(2, 8)})
        assert behind.global_progress.samples_accumulated == 32 and not behind.ready_to_update_epoch

        ahead = LeanHiveProgressTracker(dht, "apart_run", 64, client_mode=True, start=False)
        ahead.report_local_progress(local_epoch=1, samples_accumulated=40)
        mine = {ahead._local_public_key: record(1, 40)}
        ahead.global_progress = ahead._parse_swarm_progress_data({**aux, **mine, b"behind": record(0, 40)})
        assert ahead.global_progress.samples_accumulated == 32 and not ahead.ready_to_update_epoch

        starting = LeanHiveProgressTracker(
            dht, "apart_run", 64, client_mode=True, start=False, default_refresh_period=1.0
        )
        slow = {**aux, b"new": record(0, 1, samples_per_second=0.5)}
        progress = starting._parse_swarm_progress_data(slow)
        assert progress.eta_next_epoch - get_dht_time() > 20 and progress.next_fetch_time - get_dht_time() <= 1.0
        progress = starting._parse_swarm_progress_data(slow)  # the same peers: hivemind's period again
        assert progress.next_fetch_time - get_dht_time() > 5
        # a serving trainer keeps hivemind's period (its own samples end its epochs; fault scenario y, a local-mode
        # joiner, failed with the shorter one)
        trainer = LeanHiveProgressTracker(dht, "apart_run", 64, start=False, default_refresh_period=1.0)
        assert trainer._parse_swarm_progress_data(slow).next_fetch_time - get_dht_time() > 5
    finally:
        dht.shutdown()


def test_records_of_peers_that_served_no_state_count_again_only_once_renewed(tmp_path):
    """Every trainer crashed at epoch 12; a newcomer loaded an aux's checkpoint of epoch 10. The dead trainers'
    records outlive them by a minute, and with the swarm's epoch two ahead hivemind downloaded the same state again
    before each step (166 times in 41 s, tests/aux/test_swarm.py). After a download that no donor served beyond
    epoch 10, records more than MAX_EPOCH_LEAD beyond it count no more until their peers renew them: a peer that
    was only busy renews its record with its next step."""
    import hivemind
    from hivemind.utils import get_dht_time

    from peer.swarm.hivemind_seam import LeanHiveProgressTracker

    def record(epoch: int):
        return _progress_record(epoch=epoch, samples=8, samples_per_second=50.0, client_mode=False)

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        newcomer = LeanHiveProgressTracker(dht, "gone_run", 64, start=False, default_refresh_period=1.0)
        newcomer.report_local_progress(local_epoch=10, samples_accumulated=0)
        newcomer.mark_in_sync()
        dead = {b"dead1": record(12), b"dead2": record(12), b"near": record(11)}
        newcomer.global_progress = newcomer._parse_swarm_progress_data(dead)
        newcomer.global_progress.next_fetch_time = get_dht_time() + 30
        assert newcomer.global_progress.epoch == 12
        with newcomer.pause_updates():
            newcomer.refute_claims_above(10)  # the download ended at epoch 10
        assert newcomer.global_progress.epoch == 11  # one ahead is a peer that just ended the epoch: it counts
        assert newcomer.global_progress.next_fetch_time - get_dht_time() <= 1.0  # it looks again soon
        assert newcomer._parse_swarm_progress_data(dead).epoch == 11  # the same records, fetched again
        # a renewed record counts again: its peer was alive after all
        renewed = {**dead, b"dead1": record(12)}  # written again, at a later time
        assert newcomer._parse_swarm_progress_data(renewed).epoch == 12
    finally:
        dht.shutdown()
