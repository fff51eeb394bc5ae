"""Packaging: installed from a wheel, LeanHive finds its run/model presets and shipped assets outside a checkout.

The wheel is built from a copy of the tree, so no build/ or egg-info lands in the checkout and no stale
build/lib from an older layout leaks into the wheel. It is installed with --no-deps into a fresh venv whose
heavy dependencies (torch, hivemind, ...) come from this venv's site-packages through a .pth line, and the
CLIs and preset lookups then run from a folder outside the repository with PYTHONPATH unset.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
# Not part of a clean checkout (see .gitignore); everything else is copied for the build.
SKIP_AT_ROOT = {".git", ".venv", "build", "dist", "outputs", "runs", ".pytest_cache", ".whl"}
DEPENDENCIES = ("torch", "hivemind", "transformers", "yaml")
LICENSE_WARNING = "`project.license` as a TOML table is deprecated"

# Measured at about 30 s on a 2-core machine (one wheel build, four interpreters that import torch).
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # builds a wheel and a venv


def run(command, *, cwd: Path, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, (
        f"{command} exited with {result.returncode}\nstdout:\n{result.stdout[-5000:]}\nstderr:\n{result.stderr[-5000:]}"
    )
    return result


def copy_tree(destination: Path) -> None:
    def ignore(directory, names):
        skipped = {name for name in names if name == "__pycache__" or name.endswith((".egg-info", ".pyc"))}
        relative = Path(directory).resolve().relative_to(REPO)
        if relative == Path("."):
            skipped |= SKIP_AT_ROOT & set(names)
        elif relative == Path("benchmarks"):
            skipped |= {"results"} & set(names)
        return skipped

    shutil.copytree(REPO, destination, ignore=ignore, symlinks=True)


def dependency_dirs() -> list:
    """The site-packages folder(s) that hold LeanHive's dependencies in the venv running this test."""
    dirs = []
    for name in DEPENDENCIES:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin, f"{name} is not installed in {sys.executable}'s environment"
        folder = str(Path(spec.origin).resolve().parent.parent)
        if folder not in dirs:
            dirs.append(folder)
    return dirs


def clean_env() -> dict:
    """No PYTHONPATH (nothing may come from the checkout), offline, wide help output (no wrapped paths)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH", "VIRTUAL_ENV")
    }
    env.update(
        COLUMNS="1000",
        PYTHONNOUSERSITE="1",
        PYTHONDONTWRITEBYTECODE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
    )
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("packaging")
    source, wheels, env_dir, outside = root / "source", root / "wheels", root / "venv", root / "outside"
    copy_tree(source)
    build = run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            wheels,
            source,
        ],
        cwd=root,
        timeout=180,
    )
    (wheel,) = wheels.glob("leanhive-*.whl")

    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(env_dir)
    python = env_dir / ("Scripts" if os.name == "nt" else "bin") / "python"
    site_packages = Path(
        run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).stdout.strip()
    ).resolve()
    # Install before the .pth line exists: otherwise pip would see (and replace) the editable leanhive of the
    # venv running this test. This venv's pip installs into the fresh one (--python), which has no pip.
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel], cwd=root)
    # A folder named in a .pth line is only appended to sys.path: the .pth files inside it (the editable
    # install's finder) are not processed, so peer/model/configs can only come from the installed wheel.
    (site_packages / "leanhive_test_dependencies.pth").write_text("\n".join(dependency_dirs()) + "\n")
    outside.mkdir()
    return dict(
        root=root,
        wheel=wheel,
        build_output=build.stdout + build.stderr,
        python=python,
        bin=python.parent,
        site_packages=site_packages,
        outside=outside,
        env=clean_env(),
    )


def test_wheel_holds_presets_and_spdx_license(installed):
    assert LICENSE_WARNING not in installed["build_output"]
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        names = set(wheel.namelist())
        (metadata,) = [name for name in names if name.endswith(".dist-info/METADATA")]
        assert "License-Expression: MIT" in wheel.read(metadata).decode()
    expected = {
        path.relative_to(REPO).as_posix()
        for pattern in (
            "configs/model/*.json",
            "configs/run/*.yaml",
            "peer/assets/tokenizer/*",
            "peer/assets/corpus/*",
            "aux_monitor/static/*",
        )
        for path in REPO.glob(pattern)
    }
    assert {
        "configs/__init__.py",
        "configs/model/tiny.json",
        "configs/run/tiny.yaml",
        "aux_monitor/static/dashboard.html",
    } <= names
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"


def test_presets_resolve_inside_the_installed_package(installed):
    script = """
