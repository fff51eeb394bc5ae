"""The aux peer's HTTP endpoint: ``/metrics`` (Prometheus), ``/`` (dashboard), ``/api/state`` (JSON)."""

from __future__ import annotations

import contextlib
import dataclasses
import html
import io
import json
import logging
import selectors
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from aux_monitor.dashboard_page import PAGE
from aux_monitor.exporter import make_registry, render_metrics
from aux_monitor.state import MonitorState
from peer.swarm.events import json_safe

logger = logging.getLogger(__name__)

# Bounds that keep the server answering however many clients misbehave (see MonitorServer)
READ_TIMEOUT = 5.0  # seconds a client has, from connecting, to send its whole request
WRITE_TIMEOUT = 10.0  # seconds a response may take to be accepted by the client
WORKERS = 4  # threads that answer complete requests
MAX_CONNECTIONS = 256  # open connections at most; beyond it the oldest unfinished one is dropped
MAX_REQUEST_BYTES = 16 * 1024  # a GET without a body is far smaller


def state_to_json(state: MonitorState) -> dict:
    """A JSON-safe dict of the state (NaN and infinities become null, which JSON.parse accepts)."""
    return json_safe(dataclasses.asdict(state))


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


class _Pending:
    """A connection whose request has not fully arrived yet."""

    __slots__ = ("buffer", "deadline")

    def __init__(self, deadline: float):
        self.buffer = bytearray()
        self.deadline = deadline


class MonitorServer:
    """Serves a MonitorApp in a background thread; ``port=0`` picks a free port (see ``.port``).

    Built so that idle, slow or numerous clients cannot take it down: one thread reads requests from every
    connection without blocking, and a connection that has not sent its whole request ``read_timeout`` seconds
    after connecting is closed; only complete requests go to a fixed pool of ``workers`` threads (a response is
    small and written with a ``write_timeout``); at most ``max_connections`` are open at once, the oldest
    unfinished one is dropped for a new one. A Prometheus scrape or a dashboard refresh sends its request at
    once, so it is answered while thousands of idle connections come and go.
    """

    def __init__(
        self,
        app: MonitorApp,
        *,
        host: str,
        port: int,
        workers: Optional[int] = None,
        read_timeout: Optional[float] = None,
        write_timeout: Optional[float] = None,
        max_connections: Optional[int] = None,
    ):
        self._app = app
        self.workers = workers or WORKERS
        self.read_timeout = read_timeout or READ_TIMEOUT
        self.write_timeout = write_timeout or WRITE_TIMEOUT
        self.max_connections = max_connections or MAX_CONNECTIONS
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._listener = socket.create_server((host, port), family=family, backlog=128)
        except OSError as e:
            raise OSError(
                f"cannot serve metrics on {host}:{port} ({e.strerror}); pick a free port with "
                "--metrics_port (0 picks one) or stop the process using it"
            ) from None
        self._listener.setblocking(False)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._pending: Dict[socket.socket, _Pending] = {}
        self._busy = 0  # connections handed to the pool and not closed yet
        self._busy_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="aux-http-worker")
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "MonitorServer":
        self._thread = threading.Thread(target=self._loop, name="aux-http", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=True, cancel_futures=True)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    @property
    def open_connections(self) -> int:
        return len(self._pending) + self._busy

    # ------------------------------------------------------------------ the reading thread
    def _loop(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ, "accept")
        selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while not self._stop.is_set():
                for key, _ in selector.select(timeout=self._select_timeout()):
                    if key.data == "accept":
                        self._accept(selector)
                    elif key.data == "read":
                        self._read(selector, key.fileobj)
                self._expire(selector)
        except Exception:  # never expected; without this thread nothing is served, so say so loudly
            logger.exception("The HTTP server stopped; /metrics and the dashboard are no longer served")
        finally:
            for sock in list(self._pending):
                self._drop(selector, sock)
            selector.close()

    def _select_timeout(self) -> float:
        if not self._pending:
            return 1.0
        earliest = min(p.deadline for p in self._pending.values())
        return min(max(earliest - time.monotonic(), 0.0), 1.0)

    def _accept(self, selector) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. out of file descriptors: the idle ones expire, try again then
                logger.warning("Cannot accept an HTTP connection (%s)", e)
                return
            if self.open_connections >= self.max_connections:
                if not self._pending:  # every slot is a request being answered: this one waits for none
                    sock.close()
                    continue
                oldest = min(self._pending, key=lambda s: self._pending[s].deadline)
                logger.debug("Too many open HTTP connections: dropping the oldest unfinished one")
                self._drop(selector, oldest)
            sock.setblocking(False)
            self._pending[sock] = _Pending(time.monotonic() + self.read_timeout)
            selector.register(sock, selectors.EVENT_READ, "read")

    def _read(self, selector, sock: socket.socket) -> None:
        pending = self._pending.get(sock)
        if pending is None:
            return
        try:
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(selector, sock)
            return
        pending.buffer += data
        complete = b"\r\n\r\n" in pending.buffer or b"\n\n" in pending.buffer
        if complete or len(pending.buffer) > MAX_REQUEST_BYTES:
            selector.unregister(sock)
            del self._pending[sock]
            with self._busy_lock:
                self._busy += 1
            self._pool.submit(self._serve, sock, bytes(pending.buffer), complete)

    def _expire(self, selector) -> None:
        now = time.monotonic()
        for sock in [s for s, p in self._pending.items() if p.deadline <= now]:
            logger.debug("Closing an HTTP connection that sent no complete request in %.0f s", self.read_timeout)
            self._drop(selector, sock)

    def _drop(self, selector, sock: socket.socket) -> None:
        self._pending.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(sock)
        sock.close()

    # ------------------------------------------------------------------ the workers
    def _serve(self, sock: socket.socket, raw: bytes, complete: bool) -> None:
        try:
            sock.setblocking(True)
            sock.settimeout(self.write_timeout)  # a client that does not read its response is given up on
            sock.sendall(self._response(raw, complete))
        except OSError as e:
            logger.debug("HTTP response not delivered: %s", e)
        finally:
            sock.close()
            with self._busy_lock:
                self._busy -= 1

    def _response(self, raw: bytes, complete: bool) -> bytes:
        if not complete:
            return _plain("431 Request Header Fields Too Large", b"request too large\n")
        parts = raw.split(b"\n", 1)[0].decode("latin-1").strip().split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _plain("400 Bad Request", b"bad request\n")
        method, target, protocol = parts
        if method not in ("GET", "HEAD"):
            return _plain("405 Method Not Allowed", b"only GET and HEAD are served\n", [("Allow", "GET, HEAD")])
        path, _, query = target.partition("?")
        environ = {
            "REQUEST_METHOD": method,
            "PATH_INFO": urllib.parse.unquote(path, encoding="latin-1"),
            "QUERY_STRING": query,
            "SERVER_NAME": self.host,
            "SERVER_PORT": str(self.port),
            "SERVER_PROTOCOL": protocol,
            "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(),
            "wsgi.errors": io.StringIO(),
        }
        started: List = []

        def start_response(status, headers, exc_info=None):
            started[:] = [status, headers]

        try:
            body = b"".join(self._app(environ, start_response))
        except Exception:
            logger.exception("The HTTP handler for %s failed", path)
            return _plain("500 Internal Server Error", b"internal error; see the aux peer's log\n")
        status, headers = started
        return _head(status, headers) + (b"" if method == "HEAD" else body)


def _head(status: str, headers: List[Tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers), "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1")


def _plain(status: str, body: bytes, extra: Sequence[Tuple[str, str]] = ()) -> bytes:
    headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))), *extra]
    return _head(status, headers) + body
