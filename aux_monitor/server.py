"""The aux peer's HTTP endpoint: ``/metrics`` (Prometheus), ``/`` (dashboard), ``/api/state`` (JSON).

``MonitorApp`` is a WSGI application; ``MonitorServer`` serves it with waitress in a background thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import html
import json
import logging
import socket
import threading
from importlib import resources
from typing import Callable, Iterable, Optional, Sequence, Tuple

from prometheus_client.exposition import CONTENT_TYPE_LATEST
from waitress import wasyncore
from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer

from aux_monitor.exporter import make_registry, render_metrics
from aux_monitor.state import MonitorState
from peer.swarm.events import json_safe

logger = logging.getLogger(__name__)

# Bounds that keep the server answering however many clients misbehave (see MonitorServer)
READ_TIMEOUT = 5.0  # seconds a client has, from connecting (or its previous response), to send its whole request
WORKERS = 4  # threads that answer complete requests
MAX_CONNECTIONS = 256  # open connections at most; beyond it the oldest unfinished one is dropped
MAX_REQUEST_BYTES = 16 * 1024  # a GET without a body is far smaller


def state_to_json(state: MonitorState) -> dict:
    """A JSON-safe dict of the state (NaN and infinities become null, which JSON.parse accepts)."""
    return json_safe(dataclasses.asdict(state))


@functools.lru_cache(maxsize=1)
def dashboard_template() -> str:
    """The dashboard page (package data ``aux_monitor/static/dashboard.html``; its comment says what it holds)."""
    return (resources.files("aux_monitor") / "static" / "dashboard.html").read_text(encoding="utf-8")


def render_dashboard(state: MonitorState, refresh_seconds: float) -> str:
    # "<" is escaped so that no value can close the <script> element the JSON sits in
    initial = json.dumps(state_to_json(state)).replace("<", "\\u003c")
    return (
        dashboard_template()
        .replace("__INITIAL_STATE__", initial)
        .replace("__REFRESH__", f"{refresh_seconds:g}")
        .replace("__RUN_ID__", html.escape(state.run_id))
        .replace("__INITIAL_PEERS__", html.escape(state.initial_peers))
    )


class MonitorApp:
    """WSGI application serving the three routes from a state getter (GET and HEAD only)."""

    def __init__(self, get_state: Callable[[], MonitorState], refresh_seconds: float):
        self._get_state = get_state
        self._registry = make_registry(get_state)
        self._refresh_seconds = refresh_seconds

    def __call__(self, environ, start_response) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return _plain(
                start_response, "405 Method Not Allowed", b"only GET and HEAD are served\n", [("Allow", "GET, HEAD")]
            )
        path = environ.get("PATH_INFO", "/")
        try:
            return self._route(path, start_response)
        except Exception:
            logger.exception("The HTTP handler for %s failed", path)
            return _plain(start_response, "500 Internal Server Error", b"internal error; see the aux peer's log\n")

    def _route(self, path: str, start_response) -> Iterable[bytes]:
        if path == "/metrics":
            return _respond(start_response, "200 OK", CONTENT_TYPE_LATEST, render_metrics(self._registry))
        if path in ("/", "/index.html"):
            page = render_dashboard(self._get_state(), self._refresh_seconds)
            return _respond(start_response, "200 OK", "text/html; charset=utf-8", page.encode())
        if path == "/api/state":
            body = json.dumps(state_to_json(self._get_state())).encode()
            return _respond(start_response, "200 OK", "application/json", body)
        return _plain(start_response, "404 Not Found", b"not found; try /, /metrics or /api/state\n")


def _respond(start_response, status: str, content_type: str, body: bytes, extra: Sequence[Tuple[str, str]] = ()):
    headers = [("Content-Type", content_type), ("Content-Length", str(len(body))), ("Cache-Control", "no-store")]
    start_response(status, [*headers, *extra])
    return [body]


def _plain(start_response, status: str, body: bytes, extra: Sequence[Tuple[str, str]] = ()):
    return _respond(start_response, status, "text/plain; charset=utf-8", body, extra)


class MonitorServer:
    """Serves a MonitorApp with waitress in a background thread; ``port=0`` picks a free port (see ``.port``).

    Built so that idle, slow or numerous clients cannot take it down. How each bound maps onto waitress:

    - one thread (waitress' event loop) reads every connection without blocking, and only complete requests go to
      a fixed pool of ``workers`` threads (``threads``); a worker writes its small response into a buffer that the
      loop sends, so no worker ever waits on a client;
    - a connection quiet for ``read_timeout`` seconds (nothing sent, or a response not read) is closed
      (``channel_timeout``), and one whose request has not fully arrived ``read_timeout`` seconds after it began
      waiting for it (connected, or its previous response was sent) is closed too, however slowly it trickles
      bytes (``_BoundedWSGIServer.maintenance``); both are checked every ``read_timeout / 5`` seconds
      (``cleanup_interval``, ``asyncore_loop_timeout``);
    - at most ``max_connections`` are open at once: a new connection replaces the oldest unfinished one
      (``_BoundedWSGIServer.handle_accept``; waitress' own ``connection_limit`` would instead stop accepting, so a
      Prometheus scrape would wait behind idle connections); when every one is being answered, it is closed;
    - request headers are bounded (``max_request_header_size``: 431) and so are bodies, which no route reads
      (``max_request_body_size``: 413); a malformed request gets a 400, a method other than GET/HEAD a 405.

    A Prometheus scrape or a dashboard refresh sends its request at once, so it is answered while thousands of
    idle connections come and go.
    """

    def __init__(
        self,
        app: MonitorApp,
        *,
        host: str,
        port: int,
        workers: Optional[int] = None,
        read_timeout: Optional[float] = None,
        max_connections: Optional[int] = None,
    ):
        self.workers = workers or WORKERS
        self.read_timeout = read_timeout or READ_TIMEOUT
        self.max_connections = max_connections or MAX_CONNECTIONS
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            listener = socket.create_server((host, port), family=family, backlog=128)
        except OSError as e:
            raise OSError(
                f"cannot serve metrics on {host}:{port} ({e.strerror}); pick a free port with "
                "--metrics_port (0 picks one) or stop the process using it"
            ) from None
        self.host, self.port = host, listener.getsockname()[1]
        check_every = self.read_timeout / 5
        adjustments = Adjustments(
            sockets=[listener],
            threads=self.workers,
            channel_timeout=self.read_timeout,
            cleanup_interval=check_every,
            asyncore_loop_timeout=check_every,
            # above our own limit (+ the listener, waitress' wake-up pipe and the connection being accepted), so that
            # waitress keeps accepting and handle_accept can make room
            connection_limit=self.max_connections + 3,
            max_request_header_size=MAX_REQUEST_BYTES,
            max_request_body_size=MAX_REQUEST_BYTES,
            backlog=128,
            asyncore_use_poll=True,  # poll(), not select(): a process with many open files has descriptors >= 1024
            log_socket_errors=False,  # a client that went away is not worth a traceback
        )
        self._map: dict = {}  # waitress' socket map: the listener, its wake-up pipe and every connection
        self._server = _BoundedWSGIServer(
            app,
            map=self._map,
            _sock=listener,
            adj=adjustments,
            bind_socket=False,
            sockinfo=(listener.family, listener.type, listener.proto, listener.getsockname()),
            read_timeout=self.read_timeout,
            max_connections=self.max_connections,
        )
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "MonitorServer":
        self._thread = threading.Thread(target=self._run, name="aux-http", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._server.run()
        except Exception:  # never expected; without this thread nothing is served, so say so loudly
            logger.exception("The HTTP server stopped; /metrics and the dashboard are no longer served")

    def shutdown(self) -> None:
        """Close the listener and every connection (in the loop's own thread, which then ends), then the workers."""
        close_all = functools.partial(wasyncore.close_all, self._map)
        if self._thread is not None and self._thread.is_alive():
            self._server.trigger.pull_trigger(close_all)
            self._thread.join(timeout=5)
        else:
            close_all()
        self._server.task_dispatcher.shutdown(cancel_pending=True, timeout=5)

    @property
    def open_connections(self) -> int:
        return len(self._server.active_channels)


class _Channel(HTTPChannel):
    """waitress' connection, noting when it began waiting for its current request."""

    waiting_since = 0.0

    def handle_read(self):
        if self.request is None and not self.requests:  # these bytes start a new request
            self.waiting_since = self.last_activity  # when it connected, or its previous response was sent
        super().handle_read()


def _unfinished(channel: HTTPChannel) -> bool:
    """Still sending its request: nothing is being answered or sent on it."""
    return not channel.requests and not channel.total_outbufs_len


def _waiting_since(channel: _Channel) -> float:
    return channel.waiting_since if channel.request is not None else channel.last_activity


class _BoundedWSGIServer(TcpWSGIServer):
    """waitress' TCP server with a request deadline and room made for new connections (see MonitorServer).

    Extends waitress 3 (pinned below 4) through its server and channel attributes: ``maintenance``,
    ``handle_accept``, ``active_channels``, ``channel_class`` and a channel's ``request``, ``requests``,
    ``last_activity``, ``total_outbufs_len``, ``will_close``; tests/test_aux_http.py fails if one changes."""

    channel_class = _Channel

    def __init__(self, *args, read_timeout: float, max_connections: int, **kwargs):
        self.read_timeout, self.max_connections = read_timeout, max_connections
        super().__init__(*args, **kwargs)

    def maintenance(self, now: float) -> None:
        super().maintenance(now)  # quiet for channel_timeout seconds: closed
        for channel in list(self.active_channels.values()):
            if channel.request is not None and _unfinished(channel) and now - channel.waiting_since > self.read_timeout:
                logger.debug("Closing an HTTP connection that sent no complete request in %.0f s", self.read_timeout)
                channel.will_close = True

    def handle_accept(self) -> None:
        if len(self.active_channels) >= self.max_connections:
            unfinished = [channel for channel in self.active_channels.values() if _unfinished(channel)]
            if not unfinished:  # every slot is a request being answered: this one waits for none
                with contextlib.suppress(OSError):
                    accepted = self.accept()
                    if accepted is not None:
                        accepted[0].close()
                return
            logger.debug("Too many open HTTP connections: dropping the oldest unfinished one")
            min(unfinished, key=_waiting_since).handle_close()
        super().handle_accept()
