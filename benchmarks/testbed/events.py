"""Read the lifecycle events a peer writes with ``--events_file PATH`` (``peer.swarm.events``).

One JSON object per line: ``{"event": NAME, "time": <unix time>, "pid": int, ...fields}``, appended and
flushed line by line, so a reader may see a last line that is still being written: it is left for the next
read. Multi-peer tests wait on these events instead of matching the peers' free-form log text::

    peer.events.wait("epoch_done", timeout=60, where=lambda e: e["epoch"] >= 3)
    peer.events.all("state_loaded")

Events (see the table in the refactor plan / ``peer.swarm.events``): dht_started, joined, serving, state_loaded,
epoch_done, backup_written, checkpoint_saved, offering_checkpoint, reconnected, max_epochs_reached, exiting.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

if TYPE_CHECKING:
    from benchmarks.testbed.processes import PeerProcess

Event = Dict[str, object]


class EventLog:
    """The events in ``path``; with ``process``, waits fail as soon as that peer exits (``PeerExited``)."""

    def __init__(self, path: Path, process: Optional["PeerProcess"] = None):
        self.path, self.process = Path(path), process

    def clear(self) -> None:
        """Forget earlier runs' events (a peer restarted with the same name appends to the same file)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(b"")

    def read(self) -> List[Event]:
        """Every complete event written so far, in order."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        events = []
        for line in data.split(b"\n")[:-1]:  # the part after the last newline may still be being written
            if line.strip():
                events.append(json.loads(line))
        return events

    def all(self, name: str, where: Optional[Callable[[Event], bool]] = None) -> List[Event]:
        """Every event called ``name`` (that passes ``where``), oldest first."""
        return [e for e in self.read() if e["event"] == name and (where is None or where(e))]

    def last(self, name: str, where: Optional[Callable[[Event], bool]] = None) -> Optional[Event]:
        found = self.all(name, where)
        return found[-1] if found else None

    def wait(
        self, name: str, timeout: float, *, where: Optional[Callable[[Event], bool]] = None, count: int = 1
    ) -> Event:
        """Wait until ``count`` events ``name`` (counting only those that pass ``where``) were written; return the
        ``count``-th. Raises ``PeerExited`` if the peer exits first and ``TimeoutError`` after ``timeout`` s."""
        from benchmarks.testbed.processes import PeerExited

        deadline = time.monotonic() + timeout
        while True:
            if self.process is not None:
                self.process.snapshot_tree()
            exited = self.process is not None and self.process.poll() is not None
            found = self.all(name, where)  # read after the exit check: what an exited peer wrote counts
            if len(found) >= count:
                return found[count - 1]
            if exited:
                raise PeerExited(
                    f"{self._who()} exited with {self.process.poll()} before the event {name!r} "
                    f"(x{count}):\n{self._context()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self._who()} wrote no event {name!r} (x{count}) within {timeout:.0f} s:\n{self._context()}"
                )
            time.sleep(0.2)

    def _who(self) -> str:
        return self.process.name if self.process is not None else str(self.path)

    def _context(self) -> str:
        recent = [json.dumps(e) for e in self.read()[-5:]]
        tail = self.process.tail() if self.process is not None else ""
        return "last events:\n" + "\n".join(recent or ["(none)"]) + ("\nlog tail:\n" + tail if tail else "")
