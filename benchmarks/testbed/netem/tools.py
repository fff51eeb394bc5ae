"""Small TCP probes that run inside test hosts, to check what the emulated links do.

CLI (each runs inside a host via ``host.python("-m", "benchmarks.testbed.netem.tools", ...)``):

- ``echo --listen IP:PORT``: echo server, runs until killed.
- ``client --connect IP:PORT --timeout S``: one stdin line ``ping`` = one 64-byte round trip over a
  kept-open connection (reconnecting after any error); replies ``{"ok", "rtt_ms", "connected"}`` or
  ``{"ok": false, "error"}``. ``stream N`` sends N numbered small writes and replies
  ``{"ok", "in_order"}`` (whether the echo came back intact).
- ``sink --listen IP:PORT`` / ``source --connect IP:PORT --bytes N``: bulk transfer; the sink replies
  ``{"bytes", "seconds", "mbit_s"}`` measured from first to last byte.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Dict, Optional, Tuple

from benchmarks.testbed.netem.channel import JsonLinesProcess, reply
from benchmarks.testbed.netem.proxy import parse_address

if TYPE_CHECKING:
    from benchmarks.testbed.netem.hosts import Host

MODULE = "benchmarks.testbed.netem.tools"
PING = b"p" * 63 + b"\n"


def _listener(addr: Tuple[str, int]) -> socket.socket:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(addr)
    server.listen(64)
    return server


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("connection closed by the other side")
        data += chunk
    return data


def run_echo(addr: Tuple[str, int]) -> None:
    import socketserver

    class Echo(socketserver.BaseRequestHandler):
        def handle(self):
            try:
                while data := self.request.recv(65536):
                    self.request.sendall(data)
            except OSError:
                pass

    socketserver.ThreadingTCPServer.allow_reuse_address = True
    socketserver.ThreadingTCPServer.daemon_threads = True
    with socketserver.ThreadingTCPServer(addr, Echo) as server:
        reply({"listening": server.server_address[1]})
        server.serve_forever()


def _stream(sock: socket.socket, count: int) -> bool:
    """Send ``count`` numbered lines as separate small writes; True if they come back intact and in order."""
    sent = b"".join(b"%08d\n" % i for i in range(count))
    for i in range(count):
        sock.sendall(sent[9 * i : 9 * (i + 1)])
        time.sleep(0.001)  # separate chunks, so the proxy delays each one independently
    return _recv_exactly(sock, len(sent)) == sent


def run_client(addr: Tuple[str, int], timeout: float) -> None:
    sock: Optional[socket.socket] = None
    for command in sys.stdin:
        name, *args = command.split()
        if name not in ("ping", "stream"):
            reply({"ok": False, "error": f"unknown command {name!r}; send 'ping' or 'stream N'"})
            continue
        connected = False
        try:
            if sock is None:
                sock = socket.create_connection(addr, timeout=timeout)
                connected = True
            sock.settimeout(timeout)
            start = time.perf_counter()
            if name == "stream":
                reply({"ok": True, "in_order": _stream(sock, int(args[0])), "connected": connected})
                continue
            sock.sendall(PING)
            _recv_exactly(sock, len(PING))
            reply({"ok": True, "rtt_ms": (time.perf_counter() - start) * 1000, "connected": connected})
        except OSError as e:  # includes timeouts and resets
            reply({"ok": False, "error": repr(e), "connected": connected})
            if sock is not None:
                sock.close()
            sock = None


def run_sink(addr: Tuple[str, int]) -> None:
    with _listener(addr) as server:
        reply({"listening": server.getsockname()[1]})
        conn, _ = server.accept()
        with conn:
            total, first, last = 0, None, None
            while chunk := conn.recv(1 << 20):
                last = time.perf_counter()
                first = first or last
                total += len(chunk)
    seconds = (last - first) if first else 0.0
    reply({"bytes": total, "seconds": seconds, "mbit_s": total * 8 / seconds / 1e6 if seconds else None})


def run_source(addr: Tuple[str, int], nbytes: int) -> None:
    with socket.create_connection(addr, timeout=30) as sock:
        block = b"x" * (1 << 16)
        sent = 0
        while sent < nbytes:
            sent += sock.send(block[: nbytes - sent])
    reply({"sent": sent})


# ---- test-side wrappers ----


def _start(host: "Host", *args: str) -> JsonLinesProcess:
    proc = host.python("-m", MODULE, *args, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    return JsonLinesProcess(proc, name=f"{args[0]} on {host.name}")


def start_echo_server(host: "Host", port: int, timeout: float = 10.0) -> JsonLinesProcess:
    """Echo server on ``host.ip:port``; returns once it listens."""
    server = _start(host, "echo", "--listen", f"{host.ip}:{port}")
    server.read(timeout)
    return server


class EchoClient:
    """A long-lived echo client on one host; :meth:`ping` is one round trip (or the error)."""

    def __init__(self, host: "Host", address: str, timeout: float = 1.0):
        self.timeout = timeout
        self.channel = _start(host, "client", "--connect", address, "--timeout", str(timeout))

    def ping(self) -> Dict:
        # connect and round trip may each take `timeout`; the rest is process start-up slack
        return self.channel.request("ping", timeout=2 * self.timeout + 10)

    def stream(self, count: int) -> bool:
        """Send ``count`` small numbered writes; True if the echo returns them intact and in order."""
        response = self.channel.request(f"stream {count}", timeout=self.timeout + 10 + count * 0.01)
        if not response["ok"]:
            raise ConnectionError(f"stream through {self.channel.name} failed: {response['error']}")
        return response["in_order"]

    def close(self) -> None:
        self.channel.close()


def measure_throughput(
    sender: "Host",
    receiver: "Host",
    nbytes: int,
    port: int = 45000,
    timeout: float = 30.0,
    connect_to: Optional[str] = None,
) -> Dict:
    """Send ``nbytes`` from ``sender`` to a sink on ``receiver.ip:port`` over TCP (through ``connect_to``,
    e.g. a proxy's address, if given); returns the sink's measurement."""
    sink = _start(receiver, "sink", "--listen", f"{receiver.ip}:{port}")
    try:
        sink.read(timeout)
        source = _start(sender, "source", "--connect", connect_to or f"{receiver.ip}:{port}", "--bytes", str(nbytes))
        try:
            return sink.read(timeout)
        finally:
            source.close()
    finally:
        sink.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="TCP probes for netem test hosts")
    sub = parser.add_subparsers(dest="tool", required=True)
    sub.add_parser("echo").add_argument("--listen", type=parse_address, required=True)
    client = sub.add_parser("client")
    client.add_argument("--connect", type=parse_address, required=True)
    client.add_argument("--timeout", type=float, default=1.0)
    sub.add_parser("sink").add_argument("--listen", type=parse_address, required=True)
    source = sub.add_parser("source")
    source.add_argument("--connect", type=parse_address, required=True)
    source.add_argument("--bytes", type=int, required=True)
    args = parser.parse_args()
    if args.tool == "echo":
        run_echo(args.listen)
    elif args.tool == "client":
        run_client(args.connect, args.timeout)
    elif args.tool == "sink":
        run_sink(args.listen)
    else:
        run_source(args.connect, args.bytes)


if __name__ == "__main__":
    main()
