"""The collaboration-efficiency benchmark (benchmarks/swarm.py): its byte accounting on known sizes, the equal-samples
rule (round sizes, scaled schedules, one measured window for every row), and ``--quick`` end to end with real peers
on emulated links (solo, sync and local sparse on broadband, the tiny model). No timing assertions: the figures must
be present and sane, whatever this machine's speed.

The end-to-end test is opt-in, like the other suites on emulated links: ``python -m pytest -m swarm_bench`` (one to
two minutes, as root). Its epochs last seconds: with sub-second epochs the peers' start-up skew on a loaded machine
could let one peer end the first epochs alone and the other chase it to max_epochs and leave, so they never
averaged. A row also counts such epochs (``epochs_alone``), and the test requires none in the measured window."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.swarm import against_sync, curve_table, parse_args, rows_from_record, table, uplink_table
from benchmarks.swarm_lib import (
    CounterSampler,
    Row,
    RunSettings,
    allreduce_bound_per_epoch,
    loss_at,
    measure,
    params_every,
    validation_losses,
    wire_bytes_of,
)
from benchmarks.testbed.events import EventLog

REPO = Path(__file__).resolve().parents[2]


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


def test_upload_is_read_per_interval_inside_the_window():
    sampler = CounterSampler([object(), object()])
    sampler.uploads = [(10.0, [0, 0]), (11.0, [1_250_000, 0]), (12.0, [1_250_000, 500]), (14.0, [2_500_000, 500])]
    # 10 Mbit/s in the first second, nothing in the next, 5 Mbit/s over the last two
    assert sampler.upload_rates(0, 10.0, 14.0) == [1_250_000.0, 0.0, 625_000.0]
    assert sampler.upload_rates(0, 10.5, 14.0) == [0.0, 625_000.0]  # only intervals inside the window
    assert sampler.uploaded(13.0) == [1_875_000.0, 500.0]


def test_the_uplink_table_shows_a_burst_against_the_mean_and_skips_rows_without_counters():
    bursty = Row(link="home_asym", mode="local_sparse_x8", peers=2, local_steps=32)
    bursty.mean_upload_mbit, bursty.peak_upload_mbit, bursty.seconds_per_epoch = 0.25, 9.5, 240.0
    bursty.breakdown = {"blocked": 8.9}
    old = Row(link="home_asym", mode="sync", peers=2)
    text = uplink_table([bursty, old])
    assert "| home_asym | local_sparse_x8 | 32 | 0.25 | 9.50 | 38.0 | 8.9 | 240.0 |" in text
    assert "sync" not in text
    assert uplink_table([old]) == ""


def _flag(flags, name):
    return flags[flags.index(name) + 1]


def test_every_mode_trains_the_same_samples_on_the_same_schedule():
    settings = RunSettings(epochs=32, target_batch_size=128, per_device_batch_size=4, gradient_accumulation_steps=4)
    assert settings.total_samples == 4096
    for mode, rounds, epochs in (("sync", 128, 32), ("local_x4", 512, 8), ("local_x16", 2048, 2)):
        flags = settings.flags(mode)
        assert settings.round_size(mode) == rounds and settings.epochs_of(mode) == epochs
        assert int(_flag(flags, "--target_batch_size")) * int(_flag(flags, "--max_epochs")) == 4096
    # the schedule (2 warmup and 100 total epochs of 128 samples) is kept in samples: 25 rounds of 512
    assert (_flag(settings.flags("sync"), "--warmup_steps"), _flag(settings.flags("sync"), "--total_steps")) == (
        "2",
        "100",
    )
    assert (
        _flag(settings.flags("local_x4"), "--warmup_steps"),
        _flag(settings.flags("local_x4"), "--total_steps"),
    ) == (
        "1",
        "25",
    )
    # H: a round of 2048 samples over 2 peers taking local steps of 4 micro-batches of 4 samples
    assert settings.local_steps("local_x16") == 2048 / (2 * 4 * 4) and math.isnan(settings.local_steps("sync"))
    assert settings.check(["solo", "sync", "local_x16"]) is None
    assert "multiple of 16" in RunSettings(epochs=24).check(["sync", "local_x16"])
    assert "at least 32" in RunSettings(epochs=16).check(["sync", "local_x16"])
    assert "local_x8 cannot start" in RunSettings(epochs=24).check(["sync", "local_x8", "local_x12"])
    with pytest.raises(SystemExit):
        parse_args(["--modes", "solo,sync,local_x4", "--epochs", "6"])
    assert params_every(2048, 128) == 4 and params_every(2048, 2048) == 1


def _peer(tmp_path, name, epochs, client_mode=False):
    """What ``measure`` reads of a finished peer: its reachability and epoch_done events (a real event log), exit
    code, timings."""
    log = EventLog(tmp_path / f"{name}.events.jsonl")
    log.clear()
    events = [dict(event="reachability", client_mode=client_mode)] + [dict(event="epoch_done", **e) for e in epochs]
    log.path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return SimpleNamespace(events=log, poll=lambda: 0, timings=lambda: [])


def test_every_row_is_measured_after_the_largest_round(tmp_path):
    # a sync row of 8 epochs of 128 samples in a matrix whose largest round is 512: epochs 3 (ends at 512) to 7
    epochs = [dict(epoch=e, time=10.0 * (e + 1), samples=64, loss=8.0 - e / 10, peers=2) for e in range(8)]
    peers = [_peer(tmp_path, "a", epochs), _peer(tmp_path, "b", epochs)]
    sampler = CounterSampler([object(), object()])
    sampler.samples = [(0.0, [0, 0]), (100.0, [10_000, 10_000])]
    # the window is 40 s to 80 s: peer a sends a 10 Mbit/s burst in its first second, 2.5 MB in all; peer b 1 MB
    sampler.uploads = [(40.0, [0, 0]), (41.0, [1_250_000, 0]), (80.0, [2_500_000, 1_000_000])]

    def measured(window_start):
        row = Row(link="home", mode="sync", peers=2, round_samples=128)
        return measure(row, peers, sampler, 0.0, wire_bytes=1000, solo_rate=2.0, window_start=window_start)

    row = measured(512)
    assert row.error is None and row.epochs_measured == 4 and row.samples_measured == 4 * 128
    assert row.seconds_measured == 40.0 and row.samples_per_second == 512 / 40 and row.efficiency == 512 / 40 / 4
    assert row.bytes_per_sample == 2 * 4000 / 512  # 100 bytes/s per peer over the 40 s window
    assert row.peak_upload_mbit == pytest.approx(10.0) and row.mean_upload_mbit == pytest.approx((0.5 + 0.2) / 2)
    assert len(row.curve) == 8  # the training-loss curve keeps every epoch
    assert row.clients == 0
    late = measured(1024)
    assert late.error and "fewer than 2" in late.error
    # a peer that came up as a client (a testbed whose proxies hid its address from the dial-back probe) is counted
    peers[1] = _peer(tmp_path, "b", epochs, client_mode=True)
    assert measured(512).clients == 1


def test_tables_compare_every_mode_with_sync():
    # sync's epochs overshot their 512 samples (600 trained per epoch): the local row is compared at its 1100 samples
    sync = Row(link="home", mode="sync", peers=2, round_samples=512, bytes_per_sample=2000.0, validation_loss=7.0)
    sync.curve = [dict(epoch=0, samples=600, loss=8.0), dict(epoch=1, samples=1200, loss=7.5)]
    sync.val_curve = [dict(epoch=0, samples=512, loss=7.5), dict(epoch=1, samples=1024, loss=7.0)]
    local = Row(link="home", mode="local_x2", peers=2, round_samples=1024, local_steps=32.0, bytes_per_sample=80.0)
    local.validation_loss, local.efficiency, local.compute_share = 7.07, 0.93, 0.9
    local.curve = [dict(epoch=0, samples=1100, loss=7.2)]
    local.val_curve = [dict(epoch=0, samples=1024, loss=7.07)]
    assert local.samples_trained == 1100 and sync.validation_points() == [(600.0, 7.5), (1200.0, 7.0)]
    assert loss_at(sync.validation_points(), 1100) == pytest.approx(7.5 - 0.5 * 500 / 600)
    assert math.isnan(loss_at(sync.validation_points(), 1300))
    compared = against_sync([sync, local])
    gap = 100 * (7.07 / (7.5 - 0.5 * 500 / 600) - 1)
    assert f"| home | local_x2 | 32 | 25.0 | 1100 | 7.070 | 7.083 | {gap:.1f} | 1.0 | 0.93 | — | 0.90 |" in compared
    assert "| home | local_x2 | — | 7.070 (1.1k) |" in curve_table([sync, local])
    assert "| home | local_x2 | 2 | 1024 | 32 | 1100 |" in table([sync, local])
    # with the solo row: the compute share over solo's (peers computing at the same speed, as on separate GPUs)
    solo = Row(link="any", mode="solo", peers=1, compute_share=0.96)
    assert "| 0.93 | 0.94 | 0.90 |" in against_sync([solo, sync, local])
    assert "| 0.93 | 0.94 | 0.90 |" in table([solo, sync, local])


def test_a_recorded_run_is_read_back_into_the_rows_its_tables_print(tmp_path):
    """A figure can hold rows whose --json is gone (only their recorded tables are kept) next to new rows."""
    from benchmarks.docs import parse_markdown_tables

    sync = Row(link="home_asym", mode="sync", peers=2, round_samples=256, bytes_per_sample=802912.0)
    sync.bound_bytes_per_sample, sync.samples_per_second, sync.compute_share = 375312.0, 3.761, 0.449
    sync.seconds_per_epoch, sync.validation_loss, sync.breakdown = 77.8, 6.6913, {"compute": 34.7, "blocked": 40.3}
    sync.curve = [dict(epoch=e, samples=1190.0 * (e + 1), seconds=60.0 * e, loss=7.0) for e in range(8)]
    sync.val_curve = [dict(epoch=e, samples=1024 * (e + 1), loss=7.7 - 0.1 * e) for e in range(8)]
    sparse = Row(link="home_asym", mode="local_sparse_x8", peers=3, round_samples=2048, local_steps=32.0)
    sparse.bytes_per_sample, sparse.bound_bytes_per_sample, sparse.validation_loss = 3190.0, 53100.0, 6.506
    sparse.mean_upload_mbit, sparse.peak_upload_mbit, sparse.compute_share = 0.1, 8.56, 0.85
    sparse.curve = [dict(epoch=e, samples=2064.0 * (e + 1), seconds=240.0 * e, loss=7.0) for e in range(4)]
    sparse.val_curve = [dict(epoch=e, samples=2048 * (e + 1), loss=7.8 - 0.4 * e) for e in range(4)]
    printed = [table([sync, sparse]), curve_table([sync, sparse]), uplink_table([sync, sparse])]
    tables = dict(zip(("main", "curve", "uplink"), parse_markdown_tables("\n\n".join(printed))))
    (tmp_path / "run.json").write_text(json.dumps(dict(command="c", date="2026-12-02", tables=tables)))
    rows = rows_from_record(tmp_path / "run.json")
    assert [(r.mode, r.peers) for r in rows] == [("sync", 2), ("local_sparse_x8", 3)]  # "(oversubscribed)" dropped
    assert [table(rows), curve_table(rows), uplink_table(rows)] == printed
    # what the tables print rounded is compared rounded: the bytes to 0.1 KB, the samples trained by each validation
    # point to 0.1k (sync's loss there is read off its curve at the sparse row's 8256 samples)
    assert rows[1].samples_trained == 8256 and rows[0].validation_points()[0] == (1200.0, 7.7)
    read_back, measured = (against_sync(r).splitlines()[2].split(" | ") for r in (rows, [sync, sparse]))
    assert read_back[:3] + read_back[4:6] + read_back[7:] == measured[:3] + measured[4:6] + measured[7:]
    assert float(read_back[3]) == pytest.approx(float(measured[3]), rel=0.01)
    assert float(read_back[6]) == pytest.approx(float(measured[6]), abs=0.005)
    # a file that is not a recorded run of this benchmark is refused with what to give instead
    (tmp_path / "other.json").write_text(json.dumps(dict(command="c", tables={"rows": {}})))
    with pytest.raises(ValueError, match="not a recorded run of this benchmark"):
        rows_from_record(tmp_path / "other.json")


def test_a_recorded_runs_sparse_density_labels_its_sparse_rows_in_the_figure(tmp_path, capsys):
    """The mode names no density and the trainer's default changed (2 % to 5 %): PATH@DENSITY says which a recorded
    run's sparse rows ran at, so that the frontier tells 2 % and 5 % rows of one mode apart."""
    from benchmarks.docs import parse_markdown_tables
    from benchmarks.swarm import write_pareto

    sync = Row(link="home_asym", mode="sync", peers=2, round_samples=256, bytes_per_sample=8e5, validation_loss=6.8)
    dense = Row(link="home_asym", mode="local_x4", peers=2, round_samples=1024, local_steps=16.0)
    sparse = Row(link="home_asym", mode="local_sparse_x8", peers=2, round_samples=2048, local_steps=32.0)
    for row, kb in ((dense, 140.8), (sparse, 3.2)):
        row.bytes_per_sample, row.validation_loss = 1e3 * kb, 6.5
    tables = dict(main=parse_markdown_tables(table([sync, dense, sparse]))[0])
    (tmp_path / "run.json").write_text(json.dumps(dict(command="c", date="2026-12-07", tables=tables)))
    args = parse_args(["--from_record", f"{tmp_path / 'run.json'}@0.02,{tmp_path / 'run.json'}"])
    assert args.from_record == [
        (tmp_path / "run.json", 0.02),
        (tmp_path / "run.json", pytest.approx(math.nan, nan_ok=True)),
    ]
    two, unlabelled = (rows_from_record(path, density) for path, density in args.from_record)
    assert [r.sparse_density for r in two][2] == 0.02
    assert all(math.isnan(r.sparse_density) for r in two[:2] + unlabelled)  # sync and dense rows have no density
    write_pareto(two, tmp_path / "pareto.png")
    assert (tmp_path / "pareto.png").stat().st_size > 0
    for bad in ("0", "1.5", "five"):
        with pytest.raises(SystemExit):
            parse_args(["--from_record", f"run.json@{bad}"])
        assert "must be a fraction in (0, 1], e.g. run.json@0.05" in capsys.readouterr().err


