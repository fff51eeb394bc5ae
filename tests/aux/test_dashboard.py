"""The aux peer's HTTP endpoint alone: JSON API, /metrics, and the dashboard rendered by headless Chromium."""

import json

import pytest

from aux_monitor.aggregation import MetricsAggregator, SwarmSnapshot, peer_label
from aux_monitor.server import MonitorApp, MonitorServer, render_dashboard
from aux_monitor.state import CheckpointInfo, MonitorState, SampleText, StateHolder
from benchmarks.testbed.aux import ARTIFACTS, DashboardDom, dump_dom, http_get, scrape, screenshot
from peer.swarm.records import LocalMetrics

JOIN = "--initial_peers /ip4/127.0.0.1/tcp/4242/p2p/12D3KooWTestTestTest"
# generated text is shown as text, never parsed as HTML
SAMPLE = SampleText(
    epoch=2, prompt="The swarm", text=" learns <b>together</b> & fast", time=1_700_000_100.0, seconds=1.5
)


def sample_state() -> MonitorState:
    agg = MetricsAggregator(alive_window=60)
    for epoch in range(4):  # a falling loss over four epochs, two trainers
        records = {
            b"[owner:a]": LocalMetrics(
                epoch=epoch,
                loss=1.0 * (6 - epoch),  # records carry the mean micro-step loss
                mini_steps=4,
                samples_accumulated=32,
                samples_per_second=20.25,
                samples_total=32 * (epoch + 1),
                time=100.0 + epoch,
            ),
            b"[owner:b]": LocalMetrics(
                epoch=epoch,
                loss=1.0 * (6 - epoch),
                mini_steps=1,
                samples_accumulated=8,
                samples_per_second=5.5,
                samples_total=8 * (epoch + 1),
                time=100.5 + epoch,
            ),
        }
        snapshot = agg.update(records, now=101.0 + epoch)
    return MonitorState(
        run_id="demo<run>",
        initial_peers=JOIN,
        swarm=snapshot,
        checkpoint=CheckpointInfo(epoch=2, time=1_700_000_000.0, path="/data/ckpt/epoch_000002"),
        sample=SAMPLE,
    )


@pytest.fixture
def server():
    holder = StateHolder(sample_state())
    srv = MonitorServer(MonitorApp(holder.get, refresh_seconds=1), host="127.0.0.1", port=0).start()
    yield f"http://127.0.0.1:{srv.port}", holder
    srv.shutdown()


def test_json_endpoint(server):
    url, holder = server
    status, body = http_get(url + "/api/state")
    state = json.loads(body)
    assert status == 200
    assert state["run_id"] == "demo<run>" and state["initial_peers"] == JOIN
    swarm = state["swarm"]
    assert swarm["alive_peers"] == 2 and swarm["global_epoch"] == 3
    assert swarm["loss"] == pytest.approx((12.0 + 3.0) / 5)
    assert [e["epoch"] for e in swarm["epochs"]] == [0, 1, 2, 3]
    assert [p["peer"] for p in swarm["peers"]] == [peer_label(b"[owner:a]"), peer_label(b"[owner:b]")]
    assert state["checkpoint"]["path"] == "/data/ckpt/epoch_000002"
    assert state["evaluation"] is None
    assert state["sample"] == dict(epoch=2, prompt="The swarm", text=SAMPLE.text, time=SAMPLE.time, seconds=1.5)

    holder.update(swarm=SwarmSnapshot.empty(5.0), checkpoint=None)  # the endpoint follows the live state
    assert json.loads(http_get(url + "/api/state")[1])["swarm"]["loss"] is None


def test_unknown_path_is_404(server):
    status, body = http_get(server[0] + "/nope")
    assert status == 404 and "/metrics" in body


def test_page_is_self_contained_and_escapes_values():
    page = render_dashboard(sample_state(), refresh_seconds=5)
    assert "demo&lt;run&gt;" in page and "demo<run>" not in page.split("<script")[0]
    assert "http://" not in page.replace('"http://www.w3.org/2000/svg"', "")  # no network assets
    assert "https://" not in page
    assert "\\u003crun>" in page  # JSON inside <script> cannot close the element


def test_browser_shows_the_same_numbers_as_metrics(server, tmp_path):
    url, _ = server
    metrics = scrape(url + "/metrics")
    dom = DashboardDom(dump_dom(url + "/", tmp_path / "profile"))

    assert dom.body.get("data-rendered") == dom.value("updated")
    assert int(dom.body["data-generation"]) == metrics[("leanhive_monitor_updates_total", ())]
    assert float(dom.value("updated")) == metrics[("leanhive_last_refresh_timestamp_seconds", ())]
    assert int(dom.value("alive-peers")) == metrics[("leanhive_alive_peers", ())] == 2
    assert dom.text("alive-peers") == "2"
    assert int(dom.value("global-epoch")) == metrics[("leanhive_global_epoch", ())] == 3
    assert float(dom.value("loss")) == pytest.approx(metrics[("leanhive_loss", ())])
    assert dom.text("loss") == "3"  # 15 / 5, shown with up to 4 decimals
    assert float(dom.value("samples-per-second")) == pytest.approx(metrics[("leanhive_samples_per_second", ())])
    assert dom.text("samples-per-second") == "25.8"
    assert int(dom.value("samples-total")) == metrics[("leanhive_samples_total", ())] == 160
    assert int(dom.value("checkpoint-epoch")) == metrics[("leanhive_last_checkpoint_epoch", ())] == 2
    assert dom.text("checkpoint-time") == "2023-11-14 22:13:20 UTC"
    assert dom.text("checkpoint-path") == "/data/ckpt/epoch_000002"
    assert dom.text("initial-peers") == JOIN
    assert dom.text("sample-prompt") == "The swarm"
    assert dom.by_id["sample-text"]["_text"] == SAMPLE.text  # as text: no <b> element was created
    assert int(dom.value("sample-epoch")) == 2
    assert dom.text("sample-time") == "2023-11-14 22:15:00 UTC"

    shown = {row["data-peer"]: int(row["data-samples"]) for row in dom.rows}
    exported = {
        dict(labels)["peer"]: value
        for (name, labels), value in metrics.items()
        if name == "leanhive_peer_samples_total"
    }
    assert shown == exported and len(shown) == 2
    assert [row["data-peer"] for row in dom.rows] == [peer_label(b"[owner:a]"), peer_label(b"[owner:b]")]

    assert dom.by_id["loss-chart"]["data-points"] == "4"  # one point per epoch
    assert int(dom.by_id["peers-chart"]["data-points"]) >= 1
    screenshot(url + "/", tmp_path / "profile2", ARTIFACTS / "dashboard_static.png")
