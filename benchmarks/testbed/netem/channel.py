"""Talk JSON lines to a helper process running inside a test host (its stdin/stdout), with timeouts."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from typing import Any, Dict, Optional, Union

# helper processes prefix their replies, so stray prints (e.g. from libraries) are not mistaken for them
REPLY_PREFIX = "@netem "


def reply(message: Dict[str, Any]) -> None:
    """Helper-process side: write one reply line to stdout."""
    print(REPLY_PREFIX + json.dumps(message), flush=True)


class JsonLinesProcess:
    """Test side: send a line to a helper's stdin, wait (bounded) for its next reply line."""

    def __init__(self, process: subprocess.Popen, name: str = "helper"):
        if process.stdin is None or process.stdout is None:
            raise ValueError("start the helper with stdin=subprocess.PIPE and stdout=subprocess.PIPE")
        self.process, self.name = process, name
        self._buffer = b""

    def send(self, message: Union[str, Dict[str, Any]]) -> None:
        line = message if isinstance(message, str) else json.dumps(message)
        self.process.stdin.write(line.encode() + b"\n")
        self.process.stdin.flush()

    def read(self, timeout: float) -> Dict[str, Any]:
        """Next reply; TimeoutError if none comes within ``timeout`` s, EOFError if the helper exited."""
        deadline = time.monotonic() + timeout
        fd = self.process.stdout.fileno()
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(REPLY_PREFIX):
                    return json.loads(text[len(REPLY_PREFIX) :])
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.name} sent no reply within {timeout}s")
            readable, _, _ = select.select([fd], [], [], remaining)
            if readable:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise EOFError(f"{self.name} exited (rc={self.process.wait()}) before replying")
                self._buffer += chunk

    def request(self, message: Union[str, Dict[str, Any]], timeout: float) -> Dict[str, Any]:
        self.send(message)
        return self.read(timeout)

    def kill(self) -> int:
        """For helpers that never exit on their own (servers)."""
        self.process.kill()
        return self.process.wait()

    def close(self, timeout: float = 5.0) -> Optional[int]:
        """Close stdin (helpers exit on EOF), then make sure the process is gone."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
