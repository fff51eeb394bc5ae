"""The Docker image, entry point and compose file, tested without a Docker engine (none runs here)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
SCHEMA = ROOT / ".venv" / "compose_spec.json"


@pytest.fixture(scope="module")
def dockerfile():
    parser = DockerfileParser(path=str(DOCKER / "Dockerfile"))
    return parser


def instructions(parser, name):
    return [i["value"] for i in parser.structure if i["instruction"] == name]


def test_dockerfile_one_image_for_both_roles(dockerfile):
    assert "cuda" in dockerfile.baseimage, "GPU volunteers need a CUDA-capable base"
    users = instructions(dockerfile, "USER")
    assert users and users[-1] not in ("root", "0"), "the image must run as a non-root user"
    assert instructions(dockerfile, "VOLUME") == ["/data"]
    exposed = " ".join(instructions(dockerfile, "EXPOSE")).split()
    assert {"31337", "9100"} <= set(exposed)
    assert instructions(dockerfile, "HEALTHCHECK"), "a healthcheck is required"
    assert "docker/entrypoint.sh" in instructions(dockerfile, "ENTRYPOINT")[0]
    copied = " ".join(instructions(dockerfile, "COPY"))
    for path in (
        "pyproject.toml",
        "scripts/",
        "model/",
        "peer/",
        "aux_monitor/",
        "configs/",
        "run_trainer.py",
        "run_aux_peer.py",
        "docker/entrypoint.sh",
        "docker/healthcheck.py",
    ):
        assert path in copied, f"{path} is not copied into the image"


def test_dockerfile_installs_from_the_same_source_as_the_readme(dockerfile):
    """One dependency list: the image runs the very script the README's commands run."""
    runs = " ".join(instructions(dockerfile, "RUN"))
    assert "scripts/setup_env.sh" in runs
    assert "pip install" not in runs, "dependencies must come from scripts/setup_env.sh + pyproject.toml only"
    readme = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    scripts = re.findall(r"bash (scripts/\S+)", first_block)
    assert scripts, "the README must open with the install+run commands"
    for script in scripts:
        assert "scripts/setup_env.sh" in (ROOT / script).read_text(), f"{script} must install via setup_env.sh"
    setup = (ROOT / "scripts" / "setup_env.sh").read_text()
    assert 'pip install -q -e ".${extras}"' in setup and "torch==2.13.0" in setup


def _run_entrypoint(*args, env=None, timeout=120):
    full_env = {**os.environ, "LEANHIVE_PYTHON": sys.executable, **(env or {})}
    return subprocess.run(
        ["bash", str(DOCKER / "entrypoint.sh"), *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.mark.parametrize("role,script_flag", [("trainer", "--max_epochs"), ("aux", "--checkpoint_every")])
def test_entrypoint_runs_each_role(role, script_flag, tmp_path):
    result = _run_entrypoint(role, "--help", env={"LEANHIVE_DATA": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert script_flag in result.stdout


def test_entrypoint_rejects_unknown_role():
    result = _run_entrypoint("miner")
    assert result.returncode == 2
    assert "expected 'trainer' or 'aux'" in result.stderr


def test_entrypoint_passes_invalid_flags_through_to_a_clear_error(tmp_path):
    result = _run_entrypoint("trainer", "--target_batch_size", "-5", env={"LEANHIVE_DATA": str(tmp_path)})
    assert result.returncode == 2
    assert "target_batch_size" in result.stderr


def test_compose_file_matches_the_compose_schema():
    if not SCHEMA.exists():
        pytest.fail(f"{SCHEMA} is missing: run `bash scripts/setup_env.sh --test` (it fetches the Compose schema)")
    schema = json.loads(SCHEMA.read_text())
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    jsonschema.validate(compose, schema)
    services = compose["services"]
    assert {"aux", "trainer1", "trainer2", "prometheus"} <= set(services)
    # Prometheus scrapes the aux peer on the port the aux peer serves
    prometheus = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == [f"aux:{services['aux']['environment']['LEANHIVE_METRICS_PORT']}"]


def test_peer_address_helper_matches_the_dht_peer_id(tmp_path):
    """Compose trainers find the aux peer from its identity file; the ID must be the one p2pd uses."""
    code = (
        "import sys, hivemind\n"
        "dht = hivemind.DHT(start=True, host_maddrs=['/ip4/127.0.0.1/tcp/0'], "
        f"identity_path={str(tmp_path / 'id.key')!r})\n"
        "print(dht.peer_id.to_base58()); dht.shutdown()\n"
    )
    peer_id = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()[-1]
    address = subprocess.run(
        [sys.executable, str(DOCKER / "peer_address.py"), "aux", "31337", str(tmp_path / "id.key")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    assert address == f"/dns4/aux/tcp/31337/p2p/{peer_id}"
