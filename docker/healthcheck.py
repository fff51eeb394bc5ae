"""Container healthcheck: the aux peer must answer on its metrics port; a trainer process must be alive."""

import os
import sys
import urllib.request

import psutil


def main() -> int:
    role = os.environ.get("LEANHIVE_ROLE", "trainer")
    if role == "aux":
        port = os.environ.get("LEANHIVE_METRICS_PORT", "9100")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                return 0 if response.status == 200 else 1
        except OSError as e:
            print(f"aux peer metrics endpoint not answering: {e}", file=sys.stderr)
            return 1
    script = "run_trainer.py"
    alive = any(script in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))
    if not alive:
        print(f"no {script} process is running", file=sys.stderr)
    return 0 if alive else 1


if __name__ == "__main__":
    sys.exit(main())
