"""User-space TCP proxy that emulates latency, jitter, loss and partitions (the kernel here has no netem).

Run it inside a test host::

    python -m benchmarks.testbed.netem.proxy --listen 10.213.7.2:0 --target 10.213.7.2:40000 --control /tmp/x.sock \
        --settings '{"delay_ms": 25}'

Link model, applied to every chunk of bytes ``recv()`` returns, independently in each direction:

- delay/jitter: a chunk is forwarded ``delay_ms + U(-jitter_ms, +jitter_ms)`` (clamped at 0) after it
  arrived, but never before the previous chunk of the same direction, so byte order is kept (large
  jitter therefore also bunches chunks, as a real FIFO link would).
- loss: TCP cannot lose bytes, so a "lost" segment shows up as a stall: with probability ``loss`` a
  chunk is held an extra ``loss_penalty_ms`` (a typical minimum retransmission timeout, 200 ms), and
  everything behind it waits too (head-of-line blocking, as after a real loss).
- partition: connections from a partitioned source IP (or all, with ``partition``) are reset at once;
  new ones are accepted and blackholed (data read and discarded, nothing forwarded: the peer sees a
  stalled handshake, as when packets vanish) until healed, when they are reset so the peer redials.
- bandwidth is NOT the proxy's job: tbf on the hosts' veths does it (see benchmarks.testbed.netem.hosts).

The proxy terminates TCP, so the emulated delay is invisible to the endpoints' congestion control
(no slow start over the long RTT); throughput is bounded by the link (tbf) and by
``max_buffer_bytes`` / delay per direction.

Control: a UNIX socket taking one JSON object per line; its keys update the settings
(``{"delay_ms": 50, "jitter_ms": 5, "loss": 0.01, "partition": true, "partitioned_sources": [ip]}``),
plus ``add_partitioned_sources`` / ``remove_partitioned_sources`` (lists of IPs) to edit the set
without a read-modify-write race. ``{}`` only asks for the status. Each request gets a JSON line:
``{"ok": true, "port": ..., "settings": {...}, "connections": n, "blackholed": n}`` or
``{"ok": false, "error": "..."}``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import random
import signal
import socket
import struct
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

if TYPE_CHECKING:
    from benchmarks.testbed.netem.hosts import Host

logger = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024


@dataclass
class ProxySettings:
    """Link emulation settings of one proxy; changeable at run time through the control socket."""

    delay_ms: float = 0.0
    """One-way delay added to each direction (RTT through the proxy grows by 2 * delay_ms)."""
    jitter_ms: float = 0.0
    """Each chunk's delay is drawn uniformly from delay_ms ± jitter_ms (clamped at 0), order kept."""
    loss: float = 0.0
    """Probability that a chunk is "lost", i.e. stalled an extra loss_penalty_ms (see module doc)."""
    loss_penalty_ms: float = 200.0
    """Stall of a lost chunk: the retransmission timeout a real TCP sender would wait."""
    partition: bool = False
    """Cut every connection through this proxy (the proxied host is partitioned)."""
    partitioned_sources: List[str] = field(default_factory=list)
    """Client IPs to cut off (those hosts are partitioned from the proxied host)."""
    max_buffer_bytes: int = 8 * 1024 * 1024
    """Bytes held per direction before the proxy stops reading (the emulated link's window)."""

    def __post_init__(self):
        for name in ("delay_ms", "jitter_ms", "loss_penalty_ms"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a number of milliseconds >= 0, got {value!r}")
        if not isinstance(self.loss, (int, float)) or not 0.0 <= self.loss <= 1.0:
            raise ValueError(f"loss must be a probability in [0, 1] (e.g. 0.01 for 1%), got {self.loss!r}")
        if not isinstance(self.partition, bool):
            raise ValueError(f"partition must be true or false, got {self.partition!r}")
        if not isinstance(self.partitioned_sources, (list, tuple)) or not all(
            isinstance(ip, str) for ip in self.partitioned_sources
        ):
            raise ValueError(f"partitioned_sources must be a list of IP strings, got {self.partitioned_sources!r}")
        self.partitioned_sources = sorted(set(self.partitioned_sources))
        if not isinstance(self.max_buffer_bytes, int) or self.max_buffer_bytes < CHUNK_BYTES:
            raise ValueError(f"max_buffer_bytes must be an int >= {CHUNK_BYTES}, got {self.max_buffer_bytes!r}")

    def updated(self, request: Dict[str, Any]) -> "ProxySettings":
        """A validated copy with the request's keys applied (see the module doc for the keys)."""
        request = dict(request)
        sources = set(request.pop("partitioned_sources", self.partitioned_sources))
        sources |= set(request.pop("add_partitioned_sources", []))
        sources -= set(request.pop("remove_partitioned_sources", []))
        known = {f.name for f in dataclasses.fields(self)}
        unknown = set(request) - known
        if unknown:
            raise ValueError(
                f"unknown setting(s) {sorted(unknown)}; valid keys: {sorted(known)} "
                "plus add_partitioned_sources / remove_partitioned_sources"
            )
        return dataclasses.replace(self, **request, partitioned_sources=sorted(sources))

    def is_cut(self, source_ip: str) -> bool:
        return self.partition or source_ip in self.partitioned_sources

    def chunk_delay(self) -> float:
        """Seconds to hold the next chunk (delay, jitter and a possible loss stall)."""
        delay_ms = max(0.0, self.delay_ms + random.uniform(-self.jitter_ms, self.jitter_ms))
        if self.loss and random.random() < self.loss:
            delay_ms += self.loss_penalty_ms
        return delay_ms / 1000


class _Connection:
    """One proxied client connection: two delayed pipes, torn down together."""

    def __init__(self, source_ip: str, client_writer: asyncio.StreamWriter):
        self.source_ip = source_ip
        self.client_writer = client_writer
        self.tasks: List[asyncio.Task] = []
        self.was_reset = False

    def reset(self) -> None:
        """Drop the client with an RST (SO_LINGER 0), so it notices at once, and stop forwarding."""
        if self.was_reset:
            return
        self.was_reset = True
        sock = self.client_writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.client_writer.transport.abort()
        for task in self.tasks:
            task.cancel()


class NetemProxy:
    """Forwards ``listen`` to ``target`` through delay lines; see the module docstring for the model."""

    def __init__(self, listen: Tuple[str, int], target: Tuple[str, int], settings: ProxySettings):
        self.listen, self.target, self.settings = listen, target, settings
        self.port: Optional[int] = None
        self.connections: Set[_Connection] = set()
        self.blackholed: Set[_Connection] = set()
        self._server: Optional[asyncio.AbstractServer] = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on_client, self.listen[0], self.listen[1])
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("proxy %s:%d -> %s:%d, %s", self.listen[0], self.port, *self.target, self.settings)

    async def close(self) -> None:
        for conn in list(self.connections | self.blackholed):
            conn.reset()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def apply(self, settings: ProxySettings) -> None:
        """Switch to new settings: reset connections that are now cut, release healed blackholes."""
        self.settings = settings
        for conn in list(self.connections):
            if settings.is_cut(conn.source_ip):
                logger.info("partition: resetting connection from %s", conn.source_ip)
                conn.reset()
        for conn in list(self.blackholed):
            if not settings.is_cut(conn.source_ip):
                conn.reset()  # the peer's stalled handshake fails now, and it redials into a healed link

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        source_ip = writer.get_extra_info("peername")[0]
        conn = _Connection(source_ip, writer)
        if self.settings.is_cut(source_ip):
            await self._blackhole(conn, reader)
            return
        try:
            target_reader, target_writer = await asyncio.open_connection(*self.target)
        except OSError as e:
            logger.warning("cannot reach target %s:%d: %r; resetting client %s", *self.target, e, source_ip)
            conn.reset()
            return
        self.connections.add(conn)
        conn.tasks = [
            asyncio.create_task(self._pipe(conn, reader, target_writer)),
            asyncio.create_task(self._pipe(conn, target_reader, writer)),
        ]
        try:
            await asyncio.gather(*conn.tasks, return_exceptions=True)
        finally:
            self.connections.discard(conn)
            for stream_writer in (writer, target_writer):
                if conn.was_reset:
                    stream_writer.transport.abort()
                else:
                    stream_writer.close()

    async def _blackhole(self, conn: _Connection, reader: asyncio.StreamReader) -> None:
        """Swallow what a cut-off client sends until it gives up or the partition heals."""
        self.blackholed.add(conn)
        reading = asyncio.create_task(self._discard(reader))
        conn.tasks = [reading]
        try:
            await asyncio.gather(reading, return_exceptions=True)
        finally:
            self.blackholed.discard(conn)
            conn.client_writer.transport.abort()

    @staticmethod
    async def _discard(reader: asyncio.StreamReader) -> None:
        try:
            while await reader.read(CHUNK_BYTES):
                pass
        except ConnectionError:
            pass

    async def _pipe(self, conn: _Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read chunks, stamp each with its release time, and write them out in order at that time.

        A clean EOF is passed on (after the delay) as a half-close; a reset on either side resets the
        whole connection, as a real TCP error would reach the other endpoint."""
        line: deque = deque()
        buffered = 0
        ready = asyncio.Event()  # line is non-empty
        space = asyncio.Event()  # buffered dropped below the limit
        space.set()
        last_release = 0.0
        loop = asyncio.get_running_loop()

        async def receive():
            nonlocal buffered, last_release
            while True:
                data = await reader.read(CHUNK_BYTES)
                last_release = max(loop.time() + self.settings.chunk_delay(), last_release)
                line.append((last_release, data))  # b"" (EOF) travels down the line too
                buffered += len(data)
                ready.set()
                if not data:
                    return
                if buffered >= self.settings.max_buffer_bytes:
                    space.clear()
                    await space.wait()

        receiver = asyncio.create_task(receive())
        receiver.add_done_callback(lambda task: task.cancelled() or task.exception() is None or conn.reset())
        try:
            while True:
                await ready.wait()
                release, data = line.popleft()
                if not line:
                    ready.clear()
                await asyncio.sleep(max(0.0, release - loop.time()))
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()  # half-close, like the original sender did
                    await writer.drain()
                    return
                writer.write(data)
                await writer.drain()
                buffered -= len(data)
                if buffered < self.settings.max_buffer_bytes:
                    space.set()
        except ConnectionError:
            conn.reset()
        finally:
            receiver.cancel()


class ControlServer:
    """UNIX-socket JSON-lines control of a :class:`NetemProxy` (see module docstring)."""

    def __init__(self, proxy: NetemProxy, path: Path):
        self.proxy, self.path = proxy, path

    async def start(self) -> asyncio.AbstractServer:
        if self.path.exists():
            self.path.unlink()
        return await asyncio.start_unix_server(self._on_client, path=str(self.path))

    def status(self) -> Dict[str, Any]:
        return {
            "ok": True,
            "port": self.proxy.port,
            "settings": dataclasses.asdict(self.proxy.settings),
            "connections": len(self.proxy.connections),
            "blackholed": len(self.proxy.blackholed),
        }

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                try:
                    request = json.loads(line)
                    if not isinstance(request, dict):
                        raise ValueError('a control request must be a JSON object, e.g. {"delay_ms": 50}')
                    if request:
                        self.proxy.apply(self.proxy.settings.updated(request))
                        logger.info("settings now %s", self.proxy.settings)
                    response = self.status()
                except (ValueError, TypeError) as e:
                    response = {"ok": False, "error": str(e)}
                writer.write(json.dumps(response).encode() + b"\n")
                await writer.drain()
        finally:
            writer.close()


def control_request(path: Path, request: Dict[str, Any], timeout: float = 5.0) -> Dict[str, Any]:
    """Send one JSON request to a proxy's control socket and return its JSON reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(json.dumps(request).encode() + b"\n")
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"proxy control socket {path} closed without a reply")
            reply += chunk
    response = json.loads(reply)
    if not response.get("ok"):
        raise ValueError(f"proxy rejected {request}: {response.get('error')}")
    return response


class ProxyHandle:
    """A proxy process running inside a test host, controlled from the test process."""

    def __init__(self, host: "Host", process: subprocess.Popen, control_path: Path, log_path: Path, port: int):
        self.host, self.process, self.control_path, self.log_path, self.port = (
            host,
            process,
            control_path,
            log_path,
            port,
        )

    @classmethod
    def launch(
        cls,
        host: "Host",
        *,
        listen: str,
        target: str,
        control_path: Path,
        settings: Optional[ProxySettings] = None,
        ready_timeout: float = 15.0,
    ) -> "ProxyHandle":
        """Start ``python -m benchmarks.testbed.netem.proxy`` in ``host`` and wait until its control socket answers."""
        settings = settings or ProxySettings()
        log_path = control_path.with_suffix(".log")
        with open(log_path, "wb") as log:
            process = host.python(
                "-m",
                "benchmarks.testbed.netem.proxy",
                "--listen",
                listen,
                "--target",
                target,
                "--control",
                str(control_path),
                "--settings",
                json.dumps(dataclasses.asdict(settings)),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + ready_timeout
        while True:
            try:
                status = control_request(control_path, {}, timeout=1.0)
                if status["port"]:
                    return cls(host, process, control_path, log_path, status["port"])
            except (OSError, ValueError):
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(
                    f"proxy on {host.name} did not start within {ready_timeout}s (rc={process.poll()}); "
                    f"log {log_path}:\n{log_path.read_text()[-2000:]}"
                )
            time.sleep(0.05)

    @property
    def address(self) -> str:
        """``ip:port`` clients should connect to."""
        return f"{self.host.ip}:{self.port}"

    @property
    def maddr(self) -> str:
        """The proxy as a multiaddr, for hivemind's ``announce_maddrs``."""
        return f"/ip4/{self.host.ip}/tcp/{self.port}"

    def peer_flags(self, target_port: int) -> List[str]:
        """The network flags of a peer listening on ``target_port`` of this proxy's host, reached through the proxy.
        Every host of a testbed is public by construction, but the dial-back probe cannot tell: a peer's inbound
        connections come through its own host's proxy, so a requester appears at the server's own IP, which is not
        among the addresses it announces, and an honest server refuses to dial those
        (peer.swarm.hivemind_seam.reachability). Without ``--reachability public`` every peer but the first comes up
        as a client."""
        return [
            "--host_maddrs",
            f"/ip4/{self.host.ip}/tcp/{target_port}",
            "--announce_maddrs",
            self.maddr,
            "--reachability",
            "public",
        ]

    def set(self, **settings) -> Dict[str, Any]:
        """Change settings (delay_ms=, jitter_ms=, loss=, loss_penalty_ms=, partition=,
        partitioned_sources=); returns the proxy's status."""
        return control_request(self.control_path, settings)

    def status(self) -> Dict[str, Any]:
        return control_request(self.control_path, {})

    def add_partitioned_source(self, ip: str) -> None:
        control_request(self.control_path, {"add_partitioned_sources": [ip]})

    def remove_partitioned_source(self, ip: str) -> None:
        control_request(self.control_path, {"remove_partitioned_sources": [ip]})

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for path in (self.control_path, self.log_path):
            path.unlink(missing_ok=True)


def parse_address(text: str) -> Tuple[str, int]:
    """``'10.213.1.2:4000'`` -> ``('10.213.1.2', 4000)``; argparse-friendly errors."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected IP:PORT such as 10.213.1.2:4000, got {text!r}")
    return host, int(port)


def _settings(text: str) -> ProxySettings:
    try:
        return ProxySettings(**json.loads(text))
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"--settings must be a JSON object of ProxySettings fields: {e}")


async def _serve(args: argparse.Namespace) -> None:
    proxy = NetemProxy(args.listen, args.target, args.settings)
    await proxy.start()
    control = await ControlServer(proxy, args.control).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    control.close()
    await proxy.close()
    args.control.unlink(missing_ok=True)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=parse_address, required=True, help="IP:PORT to accept on (port 0: any free)")
    parser.add_argument("--target", type=parse_address, required=True, help="IP:PORT to forward to")
    parser.add_argument("--control", type=Path, required=True, help="UNIX socket path for run-time settings")
    parser.add_argument(
        "--settings",
        type=_settings,
        default=ProxySettings(),
        help='initial settings as JSON, e.g. \'{"delay_ms": 25, "jitter_ms": 5}\'',
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("LOGLEVEL", "INFO"), format="%(asctime)s %(levelname)s proxy[%(process)d] %(message)s"
    )
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
