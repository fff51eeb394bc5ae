"""The aux peer with real trainers (separate processes on 127.0.0.1), in one swarm run:

1. aux + Prometheus + 2 trainers: /metrics shows 2 alive peers and a falling loss; Prometheus scrapes
   the series; the dashboard in headless Chromium shows the numbers /metrics has; checkpoints load
   with from_pretrained;
2. every trainer killed, a new one started: it continues from the checkpointed epoch with a loss near
   where training stopped; an aux checkpoint equals that trainer's parameters at the same epoch;
3. aux stopped, newest checkpoint corrupted, aux restarted with --resume: it says so, uses the
   previous one, deletes nothing, and a trainer joining the otherwise empty swarm continues from it.
"""

import json
import math
import time
from pathlib import Path

import pytest
import torch

from aux_monitor.checkpoints import MANIFEST
from benchmarks.testbed.aux import (
    ARTIFACTS,
    RUN_ID,
    DashboardDom,
    PrometheusServer,
    api_state,
    checkpoint_dirs,
    dump_dom,
    free_port,
    peer_report,
    scrape,
    screenshot,
    start_aux,
    swarm_processes,
    wait_for,
)
from benchmarks.testbed.trainers import start_trainer
from model import LeanGPTForCausalLM


def check_dashboard_matches_metrics(url, tmp_path):
    """The numbers the page shows (after its scripts ran) are the ones /metrics serves for the same refresh."""
    for attempt in range(8):
        before = scrape(url + "/metrics")
        dom = DashboardDom(dump_dom(url + "/", tmp_path / f"chromium-{attempt}"))
        after = scrape(url + "/metrics")
        shown = int(dom.body["data-generation"])
        metrics = next((m for m in (before, after) if m[("leanhive_monitor_updates_total", ())] == shown), None)
        if metrics is None:
            continue  # the monitor's state changed while the page loaded: try again
        assert float(dom.value("updated")) == metrics[("leanhive_last_refresh_timestamp_seconds", ())]
        assert int(dom.value("alive-peers")) == metrics[("leanhive_alive_peers", ())] == 2
        assert int(dom.value("global-epoch")) == metrics[("leanhive_global_epoch", ())]
        assert float(dom.value("loss")) == pytest.approx(metrics[("leanhive_loss", ())], rel=1e-12)
        assert dom.text("loss") == f"{metrics[('leanhive_loss', ())]:.4f}".rstrip("0").rstrip(".")
        assert float(dom.value("samples-per-second")) == pytest.approx(
            metrics[("leanhive_samples_per_second", ())], rel=1e-12
        )
        assert int(dom.value("samples-total")) == metrics[("leanhive_samples_total", ())]
        if ("leanhive_last_checkpoint_epoch", ()) in metrics:
            assert int(dom.value("checkpoint-epoch")) == metrics[("leanhive_last_checkpoint_epoch", ())]
            assert dom.text("checkpoint-path").startswith(str(tmp_path / "ckpt"))
        if ("leanhive_eval_loss", ()) in metrics:
            assert float(dom.value("eval-loss")) == pytest.approx(metrics[("leanhive_eval_loss", ())], rel=1e-12)
            assert float(dom.value("eval-perplexity")) == pytest.approx(
                metrics[("leanhive_eval_perplexity", ())], rel=1e-12
            )
        leaderboard = {row["data-peer"]: int(row["data-samples"]) for row in dom.rows}
        exported = {
            dict(labels)["peer"]: value
            for (name, labels), value in metrics.items()
            if name == "leanhive_peer_samples_total"
        }
        assert leaderboard == exported and len(leaderboard) == 2
        assert dom.text("initial-peers").startswith("--initial_peers /ip4/127.0.0.1/")
        assert int(dom.by_id["loss-chart"]["data-points"]) >= 3
        return
    pytest.fail("the monitor refreshed during every page load; could not compare a consistent pair")


