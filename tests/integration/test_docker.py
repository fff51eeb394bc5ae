"""The Docker image, entry point and compose file.

The default run checks them without a Docker engine. ``-m docker`` runs the end-to-end tests: a real engine
(started here if needed, as root), the image built from a local Debian base and a wheelhouse, an aux peer and two
trainers in containers, a clean stop and a restart, and the compose swarm with Prometheus (about 15 minutes on a
2-core machine, most of it the build; it removes every container, image and volume it made).
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import psutil
import pytest
import yaml
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
SCHEMA = ROOT / ".venv" / "compose_spec.json"


@pytest.fixture(scope="module")
def dockerfile():
    parser = DockerfileParser(path=str(DOCKER / "Dockerfile"))
    return parser


def instructions(parser, name):
    return [i["value"] for i in parser.structure if i["instruction"] == name]


def test_dockerfile_one_image_for_both_roles(dockerfile):
    # the first stage's base is the BASE_IMAGE build argument, whose default is the CUDA runtime base
    assert "cuda" in dockerfile.parent_images[0], "GPU volunteers need a CUDA-capable base by default"
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
        "requirements.lock",  # the tested set setup_env.sh installs
        "scripts/",
        "model/",
        "peer/",
        "aux_monitor/",
        "configs/",
        "run_trainer.py",
        "run_aux_peer.py",
        "docker/entrypoint.sh",
        "docker/healthcheck.py",
        "docker/peer_address.py",  # docker/compose.yaml's trainers run it
    ):
        assert path in copied, f"{path} is not copied into the image"


def test_dockerfile_installs_from_the_same_source_as_the_readme(dockerfile):
    """One tested set: the image runs the very script the README's commands run, which installs the lock."""
    runs = " ".join(instructions(dockerfile, "RUN"))
    assert "scripts/setup_env.sh" in runs
    assert "pip install" not in runs, "dependencies must come from scripts/setup_env.sh + requirements.lock only"
    readme = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    scripts = re.findall(r"bash (scripts/\S+)", first_block)
    assert scripts, "the README must open with the install+run commands"
    for script in scripts:
        assert "scripts/setup_env.sh" in (ROOT / script).read_text(), f"{script} must install via setup_env.sh"
    setup = (ROOT / "scripts" / "setup_env.sh").read_text()
    assert 'pip install -q -r "$lock"' in setup and "lock=requirements.lock" in setup
    assert "--no-deps -e ." in setup, "LeanHive itself must add nothing to the lock's pins"


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
    # and loads the example alert rules, mounted beside its configuration
    assert prometheus["rule_files"] == ["alerts.yml"]
    assert "./alerts.yml:/etc/prometheus/alerts.yml:ro" in services["prometheus"]["volumes"]


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


def test_wheelhouse_script_rejects_an_unknown_torch_build(tmp_path):
    result = subprocess.run(
        ["bash", str(DOCKER / "wheelhouse.sh"), "--torch", "rocm", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--torch must be cuda or cpu" in result.stderr
    assert not list(tmp_path.iterdir()), "nothing is downloaded before the arguments are checked"


def _processes(pids):
    for pid in pids:
        process = psutil.Process(pid)
        process.info = {"cmdline": process.cmdline()}
        yield process


def test_healthcheck_tells_the_aux_role_from_the_running_peer(monkeypatch):
    """Docker runs the healthcheck with the container's environment, without the LEANHIVE_ROLE the entry point
    exports: the running peer script must tell the role, or the aux peer is checked as a trainer (never healthy)."""
    spec = importlib.util.spec_from_file_location("healthcheck", DOCKER / "healthcheck.py")
    healthcheck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(healthcheck)
    monkeypatch.delenv("LEANHIVE_ROLE", raising=False)
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "run_aux_peer.py"])
    try:
        for pids, role in (([os.getpid()], "trainer"), ([os.getpid(), peer.pid], "aux")):
            # only these processes, as in a container (this machine may run other tests' aux peers)
            monkeypatch.setattr(healthcheck.psutil, "process_iter", lambda attrs, pids=pids: _processes(pids))
            assert healthcheck._role() == role
    finally:
        peer.kill()
        peer.wait()


