"""The collaboration-efficiency benchmark (issue 12): its byte accounting on known sizes, and ``--quick`` end to end
with real peers on emulated links (solo and sync on broadband, the tiny model). No timing assertions: the figures
must be present and sane, whatever this machine's speed.

The end-to-end test is opt-in, like the other suites on emulated links (tests/test_faults_swarm.py):
``LEANHIVE_SWARM_BENCH=1 python -m pytest tests/test_swarm_benchmark.py`` (about a minute, as root). Its links run
through user-space delay proxies: on a machine loaded by the rest of the suite and a busy CPU beside it, the two
peers once lost sight of each other over them and never averaged (a sane benchmark then has to fail)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.swarm_lib import CounterSampler, allreduce_bound_per_epoch, wire_bytes_of
from tests.support.netem.hosts import netns_skip_marker

REPO = Path(__file__).resolve().parents[1]
SWARM_BENCH_ENV = "LEANHIVE_SWARM_BENCH"


def test_wire_format_and_butterfly_bound():
    # 8-bit blockwise with one fp32 scale per 4096 values for large tensors, fp16 for small ones
    assert wire_bytes_of([8192, 100], threshold=4096) == 8192 + 2 * 4 + 2 * 100
    # two peers: half the vector out and half in, twice (reduce-scatter, all-gather) = 2x the vector
    assert allreduce_bound_per_epoch(1000, 2) == 2000
    assert allreduce_bound_per_epoch(900, 3) == pytest.approx(2400)
    assert allreduce_bound_per_epoch(1000, 1) == 0


def test_counters_are_interpolated_between_samples():
    sampler = CounterSampler([object(), object()])
    sampler.samples = [(10.0, [0, 100]), (20.0, [1000, 300])]
    assert sampler.at(15.0) == [500.0, 200.0]
    assert sampler.at(5.0) == [0.0, 100.0] and sampler.at(25.0) == [1000.0, 300.0]


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    os.environ.get(SWARM_BENCH_ENV) != "1",
    reason=f"the swarm benchmark on emulated links: set {SWARM_BENCH_ENV}=1 to run it (as root)",
)
@netns_skip_marker()
def test_quick_matrix_reports_sane_figures(tmp_path):
    rows_path, plot_path = tmp_path / "rows.json", tmp_path / "swarm.png"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.swarm",
            "--quick",
            "--json",
            str(rows_path),
            "--plot",
            str(plot_path),
            "--folder",
            str(tmp_path / "runs"),
            "--run_timeout",
            "200",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| link | mode |" in result.stdout and "efficiency" in result.stdout
    rows = {row["mode"]: row for row in json.loads(rows_path.read_text())}
    assert set(rows) == {"solo", "sync"}
    solo, sync = rows["solo"], rows["sync"]
    assert solo["efficiency"] == 1.0 and solo["samples_per_second"] > 0
    assert solo["bytes_per_sample"] < 1000  # a peer alone sends next to nothing
    assert sync["epochs_measured"] >= 2 and sync["exit_codes"] == [0, 0]
    assert 0.05 < sync["efficiency"] < 1.5
    # gradients crossed the wire: at least the all-reduce bound, and not absurdly more
    assert sync["bound_bytes_per_sample"] > 0
    assert 0.5 <= sync["bytes_over_bound"] < 20
    breakdown = sync["breakdown"]
    assert breakdown["compute"] > 0 and breakdown["grad_allreduce"] > 0 and breakdown["optimizer_step"] > 0
    for row in (solo, sync):
        assert math.isfinite(row["validation_loss"]) and 0 < row["validation_loss"] < math.log(4096) + 1
        assert row["curve"] and all(point["samples"] > 0 for point in row["curve"])
    assert plot_path.stat().st_size > 10_000
