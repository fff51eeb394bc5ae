"""The aux peer's HTTP endpoint: ``/metrics`` (Prometheus), ``/`` (dashboard), ``/api/state`` (JSON)."""

from __future__ import annotations

import dataclasses
import html
import json
import logging
import math
import socketserver
import threading
from typing import Any, Callable, Iterable, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from aux_monitor.dashboard_page import PAGE
from aux_monitor.exporter import make_registry, render_metrics
from aux_monitor.state import MonitorState

logger = logging.getLogger(__name__)


def state_to_json(state: MonitorState) -> dict:
    """A JSON-safe dict of the state (NaN and infinities become null, which JSON.parse accepts)."""
    return _json_safe(dataclasses.asdict(state))


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def render_dashboard(state: MonitorState, refresh_seconds: float) -> str:
    # "<" is escaped so that no value can close the <script> element the JSON sits in
    initial = json.dumps(state_to_json(state)).replace("<", "\\u003c")
    return (
        PAGE.replace("__INITIAL_STATE__", initial)
        .replace("__REFRESH__", f"{refresh_seconds:g}")
        .replace("__RUN_ID__", html.escape(state.run_id))
        .replace("__INITIAL_PEERS__", html.escape(state.initial_peers))
    )


class MonitorApp:
    """WSGI application serving the three routes from a state getter."""

    def __init__(self, get_state: Callable[[], MonitorState], refresh_seconds: float):
        self._get_state = get_state
        self._registry = make_registry(get_state)
        self._refresh_seconds = refresh_seconds

    def __call__(self, environ, start_response) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return _respond(start_response, "200 OK", CONTENT_TYPE_LATEST, render_metrics(self._registry))
        if path in ("/", "/index.html"):
            page = render_dashboard(self._get_state(), self._refresh_seconds)
            return _respond(start_response, "200 OK", "text/html; charset=utf-8", page.encode())
        if path == "/api/state":
            body = json.dumps(state_to_json(self._get_state())).encode()
            return _respond(start_response, "200 OK", "application/json", body)
        return _respond(
            start_response, "404 Not Found", "text/plain; charset=utf-8", b"not found; try /, /metrics or /api/state\n"
        )


def _respond(start_response, status: str, content_type: str, body: bytes) -> Iterable[bytes]:
    start_response(
        status, [("Content-Type", content_type), ("Content-Length", str(len(body))), ("Cache-Control", "no-store")]
    )
    return [body]


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - signature from http.server
        logger.debug("%s %s", self.address_string(), format % args)


class MonitorServer:
    """Serves a MonitorApp in a background thread; ``port=0`` picks a free port (see ``.port``)."""

    def __init__(self, app: MonitorApp, *, host: str, port: int):
        try:
            self._server = make_server(host, port, app, server_class=_ThreadingWSGIServer, handler_class=_QuietHandler)
        except OSError as e:
            raise OSError(
                f"cannot serve metrics on {host}:{port} ({e.strerror}); pick a free port with "
                "--metrics_port (0 picks one) or stop the process using it"
            ) from None
        self.host, self.port = host, self._server.server_port
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "MonitorServer":
        self._thread = threading.Thread(target=self._server.serve_forever, name="aux-http", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