import json
import aux_monitor, configs, model, peer
from model import PRESETS_DIR, available_presets, load_config
from peer.cli import parse_config
from aux_monitor.server import dashboard_template

print(load_config("tiny"))
config = parse_config(["--config", "tiny"])  # loads the run preset, the model preset and the shipped tokenizer
run = {}
for section in (config.network, config.collaboration, config.optimizer, config.training, config.data):
    run.update(vars(section))
print(json.dumps({
    "files": {module.__name__: module.__file__ for module in (aux_monitor, configs, model, peer)},
    "model_presets_dir": str(configs.MODEL_PRESETS_DIR), "run_presets_dir": str(configs.RUN_PRESETS_DIR),
    "presets_dir": str(PRESETS_DIR), "available": available_presets(),
    "tiny": load_config("tiny").to_dict(), "run": run, "dashboard": dashboard_template()}, default=str))
"""
    result = run([installed["python"], "-c", script], cwd=installed["outside"], env=installed["env"])
    assert "LeanTransformerConfig" in result.stdout
    found = json.loads(result.stdout.strip().splitlines()[-1])
    site_packages = installed["site_packages"]
    for name, file in found["files"].items():
        assert Path(file).resolve().is_relative_to(site_packages), f"{name} imported from {file}, not the wheel"

    model_dir, run_dir = Path(found["model_presets_dir"]), Path(found["run_presets_dir"])
    assert model_dir == site_packages / "configs" / "model" and run_dir == site_packages / "configs" / "run"
    assert Path(found["presets_dir"]) == model_dir
    assert (run_dir / "tiny.yaml").is_file()
    shipped_runs = sorted(p.name for p in (REPO / "configs/run").glob("*.yaml"))
    assert sorted(p.name for p in run_dir.glob("*.yaml")) == shipped_runs
    assert found["available"] == sorted(p.stem for p in (REPO / "configs/model").glob("*.json"))
    assert {"tiny", "small", "base", "large", "xl"} <= set(found["available"])
    for key, value in json.loads((REPO / "configs/model/tiny.json").read_text()).items():
        assert found["tiny"][key] == value, key
    # the installed run preset was applied on top of the dataclass defaults
    for key, value in yaml.safe_load((run_dir / "tiny.yaml").read_text()).items():
        assert found["run"][key] == value, key
    # the dashboard page is package data, read from the wheel
    assert found["dashboard"] == (site_packages / "aux_monitor" / "static" / "dashboard.html").read_text()
    assert "__INITIAL_STATE__" in found["dashboard"]
    # the shipped tokenizer and corpus are installed as package data
    assets = site_packages / "peer" / "assets"
    assert (assets / "tokenizer" / "tokenizer.json").is_file()
    assert {"train.txt", "validation.txt", "README.md"} <= {p.name for p in (assets / "corpus").iterdir()}


def help_text(command, installed) -> str:
    result = run(command, cwd=installed["outside"], env=installed["env"])
    text = " ".join(result.stdout.split())
    assert "--config PRESET_OR_YAML" in text and "--model_config" in text
    # --config names the installed run presets (argparse prints help before any preset is read)
    assert f"a name from {installed['site_packages'] / 'configs' / 'run'} " in text
    assert str(REPO) not in result.stdout + result.stderr
    return text


def test_run_trainer_script_help_outside_the_checkout(installed):
    script = installed["outside"] / "run_trainer.py"
    shutil.copy(REPO / "run_trainer.py", script)
    text = help_text([installed["python"], script, "--config", "tiny", "--help"], installed)
    assert "usage: leanhive-trainer" in text


def test_console_scripts_are_installed(installed):
    trainer, aux = installed["bin"] / "leanhive-trainer", installed["bin"] / "leanhive-aux"
    assert trainer.is_file() and aux.is_file()
    assert "usage: leanhive-trainer" in help_text([trainer, "--config", "tiny", "--help"], installed)
    assert "usage: leanhive-aux" in help_text([aux, "--config", "tiny", "--help"], installed)