def test_saved_parameters_are_evaluated(tmp_path):
    import torch

    from benchmarks.swarm_peer import save_params
    from model import LeanGPTForCausalLM, load_config

    torch.manual_seed(0)
    path = save_params(LeanGPTForCausalLM(load_config("tiny")), 3, tmp_path)
    assert path.name == "epoch_000003.pt"
    loss, missing = validation_losses([path, tmp_path / "absent.pt"], "tiny", 64, max_batches=1)
    assert 0 < loss < math.log(4096) + 1 and math.isnan(missing)


@pytest.mark.timeout(300)
@pytest.mark.slow
@pytest.mark.swarm_bench
@pytest.mark.netns
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
    assert set(rows) == {"solo", "sync", "local_sparse_x1"}
    solo, sync, sparse = rows["solo"], rows["sync"], rows["local_sparse_x1"]
    assert solo["efficiency"] == 1.0 and solo["samples_per_second"] > 0
    assert solo["bytes_per_sample"] < 1000  # a peer alone sends next to nothing
    assert sync["epochs_measured"] >= 2 and sync["exit_codes"] == [0, 0]
    assert sync["epochs_alone"] == 0, "a peer ended a measured epoch without the other: it did not average"
    assert sync["clients"] == sparse["clients"] == 0, "a peer ran as a client: the rows compare full peers"
    assert 0.05 < sync["efficiency"] < 1.5
    # gradients crossed the wire: at least the all-reduce bound, and not absurdly more
    assert sync["bound_bytes_per_sample"] > 0
    assert 0.5 <= sync["bytes_over_bound"] < 20
    breakdown = sync["breakdown"]
    assert breakdown["compute"] > 0 and breakdown["grad_allreduce"] > 0 and breakdown["optimizer_step"] > 0
    for row in (solo, sync):
        assert math.isfinite(row["validation_loss"]) and 0 < row["validation_loss"] < math.log(4096) + 1
        assert row["curve"] and all(point["samples"] > 0 for point in row["curve"])
        # the validation curve: the first peer's parameters after every epoch, the last one ~ the final parameters
        assert row["round_samples"] == 512 and [p["samples"] for p in row["val_curve"]][-1] == 3 * 512
        assert row["val_curve"][-1]["loss"] == pytest.approx(row["validation_loss"], abs=0.05)
    assert plot_path.stat().st_size > 10_000
    # the sparse local row: its peers averaged every round (all-gather of 2-bit top-k payloads) and sent far less
    assert sparse["exit_codes"] == [0, 0] and sparse["epochs_measured"] >= 1 and sparse["epochs_alone"] == 0
    assert sparse["local_steps"] == 32 and math.isfinite(sparse["validation_loss"])
    assert sparse["bytes_per_sample"] < sync["bytes_per_sample"] / 5
