"""Start LeanHive peers (trainers, auxiliary peers) as real subprocesses and watch what they do.

General on purpose: a ``PeerProcess`` runs any entry point (a script or a ``-m`` module) with any arguments,
writes its output to a log file, and offers what multi-peer tests need: the peer's lifecycle events (with
``events_path``: the peer gets ``--events_file`` and ``peer.events`` reads it, see ``benchmarks.testbed.events``),
wait for a log line (ad-hoc scripts, hivemind's own messages), read the log, list the process tree, stop it
with a signal or kill it, and check that nothing of it is left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import psutil

from benchmarks.testbed.events import EventLog
from peer.swarm.lifecycle import DEBUG_LOGGERS_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
INITIAL_PEERS_RE = re.compile(r"--initial_peers (\S+(?: /\S+)*)")

# A model small enough for a 2-core machine, with the shipped tokenizer's vocabulary.
TINY_MODEL = {
    "vocab_size": 4096,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 256,
    "max_position_embeddings": 512,
}


def _die_with_parent() -> None:
    """preexec_fn: the peer gets SIGKILL if the test process dies, so no peer outlives a crashed test."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class PeerExited(RuntimeError):
    """The peer process ended while a test was waiting for it to log something."""


class PeerProcess:
    """One peer as a subprocess; stdout and stderr go to ``log_path``.

    ``script`` is a path relative to ``cwd`` (or absolute); ``module`` runs ``python -m module`` instead.
    With ``events_path`` the peer is given ``--events_file events_path`` and ``self.events`` reads it (the file
    is emptied on ``start()``, as the log is); without it ``self.events`` is None.
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        name: str,
        log_path: Path,
        script: str = "run_trainer.py",
        module: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        cwd: Path = REPO_ROOT,
        events_path: Optional[Path] = None,
    ):
        self.name, self.log_path = name, Path(log_path)
        self.events: Optional[EventLog] = None
        if events_path is not None:
            args = [*args, "--events_file", events_path]
            self.events = EventLog(Path(events_path), process=self)
        entry = ["-m", module] if module else [str(Path(cwd) / script)]
        self.command = [sys.executable, *entry, *map(str, args)]
        # this checkout's packages come first, whatever folder the script is in
        python_path = os.pathsep.join(filter(None, [str(cwd), os.environ.get("PYTHONPATH")]))
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": python_path,
            # a few lines per round, so that a log printed for a failed test says why a round found no group or why
            # the round agreement did (not) repair a difference; loggers named in the caller's own variable are added
            DEBUG_LOGGERS_ENV: ",".join(
                filter(None, ["hivemind.averaging.matchmaking,peer.swarm.agreement", os.environ.get(DEBUG_LOGGERS_ENV)])
            ),
            **(env or {}),
        }
        self.cwd = cwd
        self.process: Optional[subprocess.Popen] = None
        self._known_tree: Dict[int, float] = {}  # pid -> create_time, for processes seen in the tree

    def start(self) -> "PeerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.events is not None:
            self.events.clear()
        log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd, preexec_fn=_die_with_parent
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def poll(self) -> Optional[int]:
        return self.process.poll()

    def wait_for(
        self, pattern: str, timeout: float, *, count: int = 1, where: Optional[Callable[[re.Match], bool]] = None
    ) -> re.Match:
        """Wait until the log matches ``pattern`` (``count`` times, counting only matches that pass ``where``);
        return the last match."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            self.snapshot_tree()
            matches = [m for m in regex.finditer(self.log()) if where is None or where(m)]
            if len(matches) >= count:
                return matches[count - 1]
            if self.poll() is not None:
                raise PeerExited(f"{self.name} exited with {self.poll()} before logging {pattern!r}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not log {pattern!r} within {timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.2)

    def initial_peers(self, timeout: float = 90.0) -> List[str]:
        """The multiaddrs others pass to --initial_peers to join this peer: from its ``dht_started`` event, or
        (a peer started without ``events_path``) from the '--initial_peers ...' line it logs on start."""
        if self.events is not None:
            return [str(maddr) for maddr in self.events.wait("dht_started", timeout)["initial_peers"]]
        return self.wait_for(INITIAL_PEERS_RE.pattern, timeout).group(1).split()

    def snapshot_tree(self) -> List[psutil.Process]:
        """The peer and all its descendants now; remembered so that orphans can be found after a kill."""
        try:
            root = psutil.Process(self.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        for proc in tree:
            try:
                self._known_tree.setdefault(proc.pid, proc.create_time())
            except psutil.NoSuchProcess:
                pass
        return tree

    def surviving_processes(self) -> List[psutil.Process]:
        """Processes ever seen in this peer's tree that are still running (zombies count as gone)."""
        alive = []
        for pid, created in self._known_tree.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.NoSuchProcess:
                pass
        return alive

    def wait_until_gone(self, timeout: float) -> List[psutil.Process]:
        """Wait until no process of this peer is left; return the survivors (empty on success)."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()  # reap our direct child
            survivors = self.surviving_processes()
            if not survivors or time.monotonic() > deadline:
                return survivors
            time.sleep(0.2)

    def send_signal(self, sig: int) -> None:
        self.snapshot_tree()
        if self.poll() is None:
            self.process.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the peer and wait for it to exit; returns the exit status."""
        self.send_signal(sig)
        return self.wait(timeout)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float) -> int:
        """Wait for the peer to exit on its own; on timeout it is killed and TimeoutError raised."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_tree()
            raise TimeoutError(f"{self.name} did not exit within {timeout:.0f} s:\n{self.tail()}") from None

    def kill_tree(self) -> None:
        for proc in [*self.snapshot_tree(), *self.surviving_processes()]:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        if self.process is not None:
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def wait_all(peers: Iterable[PeerProcess], timeout: float) -> List[int]:
    """Wait for several peers to exit within one shared deadline; returns their exit statuses."""
    deadline = time.monotonic() + timeout
    return [peer.wait(max(1.0, deadline - time.monotonic())) for peer in peers]


def kill_all(peers: Iterable[PeerProcess]) -> None:
    for peer in peers:
        if peer.process is not None:
            peer.kill_tree()


def write_ready_file(path, text: str) -> None:
    """Write what a helper process tells its starter once it is ready, whole: the starter polls for the file
    (``wait_for_file``) and would read it empty between a plain write's create and its write (a CI run failed on
    that: ``JSONDecodeError`` on an empty ready file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def wait_for_file(path: Path, peer: Optional[PeerProcess], timeout: float) -> str:
    """The text ``peer`` writes to ``path`` with ``write_ready_file`` once it is ready; raises if the peer exits or
    ``timeout`` passes first. ``peer`` None: a process this one did not start (it only waits)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if peer is not None and peer.poll() is not None:
            raise RuntimeError(f"{peer.name} exited with {peer.poll()}:\n{peer.tail()}")
        if time.monotonic() > deadline:
            who = f"{peer.name} was not ready" if peer is not None else f"{path} was not written"
            raise TimeoutError(f"{who} within {timeout:.0f} s:\n{peer.tail() if peer is not None else ''}")
        time.sleep(0.2)
    return path.read_text()


SHARED_MEMORY_DIR = Path("/dev/shm")


def remove_orphaned_shared_memory(since: float, folder: Path = SHARED_MEMORY_DIR) -> int:
    """Delete the tensors torch shared through files (hivemind's 'file_system' strategy: ``torch_<pid>_*`` in
    /dev/shm) that were created since ``since`` (epoch seconds) by processes that are gone. A peer killed with
    SIGKILL never unlinks them: on a development machine they piled up to 20 GB of RAM in a day of test runs and the
    OOM killer ended a test run. Returns how many files were removed."""
    removed = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        parts = name.split("_")
        if len(parts) < 3 or parts[0] != "torch" or not parts[1].isdigit() or psutil.pid_exists(int(parts[1])):
            continue
        try:
            if os.stat(folder / name).st_mtime >= since:
                os.unlink(folder / name)
                removed += 1
        except OSError:  # gone meanwhile
            pass
    return removed


def share_tensors_by_file_descriptor() -> None:
    """For tests that run hivemind in the pytest process itself.

    hivemind switches torch to the 'file_system' sharing strategy, which relies on a torch_shm_manager
    child process; the suite's autouse fixture kills every child after each test, so the next test's
    MPFutures would fail with 'Broken pipe'. The 'file_descriptor' strategy needs no helper process.
    """
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_descriptor")
