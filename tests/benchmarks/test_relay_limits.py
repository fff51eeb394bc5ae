"""The relay measurement's command line (benchmarks/relay_limits.py): bad values exit 2 with the fix, before any
namespace is built. The measurement itself needs root and about 4 minutes (go-libp2p's autorelay boot delay); its
numbers are in docs/joining.md."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--timeout", "0"], "--timeout must be a positive number of seconds"),
        (["--circuit_timeout", "-1"], "--circuit_timeout must be a positive number of seconds"),
        (["--punch_wait", "-5"], "--punch_wait must be >= 0 seconds"),
        (["--sizes", "big"], "invalid int value"),
        (["--sizes", "16", "0"], "--sizes must be positive numbers of bytes"),
    ],
)
def test_bad_values_exit_2_with_the_fix(argv, message):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.relay_limits", *argv], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr
