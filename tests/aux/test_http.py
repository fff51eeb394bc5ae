"""Idle, slow or numerous HTTP clients cannot exhaust the aux peer's dashboard/metrics server."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

import aux_monitor.server as server_module
from aux_monitor.server import MonitorApp, MonitorServer
from tests.aux.test_dashboard import sample_state

READ_TIMEOUT = 1.0


@pytest.fixture
def server(monkeypatch):
    from aux_monitor.state import StateHolder

    # a short read timeout keeps the test short; the server reads the module's bound when built without one
    monkeypatch.setattr(server_module, "READ_TIMEOUT", READ_TIMEOUT, raising=False)
    holder = StateHolder(sample_state())
    srv = MonitorServer(MonitorApp(holder.get, refresh_seconds=1), host="127.0.0.1", port=0).start()
    yield srv
    srv.shutdown()


def _scrape(srv, path="/metrics", timeout=2.0) -> tuple:
    started = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}{path}", timeout=timeout) as response:
        body = response.read()
        return response.status, body, time.monotonic() - started


def _connect(srv, send: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    if send:
        sock.sendall(send)
    return sock


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.timeout(60)
def test_idle_and_slow_connections_neither_starve_scrapes_nor_pile_up_threads(server):
    threads_before = threading.active_count()
    idle = [_connect(server) for _ in range(150)]
    slow = [_connect(server, b"GET /metrics HTTP/1.1\r\nHost: x\r\n") for _ in range(50)]  # never finished
    try:
        time.sleep(0.3)
        for _ in range(5):  # a scrape is answered at once, every time
            status, body, took = _scrape(server)
            assert status == 200 and b"leanhive" in body and took < 1.0
        status, body, _ = _scrape(server, "/api/state")
        assert status == 200 and b"demo" in body
        # the clients do not hold a thread each: the server's threads are a fixed pool
        assert threading.active_count() - threads_before <= 8
        # and they are disconnected once their read timeout has passed
        assert all(_closed_by_server(s, READ_TIMEOUT + 3) for s in slow[:5] + idle[:5])
    finally:
        for sock in idle + slow:
            sock.close()


@pytest.mark.timeout(60)
def test_more_connections_than_the_limit_drop_the_oldest_unfinished_ones(monkeypatch):
    from aux_monitor.state import StateHolder

    monkeypatch.setattr(server_module, "MAX_CONNECTIONS", 20, raising=False)
    monkeypatch.setattr(server_module, "READ_TIMEOUT", 30.0, raising=False)
    holder = StateHolder(sample_state())
    srv = MonitorServer(MonitorApp(holder.get, refresh_seconds=1), host="127.0.0.1", port=0).start()
    try:
        socks = [_connect(srv) for _ in range(60)]
        time.sleep(0.3)
        assert _closed_by_server(socks[0], 2)  # the oldest made room long before its read timeout
        assert srv.open_connections <= 20
        status, _, took = _scrape(srv)
        assert status == 200 and took < 1.0
        for sock in socks:
            sock.close()
    finally:
        srv.shutdown()


def test_requests_other_than_get_are_refused_cleanly(server):
    for raw, code in (
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", b"405"),
        (b"garbage\r\n\r\n", b"400"),
        (b"GET /" + b"a" * (20 * 1024), b"431"),
    ):
        sock = _connect(server, raw)
        try:
            reply = sock.recv(4096)
        finally:
            sock.close()
        assert reply.split(b" ")[1] == code, reply[:80]
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}/metrics", method="HEAD")
    with urllib.request.urlopen(req, timeout=2) as response:
        assert response.status == 200 and response.read() == b""


@pytest.mark.timeout(30)
def test_a_client_trickling_its_request_is_closed_at_its_deadline(server):
    """Sending a byte now and then keeps a connection active, not open: the whole request has READ_TIMEOUT."""
    sock = _connect(server, b"G")
    started = time.monotonic()
    try:
        for byte in b"ET /metrics HTTP/1.1\r\nHost: x\r\n":
            time.sleep(0.2)
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            if time.monotonic() - started > READ_TIMEOUT + 2:
                break
        assert _closed_by_server(sock, 2)
        assert time.monotonic() - started < READ_TIMEOUT + 2
    finally:
        sock.close()


def test_a_taken_port_is_reported_with_the_fix_and_shutdown_frees_everything():
    from aux_monitor.state import StateHolder

    threads_before = threading.active_count()
    holder = StateHolder(sample_state())
    srv = MonitorServer(MonitorApp(holder.get, refresh_seconds=1), host="127.0.0.1", port=0).start()
    idle = _connect(srv)
    with pytest.raises(OSError, match="pick a free port with --metrics_port"):
        MonitorServer(MonitorApp(holder.get, refresh_seconds=1), host="127.0.0.1", port=srv.port)
    srv.shutdown()
    assert _closed_by_server(idle, 2)  # open connections are closed, not left to their timeout
    idle.close()
    assert threading.active_count() <= threads_before  # the loop and the workers have ended
    # the port is free again
    again = MonitorServer(MonitorApp(holder.get, refresh_seconds=1), host="127.0.0.1", port=srv.port).start()
    assert _scrape(again)[0] == 200
    again.shutdown()


def test_a_failing_handler_answers_500_and_logs(caplog):
    def broken_state():
        raise RuntimeError("boom")

    srv = MonitorServer(MonitorApp(broken_state, refresh_seconds=1), host="127.0.0.1", port=0).start()
    try:
        with pytest.raises(urllib.error.HTTPError) as error:
            _scrape(srv, "/api/state")
        assert error.value.code == 500 and b"aux peer's log" in error.value.read()
        assert "The HTTP handler for /api/state failed" in caplog.text
    finally:
        srv.shutdown()
