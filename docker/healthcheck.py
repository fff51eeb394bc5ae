"""Container healthcheck: the aux peer must answer on its metrics port; a trainer process must be alive and still
have its p2pd daemon (without it the trainer cannot reach the swarm; the trainer notices too and exits with 1)."""

import os
import sys
import urllib.request
from typing import List, Optional

import psutil

TRAINER_SCRIPT = "run_trainer.py"
AUX_SCRIPT = "run_aux_peer.py"


def trainer_problem(trainer: psutil.Process) -> Optional[str]:
    """Why this trainer process is unhealthy, or None if it is healthy."""
    try:
        if trainer.status() == psutil.STATUS_ZOMBIE:
            return f"the trainer (pid {trainer.pid}) has exited"
        daemons = [
            p for p in trainer.children(recursive=True) if p.name() == "p2pd" and p.status() != psutil.STATUS_ZOMBIE
        ]
    except psutil.NoSuchProcess:
        return f"the trainer (pid {trainer.pid}) has exited"
    if not daemons:
        return f"the trainer (pid {trainer.pid}) has no running p2pd daemon: it cannot reach the swarm"
    return None


def _running(script: str) -> List[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if script in " ".join(cmdline):
            found.append(proc)
    return found


def _role() -> str:
    """The role the entry point started. Docker runs the healthcheck with the container's environment, not the
    entry point's (which exports LEANHIVE_ROLE), so the running peer script tells."""
    if "LEANHIVE_ROLE" in os.environ:
        return os.environ["LEANHIVE_ROLE"]
    return "aux" if _running(AUX_SCRIPT) else "trainer"


def main() -> int:
    role = _role()
    if role == "aux":
        port = os.environ.get("LEANHIVE_METRICS_PORT", "9100")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                return 0 if response.status == 200 else 1
        except OSError as e:
            print(f"aux peer metrics endpoint not answering: {e}", file=sys.stderr)
            return 1
    trainers = _running(TRAINER_SCRIPT)
    if not trainers:
        print(f"no {TRAINER_SCRIPT} process is running", file=sys.stderr)
        return 1
    # hivemind forks children that inherit the command line: the trainer is the one whose parent is not one too
    pids = {p.pid for p in trainers}
    roots = [p for p in trainers if p.ppid() not in pids]
    problems = [problem for problem in map(trainer_problem, roots) if problem]
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
