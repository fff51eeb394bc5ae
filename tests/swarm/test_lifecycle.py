"""A peer's process lifecycle (peer.swarm.process_guard, peer.swarm.lifecycle): children die with a SIGKILLed
parent, a stop signal interrupts a step that overruns the grace period or is lost while joining, and the debug
loggers named in the environment. Small scripts as real subprocesses."""

from __future__ import annotations

import textwrap

import pytest

from benchmarks.testbed.processes import PeerProcess

# ---------------------------------------------------------------------------------------- process guard

_GUARDED = textwrap.dedent("""
    import multiprocessing as mp, subprocess, sys, time
    from peer.swarm import process_guard

    def child():
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print("grandchild", grandchild.pid, flush=True)
        time.sleep(120)

    if __name__ == "__main__":
        process_guard.install()
        mp.set_start_method("fork")
        proc = mp.Process(target=child, daemon=True)
        proc.start()
        print("child", proc.pid, flush=True)
        time.sleep(120)
""")


@pytest.mark.timeout(60)
def test_children_die_with_a_sigkilled_parent(tmp_path):
    script = tmp_path / "guarded.py"
    script.write_text(_GUARDED)
    peer = PeerProcess([], script=str(script), name="guarded", log_path=tmp_path / "guarded.log")
    peer.start()
    peer.wait_for(r"grandchild \d+", timeout=30)
    assert len(peer.snapshot_tree()) == 3
    peer.kill()
    assert not peer.wait_until_gone(timeout=10)


_STUCK_PEER = textwrap.dedent("""
    import logging, sys, threading
    import peer.swarm.lifecycle as cli

    class StuckPeer:  # its step never ends by itself, like an all-reduce waiting out a long averaging_timeout
        @classmethod
        def build(cls, control, parts):
            parts.callback(print, "backup written", flush=True)
            return cls()
        def run(self):
            print("running", flush=True)
            threading.Event().wait()

    logging.basicConfig(level=logging.INFO)
    cli.STOP_GRACE_SECONDS = float(sys.argv[1])
    cli.run_peer(StuckPeer.build)
""")


@pytest.mark.timeout(60)
def test_a_stop_signal_interrupts_a_step_that_overruns_the_grace_period(tmp_path):
    import signal
    import time

    script = tmp_path / "stuck.py"
    script.write_text(_STUCK_PEER)
    peer = PeerProcess(["2"], script=str(script), name="stuck", log_path=tmp_path / "stuck.log").start()
    peer.wait_for("running", timeout=30)
    started = time.monotonic()
    assert peer.stop(signal.SIGTERM, timeout=20) == 0
    assert 1.5 < time.monotonic() - started < 10
    log = peer.log()
    assert "interrupting it" in log and "Interrupted: leaving" in log and "backup written" in log


_SWALLOWING_PEER = textwrap.dedent("""
    import functools, logging, sys, threading
    import peer.swarm.lifecycle as cli

    class SwallowingPeer:  # the stop-now KeyboardInterrupt lands where Python only prints it, like an at-fork hook
        def __init__(self, control):
            self.control = control
        @classmethod
        def build(cls, after, control, parts):
            parts.callback(print, "backup written", flush=True)
            print("joining", flush=True)
            try:
                threading.Event().wait()
            except KeyboardInterrupt:
                print("interrupt swallowed", flush=True)
            if after == "stuck":  # still joining: only a second interrupt gets it out
                threading.Event().wait()
            return cls(control)
        def run(self):
            print("run entered, stop requested:", self.control.stop_requested.is_set(), flush=True)

    logging.basicConfig(level=logging.INFO)
    cli.STOP_RETRY_SECONDS = 1.0
    cli.run_peer(functools.partial(SwallowingPeer.build, sys.argv[1]))
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("after", ["returns", "stuck"])
def test_a_stop_signal_lost_while_joining_still_stops_the_peer(after, tmp_path):
    """A lost interrupt is remembered (the run loop sees the request) and raised again until it takes effect."""
    import signal

    script = tmp_path / "swallowing.py"
    script.write_text(_SWALLOWING_PEER)
    peer = PeerProcess([after], script=str(script), name="swallowing", log_path=tmp_path / "swallowing.log").start()
    peer.wait_for("joining", timeout=30)
    assert peer.stop(signal.SIGTERM, timeout=20) == 0
    log = peer.log()
    assert "interrupt swallowed" in log and "backup written" in log
    if after == "returns":
        assert "run entered, stop requested: True" in log
    else:
        assert "raising it again" in log and "Interrupted: leaving" in log and "run entered" not in log


def test_debug_loggers_env_turns_on_debug_for_the_named_loggers_only(monkeypatch):
    import logging

    from peer.swarm.lifecycle import DEBUG_LOGGERS_ENV, configure_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    named = [logging.getLogger(name) for name in ("hivemind.averaging.matchmaking", "leanhive.test.debug")]
    monkeypatch.setenv(DEBUG_LOGGERS_ENV, "hivemind.averaging.matchmaking, leanhive.test.debug,")
    try:
        configure_logging()
        assert all(logger.isEnabledFor(logging.DEBUG) for logger in named)
        assert not logging.getLogger("hivemind.dht").isEnabledFor(logging.DEBUG)
        assert not logging.getLogger("peer.trainer").isEnabledFor(logging.DEBUG)
    finally:
        root.handlers[:], root.level = saved
        for logger in named:
            logger.setLevel(logging.NOTSET)