# ------------------------------------------------------------------ end to end, with a real Docker engine
JOIN_RE = re.compile(r"--initial_peers (/\S+)")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A running Docker engine and a DockerResources whose containers, images and volumes are removed after."""
    from tests.support import docker as d

    problem = d.engine_problem()
    if problem:
        pytest.skip(f"Docker cannot run here: {problem}")
    folder = tmp_path_factory.mktemp("docker")
    started_pid = d.start_engine(folder / "dockerd.log")
    resources = d.DockerResources(f"leanhive-e2e-{os.getpid()}")
    try:
        yield resources, folder
    finally:
        problems = resources.cleanup()
        if started_pid is not None:
            d.stop_engine(started_pid)
        assert not problems, f"could not remove: {problems}"


@pytest.fixture(scope="module")
def images(engine):
    """The CPU image, built FROM a local Debian base with a wheelhouse, and a Prometheus image (Debian's package)."""
    from tests.support import docker as d

    resources, folder = engine
    base = d.build_local_base(resources, folder)
    wheels = d.make_wheelhouse(folder / "wheelhouse", torch="cpu")
    tag = resources.name("leanhive") + ":cpu"
    d.build_image(resources, tag, {"BASE_IMAGE": base}, folder / "wheelhouse", folder / "build.log")
    print(f"\n{wheels}\nimage {tag}: {d.image_size_mb(tag):.0f} MB (base {d.image_size_mb(base):.0f} MB)")
    return {"leanhive": tag, "prometheus": d.build_prometheus_image(resources, base, folder)}


def _peer_args(role: str, run_id: str, *extra: str) -> list:
    # a global batch that takes the pair a few seconds: with the tiny preset's 64 a trainer alone runs about an
    # epoch a second, and one that started later is left too many epochs behind to accept a download
    return [
        role,
        "--config",
        "tiny",
        "--target_batch_size",
        "512",
        "--run_id",
        run_id,
        "--events_file",
        "/data/events.jsonl",
        *extra,
    ]


def _loopback_env(p2p_port: int, **more) -> dict:
    return {"LEANHIVE_P2P_PORT": str(p2p_port), "LEANHIVE_LISTEN_HOST": "127.0.0.1", **more}


def _events(volume: str):
    from benchmarks.testbed.events import EventLog
    from tests.support import docker as d

    return EventLog(d.volume_path(volume) / "events.jsonl")


def _wait_healthy(container: str, timeout: float = 180) -> None:
    from benchmarks.testbed.aux import wait_for
    from tests.support import docker as d

    try:
        wait_for(lambda: d.health(container) == "healthy", timeout, interval=1, what=f"{container} to be healthy")
    except TimeoutError as e:
        raise AssertionError(f"{e}: {d.state(container)}\n{d.logs(container)[-3000:]}") from None


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.timeout(1800)
def test_containers_train_stop_cleanly_and_rejoin_with_the_same_identity(engine, images):
    from benchmarks.testbed.aux import free_port
    from tests.support import docker as d

    resources, _ = engine
    image, run_id = images["leanhive"], f"docker_e2e_{os.getpid()}"
    health = ["--health-interval", "2s"]  # the image's 30 s interval, shortened for the test
    aux = d.run_container(
        resources,
        resources.name("aux"),
        image,
        _peer_args("aux", run_id, "--checkpoint_every", "2"),
        volume=resources.name("aux-data"),
        env=_loopback_env(free_port(), LEANHIVE_METRICS_PORT=str(free_port())),
        options=health,
    )
    aux_events = _events(resources.name("aux-data"))
    initial_peers = aux_events.wait("dht_started", timeout=180)["initial_peers"]
    trainers = {}
    for n in (1, 2):
        name, volume = resources.name(f"trainer{n}"), resources.name(f"trainer{n}-data")
        args = _peer_args("trainer", run_id, "--initial_peers", *initial_peers)
        env = _loopback_env(free_port())
        d.run_container(resources, name, image, args, volume=volume, env=env, options=health, start=False)
        trainers[name] = (volume, args)
    d.docker("start", *trainers)  # together: neither trains alone for long
    try:
        for name, (volume, _) in trainers.items():
            _events(volume).wait("epoch_done", timeout=400, where=lambda e: int(e["epoch"]) >= 3)
        for container in (aux, *trainers):
            _wait_healthy(container)

        # docker stop sends SIGTERM: the trainer finishes its step, writes its backup and exits with 0
        name, (volume, args) = next(iter(trainers.items()))
        events = _events(volume)
        peer_id = events.last("dht_started")["peer_id"]
        stopped = time.time()
        d.docker("stop", "--time", "120", name, timeout=180)
        assert d.state(name)["ExitCode"] == 0, d.logs(name)[-3000:]
        assert events.last("exiting")["code"] == 0
        backup = events.last("backup_written", where=lambda e: e["time"] >= stopped)
        assert backup is not None, d.logs(name)[-3000:]
        assert (d.volume_path(volume) / Path(backup["path"]).relative_to("/data")).exists()

        # a new container on the same volume: the same identity (peer ID); it restores its backup, joins the swarm
        # and trains on with it
        d.docker("rm", name)
        d.run_container(resources, name, image, args, volume=volume, env=_loopback_env(free_port()), options=health)
        restarted = events.wait("dht_started", timeout=180, count=2)
        assert restarted["peer_id"] == peer_id

        def since_restart(e):
            return e["time"] >= restarted["time"]

        assert events.wait("state_loaded", timeout=60, where=since_restart)["source"] == "backup"
        events.wait("joined", timeout=180, where=since_restart)
        other = _events(trainers[resources.name("trainer2")][0])
        swarm_epoch = int(other.last("epoch_done")["epoch"])
        events.wait("epoch_done", timeout=400, where=lambda e: since_restart(e) and int(e["epoch"]) > swarm_epoch)
        _wait_healthy(name)
    except BaseException:
        for container in (aux, *trainers):
            print(f"\n===== {container} =====\n{d.logs(container)[-3000:]}")
        raise
    finally:
        # left running, this swarm would train on beside the compose swarm of the next test (two cores: its DHT
        # requests then time out)
        d.docker("stop", "--time", "60", aux, *trainers, check=False, timeout=240)


def _compose_override(images: dict, folder: Path) -> tuple:
    """docker/compose.yaml on this machine: host networking on loopback (one port each, so nothing collides
    with other tests), the aux peer's name resolved in /etc/hosts, the images built above, Prometheus scraping
    every second with docker/prometheus.yml's job. Returns the override file and Prometheus' URL."""
    from benchmarks.testbed.aux import free_port

    ports = {name: free_port() for name in ("aux", "metrics", "trainer1", "trainer2", "prometheus")}
    prometheus = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    prometheus["global"]["scrape_interval"] = "1s"
    prometheus["scrape_configs"][0]["static_configs"][0]["targets"] = [f"aux:{ports['metrics']}"]
    (folder / "prometheus.yml").write_text(yaml.safe_dump(prometheus))

    def on_host():
        return {"network_mode": "host", "extra_hosts": ["aux:127.0.0.1"]}

    def peer():
        return {**on_host(), "image": images["leanhive"], "healthcheck": {"interval": "2s"}}

    trainer_env = {"LEANHIVE_LISTEN_HOST": "127.0.0.1", "LEANHIVE_AUX_P2P_PORT": str(ports["aux"])}
    override = {
        "services": {
            "aux": {
                **peer(),
                "environment": _loopback_env(ports["aux"], LEANHIVE_METRICS_PORT=str(ports["metrics"])),
            },
            **{
                name: {**peer(), "environment": {**trainer_env, "LEANHIVE_P2P_PORT": str(ports[name])}}
                for name in ("trainer1", "trainer2")
            },
            "prometheus": {
                **on_host(),
                "image": images["prometheus"],
                "command": [
                    "--config.file=/etc/prometheus/prometheus.yml",
                    "--storage.tsdb.path=/prometheus",
                    f"--web.listen-address=127.0.0.1:{ports['prometheus']}",
                ],
                "volumes": [
                    f"{folder / 'prometheus.yml'}:/etc/prometheus/prometheus.yml:ro",
                    f"{DOCKER / 'alerts.yml'}:/etc/prometheus/alerts.yml:ro",
                ],
            },
        }
    }
    path = folder / "compose.override.yaml"
    path.write_text(yaml.safe_dump(override))
    return path, f"http://127.0.0.1:{ports['prometheus']}"


def _compose_without_ports(folder: Path) -> Path:
    """docker/compose.yaml as it is, less its ``ports`` mappings: on the host network a container's ports are the
    host's already, and docker-compose refuses ``ports`` there ("host" network_mode is incompatible with
    port_bindings); an override file can add to a list but not remove it. Relative paths stay relative to docker/
    (the caller passes ``--project-directory``)."""
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    for service in compose["services"].values():
        service.pop("ports", None)
    path = folder / "compose.yaml"
    path.write_text(yaml.safe_dump(compose))
    return path


def _prometheus_value(url: str, expr: str):
    from benchmarks.testbed.aux import http_get

    try:
        status, body = http_get(f"{url}/api/v1/query?query={expr}", timeout=5)
    except OSError:
        return None
    result = json.loads(body)["data"]["result"] if status == 200 else []
    return float(result[0]["value"][1]) if result else None


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.timeout(1200)
def test_compose_swarm_trains_and_prometheus_scrapes_the_aux_peer(engine, images, tmp_path):
    from benchmarks.testbed.aux import http_get, wait_for
    from tests.support import docker as d

    resources, _ = engine
    override, prometheus = _compose_override(images, tmp_path)
    files = [_compose_without_ports(tmp_path), override]
    project = resources.name("compose").replace("-", "")
    resources.compose_projects.append((project, files))
    compose = ["docker-compose", "-p", project, "--project-directory", str(DOCKER)]
    compose += [a for f in files for a in ("-f", str(f))]
    # `up` waits for the aux peer to be healthy (depends_on) before it starts the trainers
    result = subprocess.run([*compose, "up", "-d", "--no-build"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    def aux_target_up():
        try:
            targets = json.loads(http_get(f"{prometheus}/api/v1/targets", timeout=5)[1])["data"]["activeTargets"]
        except OSError:
            return False
        return any(t["labels"]["job"] == "leanhive" and t["health"] == "up" for t in targets)

    try:
        wait_for(aux_target_up, 180, interval=2, what="Prometheus to scrape the aux peer")
        # the trainers' reports reach Prometheus through the aux peer: both alive, training together
        wait_for(
            lambda: (_prometheus_value(prometheus, "leanhive_alive_peers") or 0) >= 2,
            400,
            interval=3,
            what="Prometheus to see two alive trainers",
        )
        wait_for(
            lambda: (_prometheus_value(prometheus, "leanhive_global_epoch") or 0) >= 2,
            400,
            interval=3,
            what="Prometheus to see global epoch 2",
        )
    except BaseException:
        logs = subprocess.run([*compose, "logs", "--no-color", "--tail", "60"], capture_output=True, text=True)
        print(logs.stdout[-8000:], logs.stderr[-2000:])
        raise
    ps = subprocess.run([*compose, "ps"], capture_output=True, text=True, timeout=60).stdout
    assert ps.count("Up") >= 4, ps
    assert d.health(f"{project}_aux_1") == "healthy"
