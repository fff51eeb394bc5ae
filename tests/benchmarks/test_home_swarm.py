"""What the home-network benchmark records besides its runs (benchmarks/testbed/home_swarm.py); the runs themselves
are the opt-in ``home_net`` suite (tests/testbed/test_home_network.py)."""

import subprocess

from benchmarks.testbed import home_swarm


def test_the_code_version_is_dirty_for_changed_code_not_for_the_results_it_writes(tmp_path, monkeypatch):
    """A run of several scenarios writes each one's results under benchmarks/measured before the next starts: those
    files made every later scenario's peers' code read "<commit>-dirty" in the published table."""

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "benchmarks" / "measured").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "measured" / "b.json").write_text("{}\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    monkeypatch.setattr(home_swarm, "ROOT", tmp_path)
    clean = home_swarm._code_version()
    assert clean and not clean.endswith("-dirty")
    (tmp_path / "benchmarks" / "measured" / "b.json").write_text('{"rounds": 36}\n')
    assert home_swarm._code_version() == clean
    (tmp_path / "code.py").write_text("x = 2\n")
    assert home_swarm._code_version() == clean + "-dirty"