def watch_backups(path: Path, store: dict) -> None:
    """Remember the trainer's backup (parameters) of every epoch it is seen at (backup.pt is replaced each epoch)."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (FileNotFoundError, EOFError, RuntimeError):
        return
    store.setdefault(payload["epoch"], payload["model"])


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_aux_peer_with_trainers(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with swarm_processes() as procs, PrometheusServer(tmp_path / "prometheus", [f"127.0.0.1:{port}"]) as prometheus:
        # ---------------------------------------------------------------- 1. aux + Prometheus + 2 trainers
        aux = start_aux("aux", tmp_path, port, "--eval_every", 4, "--eval_batch_size", 8, "--eval_max_batches", 4)
        procs.append(aux)
        addrs = aux.initial_peers(timeout=120)
        trainers = [start_trainer(tmp_path, f"trainer{i}", RUN_ID, initial_peers=addrs) for i in (1, 2)]
        procs += trainers
        prometheus.wait_ready()
        aux.events.wait("serving", timeout=120)
        started = time.time()

        wait_for(
            lambda: scrape(url + "/metrics").get(("leanhive_global_epoch", ()), -1) >= 9,
            timeout=240,
            interval=1,
            what="the swarm to report epoch 9",
        )
        metrics = scrape(url + "/metrics")
        assert metrics[("leanhive_alive_peers", ())] == 2
        assert len([k for k in metrics if k[0] == "leanhive_peer_samples_total"]) == 2
        epochs = [e for e in api_state(url)["swarm"]["epochs"] if e["loss"] is not None]
        first_loss, recent_loss = epochs[0]["loss"], min(e["loss"] for e in epochs[-2:])
        assert recent_loss < first_loss - 0.25, f"loss did not fall: {[round(e['loss'], 3) for e in epochs]}"

        # Prometheus scraped the aux peer: its query API returns the loss series, and it falls
        series = wait_for(
            lambda: (s := prometheus.query_range("leanhive_loss", time.time() - started + 5)) and len(s) >= 5 and s,
            timeout=30,
            what="Prometheus to have the loss series",
        )
        values = [v for _, v in series]
        assert values[-1] < values[0]
        assert all(math.isfinite(v) for v in values)
        alive = prometheus.query_range("leanhive_alive_peers", 10)
        assert alive and alive[-1][1] == 2

        # evaluation of the swarm's state on the shipped validation split is published too
        metrics = wait_for(
            lambda: (m := scrape(url + "/metrics")).get(("leanhive_eval_loss", ())) and m,
            timeout=60,
            what="an evaluation",
        )
        assert metrics[("leanhive_eval_epoch", ())] >= 4
        assert metrics[("leanhive_eval_perplexity", ())] == pytest.approx(math.exp(metrics[("leanhive_eval_loss", ())]))
        assert metrics[("leanhive_eval_loss", ())] < math.log(4096)  # the model learnt something

        check_dashboard_matches_metrics(url, tmp_path)
        screenshot(url + "/", tmp_path / "chromium-shot", ARTIFACTS / "dashboard_swarm.png")

        wait_for(lambda: len(checkpoint_dirs(tmp_path)) >= 2, timeout=60, what="two checkpoints")
        newest = checkpoint_dirs(tmp_path)[-1]  # rotation removes the oldest ones, never this one this soon
        path = tmp_path / "ckpt" / newest
        model = LeanGPTForCausalLM.from_pretrained(path)
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert json.loads((path / MANIFEST).read_text())["epoch"] == int(newest.split("_")[1])

        # each new checkpoint is continued from the fixed prompt in a background thread; the page shows it
        sample = wait_for(lambda: api_state(url).get("sample"), timeout=60, what="a sample from a checkpoint")
        assert sample["prompt"] == "The" and sample["epoch"] > 0 and isinstance(sample["text"], str)
        dom = DashboardDom(dump_dom(url + "/", tmp_path / "chromium-sample"))
        assert dom.text("sample-prompt") == "The" and int(dom.value("sample-epoch")) >= sample["epoch"]
        assert json.loads((path / MANIFEST).read_text())["run"]["run_id"] == RUN_ID  # the run's facts, for exports

        # ---------------------------------------------------------------- 2. all trainers die; a new one joins
        state = api_state(url)
        old_peers = {p["peer"] for p in state["swarm"]["peers"]}
        last_loss = min(e["loss"] for e in state["swarm"]["epochs"][-2:] if e["loss"] is not None)
        for trainer in trainers:
            trainer.kill()
        checkpointed = api_state(url)["checkpoint"]["epoch"]

        newcomer = start_trainer(
            tmp_path, "trainer3", RUN_ID, initial_peers=addrs, extra=["--backup_every_epochs", "1"]
        )
        procs.append(newcomer)
        label, epoch, loss = wait_for(
            lambda: peer_report(url, old_peers), timeout=120, what="the new trainer's first metrics"
        )
        assert epoch >= checkpointed > 0, "the new trainer started from scratch instead of the checkpoint"
        assert abs(loss - last_loss) < abs(loss - first_loss), (
            f"new trainer's loss {loss:.3f} is not near where training stopped "
            f"({last_loss:.3f}; start {first_loss:.3f})"
        )

        # an aux checkpoint taken from the new trainer equals that trainer's own parameters at that epoch
        backups = {}

        def matching_checkpoint():
            watch_backups(tmp_path / "trainer3" / "backup.pt", backups)
            for name in checkpoint_dirs(tmp_path):
                epoch_ = int(name.split("_")[1].split(".")[0])
                if epoch_ > checkpointed and epoch_ in backups:
                    return name, epoch_
            return None

        name, epoch = wait_for(
            matching_checkpoint,
            timeout=120,
            interval=0.2,
            what="an aux checkpoint at an epoch the new trainer backed up",
        )
        # the crashed trainers' records name an epoch no donor serves any more (they outlive their peers by a
        # minute): a state is downloaded once, not again before each step (the newcomer did, 166 times in 41 s) or
        # at each refresh for a checkpoint (the aux did)
        assert newcomer.log().count("Downloaded the state") <= 2, newcomer.tail(20)
        loads = len(aux.events.all("state_loaded"))
        assert loads <= len(aux.events.all("checkpoint_saved")) + 4, f"{loads} downloads for the checkpoints"
        saved = LeanGPTForCausalLM.from_pretrained(tmp_path / "ckpt" / name).state_dict()
        trainer_params = backups[epoch]
        assert saved.keys() == trainer_params.keys()
        for key, tensor in trainer_params.items():
            assert torch.equal(saved[key], tensor), f"checkpoint {name} differs from the trainer in {key}"

        # ---------------------------------------------------------------- 3. corrupt newest, restart aux with --resume
        newcomer.kill()
        aux.stop()
        before = checkpoint_dirs(tmp_path)
        newest, previous = tmp_path / "ckpt" / before[-1], tmp_path / "ckpt" / before[-2]
        weights = newest / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        previous_epoch = json.loads((previous / MANIFEST).read_text())["epoch"]
        previous_loss = json.loads((previous / MANIFEST).read_text())["loss"]

        aux2 = start_aux("aux_resumed", tmp_path, port, "--resume")
        procs.append(aux2)
        aux2.events.wait(
            "state_loaded",
            timeout=120,
            where=lambda e: e["source"] == "checkpoint" and e["reason"] == "resume" and Path(e["path"]) == previous,
        )
        aux2.events.wait("serving", timeout=60)
        log = aux2.log()
        assert f"Checkpoint {newest} is corrupt" in log
        assert checkpoint_dirs(tmp_path) == before, "a checkpoint was deleted"

        joiner = start_trainer(tmp_path, "trainer4", RUN_ID, initial_peers=aux2.initial_peers(timeout=120))
        procs.append(joiner)
        _, epoch, loss = wait_for(
            lambda: peer_report(url, set()),
            timeout=120,
            what="the trainer that joined the resumed aux to publish metrics",
        )
        assert epoch >= previous_epoch > 0
        assert abs(loss - previous_loss) < abs(loss - first_loss)
        assert newest.name in checkpoint_dirs(tmp_path), "the damaged checkpoint must be left for inspection"
