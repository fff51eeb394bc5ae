"""Thin entry point: ``python run_trainer.py --help`` (same as the ``leanhive-trainer`` console script)."""

import sys

from peer.cli import main

if __name__ == "__main__":
    sys.exit(main())
