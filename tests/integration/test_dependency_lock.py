"""The locks of the tested set: requirements.lock pins every runtime dependency, requirements-test.lock every
runtime, test and benchmark one with the same runtime pins, each pin inside pyproject.toml's range; no CUDA package
is locked (torch's build comes from the install's source); the export's model card names the transformers versions
at both ends of the range the tests run at (the lock's, and the oldest pyproject allows)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from aux_monitor.export import TESTED_TRANSFORMERS

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the standard library has no TOML reader yet
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pins(name: str) -> dict[str, Version]:
    pins = {}
    for line in (ROOT / name).read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9._-]+)==(\S+)", line)
        if match:
            pins[canonicalize_name(match.group(1))] = Version(match.group(2))
    return pins


def _requirements(*extras: str) -> list[Requirement]:
    project = _pyproject()["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def _assert_pinned_within_ranges(pins: dict[str, Version], requirements: list[Requirement], lock: str) -> None:
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{lock} does not pin {name}: run `bash scripts/deps.sh lock`"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{lock} pins {name}=={pins[name]}, outside pyproject's {requirement}: run `bash scripts/deps.sh lock`"
        )


def test_requirements_lock_pins_every_runtime_dependency_within_its_range():
    _assert_pinned_within_ranges(_pins("requirements.lock"), _requirements(), "requirements.lock")


def test_the_test_lock_adds_the_extras_and_keeps_the_runtime_pins():
    runtime, test = _pins("requirements.lock"), _pins("requirements-test.lock")
    _assert_pinned_within_ranges(test, _requirements("test", "bench"), "requirements-test.lock")
    assert {name: test.get(name) for name in runtime} == runtime


def test_no_cuda_build_is_locked():
    """torch is pinned without a build label; what a CUDA build needs, torch itself pins when it is installed."""
    for lock in ("requirements.lock", "requirements-test.lock"):
        pins = _pins(lock)
        assert pins["torch"].local is None, f"{lock} pins a torch build ({pins['torch']}), not a version"
        assert not [name for name in pins if name.startswith(("nvidia-", "cuda-", "triton"))], lock


def test_the_model_card_names_the_versions_the_tests_run_at():
    oldest, locked = TESTED_TRANSFORMERS
    [transformers] = [r for r in _requirements() if canonicalize_name(r.name) == "transformers"]
    lower_bounds = [spec.version for spec in transformers.specifier if spec.operator == ">="]
    assert lower_bounds == [oldest], f"TESTED_TRANSFORMERS[0] must be pyproject's lower bound {lower_bounds}"
    assert Version(locked) == _pins("requirements.lock")["transformers"]
