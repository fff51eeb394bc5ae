"""The test-bed package itself (benchmarks/testbed): reading peers' event files, choosing the trainer's entry point,
keeping the fault hooks out of production code, shared-memory cleanup, the fault scenarios' ids. In-process;
seconds."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from benchmarks.testbed.events import EventLog
from benchmarks.testbed.processes import (
    REPO_ROOT,
    PeerExited,
    PeerProcess,
    remove_orphaned_shared_memory,
    write_ready_file,
)
from benchmarks.testbed.trainers import FAULT_TRAINER_MODULE, injects_faults, trainer_entry_point


def _write(path: Path, *events: dict, partial: str = "") -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in events) + partial)


def test_event_log_reads_complete_lines_and_filters(tmp_path):
    log = EventLog(tmp_path / "peer.events.jsonl")
    assert log.read() == [] and log.all("epoch_done") == []  # no file yet
    _write(
        log.path,
        {"event": "dht_started", "time": 1.0, "pid": 1, "initial_peers": ["/ip4/127.0.0.1/tcp/1/p2p/X"]},
        {"event": "epoch_done", "time": 2.0, "pid": 1, "epoch": 0, "loss": None},
        {"event": "epoch_done", "time": 3.0, "pid": 1, "epoch": 1, "loss": 7.5},
        partial='{"event": "epoch_do',
    )  # a line still being written is not read yet
    assert [e["epoch"] for e in log.all("epoch_done")] == [0, 1]
    assert log.all("epoch_done", where=lambda e: e["epoch"] >= 1)[0]["loss"] == 7.5
    assert log.last("dht_started")["initial_peers"] == ["/ip4/127.0.0.1/tcp/1/p2p/X"]
    assert log.wait("epoch_done", timeout=1, count=2)["epoch"] == 1
    with pytest.raises(TimeoutError, match="epoch_done"):
        log.wait("epoch_done", timeout=0.5, count=3)
    _write(log.path, partial='ne", "time": 4.0, "pid": 1, "epoch": 2, "loss": 7.0}\n')
    assert log.wait("epoch_done", timeout=1, count=3)["epoch"] == 2
    log.clear()
    assert log.read() == []


@pytest.mark.timeout(60)
def test_waiting_on_an_event_fails_fast_when_the_peer_exits(tmp_path):
    script = tmp_path / "peer.py"
    script.write_text(
        "import json, sys\n"
        "with open(sys.argv[sys.argv.index('--events_file') + 1], 'a') as f:\n"
        "    f.write(json.dumps({'event': 'exiting', 'time': 0.0, 'pid': 0, 'code': 3}) + '\\n')\n"
        "sys.exit(3)\n"
    )
    peer = PeerProcess(
        [],
        script=str(script),
        name="short",
        log_path=tmp_path / "short.log",
        events_path=tmp_path / "short.events.jsonl",
    )
    (tmp_path / "short.events.jsonl").write_text('{"event": "exiting", "time": 0.0, "pid": 0, "code": 0}\n')
    peer.start()  # an earlier run's events are dropped, as its log is
    with pytest.raises(PeerExited, match="joined"):
        peer.events.wait("joined", timeout=30)
    assert [e["code"] for e in peer.events.all("exiting")] == [3]  # what it wrote before exiting still counts


def test_trainers_with_fault_variables_start_through_the_fault_entry_point():
    assert not injects_faults(None) and not injects_faults({"OMP_NUM_THREADS": "1", "LEANHIVE_LOG_LEVEL": "DEBUG"})
    assert trainer_entry_point({}) == {"script": "run_trainer.py"}
    for name in ("LEANHIVE_FAULT_NAN_GRAD_STEPS", "LEANHIVE_FAULT_DIE_IN_ALLREDUCE", "LEANHIVE_TEST_PARAMS_DIR"):
        assert injects_faults({name: "1"})
        assert trainer_entry_point({name: "1"}) == {"module": FAULT_TRAINER_MODULE}
    peer = PeerProcess(
        ["--help"],
        name="faulty",
        log_path=Path("unused.log"),
        **trainer_entry_point({"LEANHIVE_FAULT_NAN_PARAM_EPOCHS": "2"}),
    )
    assert peer.command[:3] == [sys.executable, "-m", "benchmarks.testbed.fault_trainer"]
    assert (REPO_ROOT / "benchmarks" / "testbed" / "fault_trainer.py").exists()


def test_production_code_has_no_fault_hooks():
    """Fault injection is the tests' business: nothing users run reads the fault variables or imports tests/."""
    sources = [REPO_ROOT / "run_trainer.py", REPO_ROOT / "run_aux_peer.py"]
    for package in ("peer", "aux_monitor", "model"):
        sources += sorted((REPO_ROOT / package).rglob("*.py"))
    pattern = re.compile(r"LEANHIVE_FAULT_|LEANHIVE_TEST_PARAMS_DIR|^\s*(from|import) tests\b|\bfaults\.maybe_", re.M)
    offenders = [str(path.relative_to(REPO_ROOT)) for path in sources if pattern.search(path.read_text())]
    assert not offenders, f"fault hooks in production code: {offenders}"


def test_the_faulty_gradient_averager_keeps_the_production_rpc_names():
    """hivemind names averaging RPCs after the averager class: a faulty peer must still average with the others."""
    from benchmarks.testbed.fault_trainer import FAULTY_AVERAGERS, FaultyGradientAverager
    from peer.swarm.hivemind_seam import LeanHiveGradientAverager
    from peer.swarm.optimizer import GRADIENT_AVERAGERS

    assert issubclass(FaultyGradientAverager, LeanHiveGradientAverager)
    assert FAULTY_AVERAGERS["sync"] is FaultyGradientAverager and FAULTY_AVERAGERS.keys() == GRADIENT_AVERAGERS.keys()
    assert all(issubclass(FAULTY_AVERAGERS[mode], GRADIENT_AVERAGERS[mode]) for mode in GRADIENT_AVERAGERS)
    assert FaultyGradientAverager._get_handle_name(
        "run_grad_averager", "rpc_join_group"
    ) == LeanHiveGradientAverager._get_handle_name("run_grad_averager", "rpc_join_group")


def test_shared_memory_files_of_processes_that_are_gone_are_removed(tmp_path):
    """torch's 'file_system' sharing leaves /dev/shm/torch_<pid>_* behind when a peer is killed; the suite's
    autouse fixture removes those of dead processes created during the test (here on a folder of the test's own)."""
    import subprocess
    import time

    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive = int(finished.stdout), os.getpid()
    started = time.time() - 1.0
    for name in (f"torch_{dead}_123_4", f"torch_{alive}_123_4", "torch_shm_manager_socket", "other_file"):
        (tmp_path / name).write_bytes(b"x")
    old = tmp_path / f"torch_{dead}_5_6"
    old.write_bytes(b"x")
    os.utime(old, (started - 3600, started - 3600))  # from before this test: not ours to judge
    assert remove_orphaned_shared_memory(since=started, folder=tmp_path) == 1
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([f"torch_{alive}_123_4", "torch_shm_manager_socket", "other_file", old.name])


def test_fault_scenarios_have_unique_letters_and_descriptive_names():
    """``python -m benchmarks.faults --only`` selects scenarios by letter (``w,x,y``) or by name."""
    from benchmarks.testbed.faults.scenarios import MATRIX

    letters = [letter for scenario in MATRIX for letter in scenario.keys]
    names = [scenario.name for scenario in MATRIX]
    assert len(set(letters)) == len(letters) and len(set(names)) == len(names)
    assert all(len(name) > 3 and name.isidentifier() and name not in letters for name in names)


def test_the_fault_seams_private_hivemind_names_still_exist():
    """The test-bed's fault seam (benchmarks/testbed/hivemind_faults.py) is pinned like the production seam: each
    private hivemind name it uses still exists in the pinned hivemind, as a function."""
    import importlib
    import inspect

    from benchmarks.testbed.hivemind_faults import PINNED

    for module, cls, name in PINNED:
        attribute = getattr(getattr(importlib.import_module(module), cls), name)
        assert inspect.isfunction(attribute), f"{module}.{cls}.{name} is no longer a method"


def test_a_ready_file_appears_whole(tmp_path):
    """A helper's ready file is renamed into place (benchmarks.testbed.processes.write_ready_file): a starter that
    polls for it never reads it empty, as a CI run once did between a plain write's create and its write."""
    path = tmp_path / "donor.ready"
    write_ready_file(path, '{"peer_id": "Qm"}')
    write_ready_file(path, '{"peer_id": "Qm2"}')
    assert path.read_text() == '{"peer_id": "Qm2"}' and sorted(p.name for p in tmp_path.iterdir()) == ["donor.ready"]
