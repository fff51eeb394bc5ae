"""Helpers for the aux-peer tests: headless Chromium, a real Prometheus server, HTTP and /metrics parsing.

Peer processes are started with the shared ``benchmarks.testbed.processes`` / ``benchmarks.testbed.trainers``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.testbed.processes import PeerProcess, kill_all
from benchmarks.testbed.trainers import events_path, tiny_model_config

# Screenshots for humans to look at: tests write only to temporary folders, never into the checkout
# (LEANHIVE_TEST_ARTIFACTS picks another folder, e.g. to keep them from a CI run).
ARTIFACTS = Path(os.environ.get("LEANHIVE_TEST_ARTIFACTS", Path(tempfile.gettempdir()) / "leanhive_test_artifacts"))

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10.0) -> Tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def scrape(url: str) -> Dict[Tuple[str, tuple], float]:
    """``/metrics`` as {(sample name, sorted label items): value}."""
    _, text = http_get(url)
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def wait_for(predicate, timeout: float, interval: float = 0.5, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# ------------------------------------------------------------------ aux peer in a swarm
RUN_ID = "auxtest"


def start_aux(name: str, folder: Path, port: int, *extra) -> PeerProcess:
    """An aux peer on the trainers' run preset (so collaboration/optimizer settings match theirs); its events go to
    folder/name.events.jsonl (``peer.events``)."""
    args = [
        "--config",
        "tiny",
        "--model_config",
        tiny_model_config(folder),
        "--run_id",
        RUN_ID,
        "--refresh_period",
        "1",
        "--alive_window",
        "15",
        "--metrics_host",
        "127.0.0.1",
        "--metrics_port",
        port,
        "--checkpoint_dir",
        folder / "ckpt",
        "--checkpoint_every",
        2,
        "--keep_checkpoints",
        3,
        *extra,
    ]
    return PeerProcess(
        args,
        name=name,
        log_path=folder / f"{name}.log",
        script="run_aux_peer.py",
        events_path=events_path(folder, name),
    ).start()


@contextlib.contextmanager
def swarm_processes():
    """A list to put peer processes in: their log tails are printed if the test fails; all are killed after."""
    procs: List[PeerProcess] = []
    try:
        yield procs
    except BaseException:
        for proc in procs:
            print(f"\n===== {proc.name} ({proc.log_path}) =====\n{proc.tail(60)}")
        raise
    finally:
        kill_all(procs)


def api_state(url: str) -> dict:
    return json.loads(http_get(url + "/api/state")[1])


def checkpoint_dirs(folder: Path) -> List[str]:
    root = folder / "ckpt"
    return sorted(p.name for p in root.iterdir() if p.name.startswith("epoch_")) if root.exists() else []


def peer_report(url: str, exclude: set, min_epoch: int = 0):
    """The first trainer not in ``exclude`` that has published metrics: (label, epoch, loss), or None."""
    for peer in api_state(url)["swarm"]["peers"]:
        if peer["peer"] not in exclude and peer["loss"] is not None and peer["epoch"] >= min_epoch:
            return peer["peer"], peer["epoch"], peer["loss"]
    return None


# ------------------------------------------------------------------ Chromium
def chromium_binary() -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.fail("chromium is not installed; run scripts/setup_env.sh --test (apt-get install chromium)")
    return binary


def chromium(url: str, user_data_dir: Path, *extra: str, timeout: float = 60.0) -> str:
    """Run headless Chromium on ``url`` with a fresh profile; returns stdout."""
    args = [chromium_binary(), *CHROMIUM_FLAGS, f"--user-data-dir={user_data_dir}", *extra, url]
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"chromium failed ({result.returncode}): {result.stderr[-2000:]}")
    return result.stdout


def dump_dom(url: str, user_data_dir: Path, window_size: str = "1280,1100") -> str:
    """The page's DOM after its scripts ran (virtual time lets fetches and timers settle), laid out in a window of
    ``window_size`` (width,height) pixels."""
    return chromium(url, user_data_dir, "--virtual-time-budget=3000", f"--window-size={window_size}", "--dump-dom")


def screenshot(url: str, user_data_dir: Path, path: Path, window_size: str = "1280,1100") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    chromium(url, user_data_dir, "--virtual-time-budget=3000", f"--window-size={window_size}", f"--screenshot={path}")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "chromium did not write a PNG"
    return path


class DashboardDom(HTMLParser):
    """Elements by id (attributes + text), leaderboard rows, trainers' health rows, and the point count of each
    chart."""

    def __init__(self, dom: str):
        super().__init__()
        self.by_id: Dict[str, dict] = {}
        self.rows: List[dict] = []  # the contributor leaderboard's
        self.health_rows: List[dict] = []  # the trainers' health table's
        self.tables: List[dict] = []
        self.body: dict = {}
        self._table: Optional[str] = None
        self._open: List[Optional[dict]] = []
        self.feed(dom)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        node = dict(attrs, _tag=tag, _text="")
        if tag == "body":
            self.body = node
        if "id" in attrs:
            self.by_id[attrs["id"]] = node
        if tag == "table":
            self._table = attrs.get("id")
            self.tables.append(node)
        if tag == "tr" and "data-peer" in attrs:
            (self.health_rows if self._table == "peer-health" else self.rows).append(node)
        if tag not in ("br", "meta", "link", "img", "input", "line", "polyline", "circle"):
            self._open.append(node)

    def handle_endtag(self, tag):
        if self._open:
            self._open.pop()

    def handle_data(self, data):
        for node in self._open:
            node["_text"] += data

    def value(self, element_id: str) -> str:
        return self.by_id[element_id]["data-value"]

    def text(self, element_id: str) -> str:
        return self.by_id[element_id]["_text"].strip()


# ------------------------------------------------------------------ Prometheus
class PrometheusServer:
    """A real Prometheus (Debian package) scraping ``targets`` every second, with throwaway storage."""

    def __init__(self, workdir: Path, targets: List[str], scrape_interval: str = "1s"):
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus is not installed; run scripts/setup_env.sh --test (apt-get install prometheus)")
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {scrape_interval}\n"
            f"  scrape_timeout: {scrape_interval}\n"
            "scrape_configs:\n"
            "  - job_name: leanhive_aux\n"
            f"    static_configs:\n      - targets: {json.dumps(targets)}\n"
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1h",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout: float = 60.0) -> None:
        def ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                return http_get(self.url + "/-/ready", timeout=2)[0] == 200
            except OSError:
                return False

        wait_for(ready, timeout, what="prometheus to be ready")

    def query_range(self, expr: str, seconds: float) -> List[Tuple[float, float]]:
        end = time.time()
        params = urllib.parse.urlencode(dict(query=expr, start=end - seconds, end=end, step="1s"))
        status, body = http_get(f"{self.url}/api/v1/query_range?{params}")
        data = json.loads(body)
        assert status == 200 and data["status"] == "success", body
        result = data["data"]["result"]
        return [(float(t), float(v)) for t, v in result[0]["values"]] if result else []

    def __enter__(self) -> "PrometheusServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
