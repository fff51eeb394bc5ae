"""Thin entry point: ``python run_aux_peer.py --help`` (same as the ``leanhive-aux`` console script)."""

import sys

from aux_monitor.cli import main

if __name__ == "__main__":
    sys.exit(main())
