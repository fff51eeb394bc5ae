"""A real Docker engine for tests/integration/test_docker.py's end-to-end test: start it, build images, run and inspect
containers, and remove everything a test created.

Image registries are out of reach, so base images are made locally: ``debootstrap`` (Debian's packages) into a
folder, then ``docker import``. Builds install from a wheelhouse prepared on the host by docker/wheelhouse.sh
(downloads from inside a container are not assumed to work). Every name a ``DockerResources`` creates is removed
by ``cleanup()``, also when the test fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
# the storage driver that works without overlayfs here; host networking needs neither iptables nor a bridge
DOCKERD_ARGS = ["--storage-driver=vfs", "--iptables=false", "--bridge=none"]
BASE_PACKAGES = "python3,python3-venv,ca-certificates"
# never sent into the build context: big, and excluded by .dockerignore anyway
NOT_IN_CONTEXT = {".git", ".venv", "outputs", "runs", "build", "__pycache__"}


def docker(*args: str, timeout: float = 120, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} exited with {result.returncode}:\n{result.stderr[-4000:]}")
    return result


def engine_running() -> bool:
    try:
        return docker("info", "--format", "{{.ServerVersion}}", timeout=30, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def engine_problem() -> Optional[str]:
    """Why no Docker engine can run here, or None (it runs, or this process can start it)."""
    if shutil.which("docker") is None:
        return "no docker client: apt-get install docker.io"
    if engine_running():
        return None
    if shutil.which("dockerd") is None:
        return "no Docker engine: apt-get install docker.io"
    if os.geteuid() != 0:
        return "the Docker engine is not running and only root can start it"
    return None


def start_engine(log_path: Path, timeout: float = 60) -> Optional[int]:
    """Start dockerd if none answers; return its pid (to stop it afterwards) or None if one was running.

    It is started outside this process's tree (through a shell that exits) so the suite's fixture that kills
    leftover children does not kill it between tests."""
    if engine_running():
        return None
    started = subprocess.run(
        ["bash", "-c", f'nohup dockerd {" ".join(DOCKERD_ARGS)} >>"$0" 2>&1 </dev/null & echo $!', str(log_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(started.stdout.strip())
    deadline = time.monotonic() + timeout
    while not engine_running():
        if time.monotonic() > deadline:
            raise RuntimeError(f"dockerd did not answer within {timeout} s:\n{log_path.read_text()[-3000:]}")
        time.sleep(1)
    return pid


def stop_engine(pid: int, timeout: float = 60) -> None:
    try:
        os.kill(pid, 15)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.kill(pid, 9)


class DockerResources:
    """Names of the images, containers and volumes a test created, removed by ``cleanup()``."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        # a multi-stage build also leaves untagged images (its build stage): whatever is new at cleanup goes
        self.image_ids_before = all_image_ids()
        self.images: List[str] = []
        self.containers: List[str] = []
        self.volumes: List[str] = []
        self.compose_projects: List[tuple] = []  # (project, compose files)

    def name(self, what: str) -> str:
        return f"{self.prefix}-{what}"

    def cleanup(self) -> List[str]:
        """Remove everything; return what could not be removed."""
        problems = []
        for project, files in self.compose_projects:
            args = [a for f in files for a in ("-f", str(f))]
            result = subprocess.run(
                ["docker-compose", "-p", project, *args, "down", "--volumes", "--timeout", "30"],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if result.returncode != 0:
                problems.append(f"compose {project}: {result.stderr[-500:]}")
        for kind, names, extra in (
            ("container", self.containers, ["--force", "--volumes"]),
            ("volume", self.volumes, ["--force"]),
            ("image", self.images, ["--force"]),
        ):
            for name in reversed(names):
                result = docker(kind, "rm", *extra, name, check=False, timeout=300)
                if result.returncode != 0 and "No such" not in result.stderr:
                    problems.append(f"{kind} {name}: {result.stderr.strip()}")
        for _ in range(10):  # an image with children goes only after them: a few passes
            left = all_image_ids() - self.image_ids_before
            if not left:
                break
            for image_id in left:
                docker("image", "rm", "--force", image_id, check=False, timeout=300)
        left = all_image_ids() - self.image_ids_before
        if left:
            problems.append(f"images left: {sorted(left)}")
        return problems


def all_image_ids() -> set:
    return set(docker("images", "--all", "--quiet", "--no-trunc").stdout.split())


# ------------------------------------------------------------------ images
def build_local_base(resources: DockerResources, workdir: Path, suite: str = "bookworm") -> str:
    """A Debian base image with Python (what a registry's debian/python image would give), made by debootstrap."""
    tag = resources.name("base") + ":" + suite
    rootfs = workdir / "rootfs"
    result = subprocess.run(
        ["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", suite, str(rootfs)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if result.returncode != 0:
        raise RuntimeError(f"debootstrap failed:\n{result.stdout[-3000:]}\n{result.stderr[-2000:]}")
    for cache in ("var/cache/apt", "var/lib/apt/lists"):  # a base image ships without apt's caches
        shutil.rmtree(rootfs / cache, ignore_errors=True)
    resources.images.append(tag)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    docker("import", "-", tag, stdin=tar.stdout, timeout=600)
    tar.wait(timeout=60)
    shutil.rmtree(rootfs, ignore_errors=True)
    return tag


def make_wheelhouse(dest: Path, torch: str = "cpu") -> str:
    """docker/wheelhouse.sh for this Python (the local base's Debian bookworm has the same 3.11); its summary line.

    The CPU build of torch comes from pip's own --find-links here (TORCH_CPU_INDEX empty), not from an index."""
    env = {**os.environ, "PYTHON": sys.executable, "TORCH_CPU_INDEX": ""}
    result = subprocess.run(
        ["bash", str(ROOT / "docker" / "wheelhouse.sh"), "--torch", torch, str(dest)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if result.returncode != 0:
        raise RuntimeError(f"docker/wheelhouse.sh failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return result.stdout.strip().splitlines()[-1]


def _context_files(wheelhouse: Optional[Path]):
    """(path on disk, path in the context): the checkout (docker applies .dockerignore) and the wheelhouse."""
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in NOT_IN_CONTEXT and not (folder == str(ROOT) and d == "tests")]
        for name in files:
            path = Path(folder) / name
            if wheelhouse is None or not path.is_relative_to(ROOT / "docker" / "wheelhouse"):
                yield path, path.relative_to(ROOT).as_posix()
    if wheelhouse is not None:
        for path in sorted(wheelhouse.iterdir()):
            yield path, f"docker/wheelhouse/{path.name}"


def build_image(
    resources: DockerResources,
    tag: str,
    build_args: Dict[str, str],
    wheelhouse: Optional[Path],
    log: Path,
    options: Sequence[str] = (),
) -> str:
    """``docker build -f docker/Dockerfile --build-arg ... -t TAG .`` with the checkout as the context and the
    wheelhouse in its docker/wheelhouse/; the context is streamed as a tar so nothing is written into the checkout."""
    args = ["build", "-f", "docker/Dockerfile", "-t", tag, *options]
    for key, value in build_args.items():
        args += ["--build-arg", f"{key}={value}"]
    resources.images.append(tag)
    with open(log, "wb") as out:
        build = subprocess.Popen(["docker", *args, "-"], stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT)
        try:
            # GNU format: Python's default (pax) starts with an extended header (float mtimes) that docker's
            # sniffing of stdin does not take for an archive
            with tarfile.open(fileobj=build.stdin, mode="w|", format=tarfile.GNU_FORMAT) as context:
                for path, arcname in _context_files(wheelhouse):
                    context.add(path, arcname=arcname, recursive=False)
            build.stdin.close()
        except BrokenPipeError:
            pass  # the build failed early: its log says why
        code = build.wait(timeout=1800)
    if code != 0:
        raise RuntimeError(f"docker build failed ({code}):\n{log.read_text(errors='replace')[-5000:]}")
    return tag


def build_prometheus_image(resources: DockerResources, base: str, workdir: Path) -> str:
    """Prometheus from Debian's package (the binary installed on this machine) on the local Debian base."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus is not installed: run scripts/setup_env.sh --test (apt-get install prometheus)")
    context = workdir / "prometheus-image"
    context.mkdir(parents=True)
    shutil.copy(binary, context / "prometheus")
    (context / "Dockerfile").write_text(
        f"FROM {base}\n"
        "COPY prometheus /bin/prometheus\n"
        "RUN mkdir -p /prometheus /etc/prometheus\n"
        'ENTRYPOINT ["/bin/prometheus"]\n'
    )
    tag = resources.name("prometheus") + ":debian"
    resources.images.append(tag)
    docker("build", "-t", tag, str(context), timeout=600)
    return tag


def image_size_mb(tag: str) -> float:
    return int(docker("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip()) / 1e6


# ------------------------------------------------------------------ containers
def run_container(
    resources: DockerResources,
    name: str,
    image: str,
    args: Sequence[str],
    *,
    volume: str,
    env: Optional[Dict[str, str]] = None,
    options: Sequence[str] = (),
    start: bool = True,
) -> str:
    """``docker run -d --network host -v VOLUME:/data`` (the volume is created on first use); with
    ``start=False`` only created (``docker create``: on vfs that copies the image, the slow part), for
    ``docker start`` to start several at once."""
    if volume not in resources.volumes:
        resources.volumes.append(volume)
    if name not in resources.containers:
        resources.containers.append(name)
    env_args = [a for key, value in (env or {}).items() for a in ("-e", f"{key}={value}")]
    command = ["run", "-d"] if start else ["create"]
    docker(*command, "--name", name, "--network", "host", "-v", f"{volume}:/data", *env_args, *options, image, *args)
    return name


def state(container: str) -> dict:
    return json.loads(docker("inspect", "--format", "{{json .State}}", container).stdout)


def health(container: str) -> str:
    return (state(container).get("Health") or {}).get("Status", "none")


def logs(container: str) -> str:
    result = docker("logs", container, check=False)
    return result.stdout + result.stderr


def volume_path(volume: str) -> Path:
    """Where the volume's files are on this machine (the tests run as root, like the engine)."""
    return Path(docker("volume", "inspect", "--format", "{{.Mountpoint}}", volume).stdout.strip())
