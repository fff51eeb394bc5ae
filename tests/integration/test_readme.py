"""Every shell command in README.md and docs/*.md is run here, so the documentation cannot drift from the code.

Each ```bash block is preceded by a marker saying how to run it:
  <!-- readme-test: quickstart -->   run each command with a short duration (see SHORTER) and expect exit 0
  <!-- readme-test: run -->          run each command, expect exit 0
  <!-- readme-test: setup -->        same as run (installs; fast when .venv exists)
  <!-- readme-test: background ready="REGEX" [export="VAR"] -->
                                     start the command, wait until its output matches REGEX, optionally
                                     export the --initial_peers it printed as $VAR; stop it with SIGTERM at
                                     the end of its turn (export blocks: at the end of the test), expect exit 0
  <!-- readme-test: docker [ready="REGEX"] -->
                                     no Docker engine here: `docker build` checks the Dockerfile and its build
                                     context, `docker run IMAGE ROLE ARGS` runs docker/entrypoint.sh ROLE ARGS
                                     as a background block, `docker compose -f F up` validates F
  <!-- readme-test: skip reason="WHY" -->  not run (needs root, or minutes to hours); the reason is required
The README's blocks run first, then each docs page's in file-name order (blocks that export an address go first).
Peers are bound to 127.0.0.1 (README's /ip4/0.0.0.0/ becomes /ip4/127.0.0.1/) so no traffic leaves loopback.
"""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER_TESTS = ROOT / "tests" / "integration" / "test_docker.py"
BLOCK_RE = re.compile(r"<!-- readme-test: (?P<meta>[^\n]*?) -->\n```bash\n(?P<body>.*?)```", re.S)  # meta: one line
PYTHON_BLOCK_RE = re.compile(r"<!-- readme-test: python -->\n```python\n(?P<body>.*?)```", re.S)
# the README exports the demo's checkpoints (outputs/demo/, the demo's default --workdir, which IN_TMP moves)
DEMO_OUTPUTS = "outputs/demo/"
ANY_BLOCK_RE = re.compile(r"```(?:bash|sh|shell|console)\n", re.S)
JOIN_RE = re.compile(r"--initial_peers (/\S+(?: /\S+)*)")
SHORTER = {"bash scripts/demo.sh": ["--duration", "100"], "bash scripts/test.sh": ["--collect-only", "-q"]}
# files the commands write must land in the test's folder: the demo's --workdir (default outputs/demo, resolved
# against the repository root, where scripts/demo.sh changes to) goes there, and outputs/ (the trainer's default
# --output_dir) is not linked into the folder the commands run in
IN_TMP = {"bash scripts/demo.sh": lambda tmp_path: ["--workdir", str(tmp_path / "demo")]}
NOT_LINKED = {".git", "outputs"}
DOCKER_RUN_VALUE_OPTIONS = {"-v", "--volume", "-p", "--publish", "-e", "--env", "--gpus", "--name"}

# the README test runs real peers and the demo: minutes, so not in the fast tier (`-m "not slow"`)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
RUN_KINDS = {"quickstart", "run", "setup", "background", "docker"}


def documentation_pages() -> list:
    """README.md, then every page of docs/, in the order their blocks run."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def page_blocks(page: Path):
    """The page's text and its marked shell blocks: (kind, options, commands)."""
    text = page.read_text()
    blocks = []
    for match in BLOCK_RE.finditer(text):
        meta = match.group("meta").strip()
        kind = meta.split()[0]
        options = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', meta))
        commands = [
            line.strip()
            for line in match.group("body").splitlines()
            if line.strip() and not line.strip().startswith("#")
        ]
        blocks.append((kind, options, commands))
    return text, blocks


def readme_blocks():
    """Every block the test runs: README.md's, then the docs pages' (skipped blocks left out)."""
    return [block for page in documentation_pages() for block in page_blocks(page)[1] if block[0] != "skip"]


def test_every_shell_block_in_the_documentation_is_covered():
    for page in documentation_pages():
        text, blocks = page_blocks(page)
        assert len(ANY_BLOCK_RE.findall(text)) == len(blocks), f"a shell block in {page.name} has no readme-test marker"
        kinds = {kind for kind, _, _ in blocks}
        assert kinds <= RUN_KINDS | {"skip"}, (page.name, kinds)
        assert page.name == "README.md" or "quickstart" not in kinds, f"{page.name}: quickstart is the README's"
        for kind, options, _ in blocks:
            assert kind != "skip" or options.get("reason"), f"{page.name}: a skipped block must say why"
    _, readme = page_blocks(ROOT / "README.md")
    first_kind, _, first_commands = readme[0]
    assert first_kind == "quickstart" and first_commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("bash scripts/test.sh"), (
        ".ci/run must call exactly the README's test command"
    )


class Background:
    def __init__(self, argv, env, log_path: Path, cwd: Path):
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
            )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 240) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if re.search(pattern, self.output()):
                return self.output()
            assert self.process.poll() is None, f"exited with {self.process.returncode}:\n{self.output()[-3000:]}"
            time.sleep(0.5)
        pytest.fail(f"no line matching {pattern!r} within {timeout} s:\n{self.output()[-3000:]}")

    def stop(self, timeout: float = 45) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            pytest.fail(f"did not exit within {timeout} s of SIGTERM:\n{self.output()[-3000:]}")


def shell_argv(command: str, env: dict) -> list:
    command = command.replace("/ip4/0.0.0.0/", "/ip4/127.0.0.1/")
    expanded = os.path.expandvars(command) if "$" in command else command
    for var in re.findall(r"\$(\w+)", command):
        assert var in env, f"README command uses ${var}, which no earlier block exported"
    return ["bash", "-c", "exec " + re.sub(r"\$(\w+)", lambda m: env[m.group(1)], expanded)]


def docker_to_local(command: str, env: dict, tmp_path: Path):
    """What a `docker ...` README command amounts to without an engine; None when it is only checked."""
    words = shlex.split(command)
    if words[:2] == ["docker", "build"]:
        assert "-f" in words and (ROOT / words[words.index("-f") + 1]).exists()
        assert words[-1] == ".", "the build context must be the repository root"
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", str(DOCKER_TESTS), "-k", "dockerfile"],
            check=True,
            cwd=ROOT,
            timeout=300,
        )
        return None
    if words[:2] == ["docker", "compose"]:
        compose_file = ROOT / words[words.index("-f") + 1]
        assert compose_file.exists() and "up" in words
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", str(DOCKER_TESTS), "-k", "compose"],
            check=True,
            cwd=ROOT,
            timeout=300,
        )
        return None
    assert words[:2] == ["docker", "run"], f"unknown docker command in README: {command}"
    i = 2
    while words[i].startswith("-"):
        i += 2 if words[i] in DOCKER_RUN_VALUE_OPTIONS else 1
    role_args = [re.sub(r"\$(\w+)", lambda m: env[m.group(1)], w) for w in words[i + 1 :]]
    role_args = [part for arg in role_args for part in arg.split()]
    (tmp_path / "docker-data").mkdir(exist_ok=True)
    docker_env = {
        **env,
        "LEANHIVE_DATA": str(tmp_path / "docker-data"),
        "LEANHIVE_P2P_PORT": "0",
        "LEANHIVE_LISTEN_HOST": "127.0.0.1",
        "LEANHIVE_PYTHON": sys.executable,
    }
    return ["bash", str(ROOT / "docker" / "entrypoint.sh"), *role_args], docker_env


@pytest.mark.slow
def test_readme_commands_run(tmp_path):
    blocks = readme_blocks()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "hf-modules")  # where loading an export with remote code copies it
    # commands run in a folder of links to the repository, so the files they write land in tmp_path
    workdir = tmp_path / "work"
    workdir.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in NOT_LINKED:
            (workdir / entry.name).symlink_to(entry)
    exporters = []
    try:
        # blocks that start the swarm others join go first, whatever their place in the README
        for kind, options, commands in sorted(blocks, key=lambda b: "export" not in b[1]):
            for n, command in enumerate(commands):
                log = tmp_path / f"{kind}-{len(list(tmp_path.glob('*.log')))}.log"
                if kind in ("run", "setup", "quickstart"):
                    if kind == "quickstart":
                        extra = [*SHORTER[command], *IN_TMP.get(command, lambda _: [])(tmp_path)]
                        argv = ["bash", "-c", "exec " + command + " " + " ".join(map(shlex.quote, extra))]
                    else:
                        argv = shell_argv(command.replace(DEMO_OUTPUTS, f"{tmp_path / 'demo'}/"), env)
                    result = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
                    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
                    if command == "bash scripts/demo.sh":
                        assert "Summary:" in result.stdout + result.stderr
                        assert (tmp_path / "demo" / "aux.log").exists(), "the demo wrote outside the test's folder"
                    continue
                if kind == "docker":
                    local = docker_to_local(command, env, tmp_path)
                    if local is None:
                        continue
                    argv, run_env = local
                else:
                    argv, run_env = shell_argv(command, env), env
                peer = Background(argv, run_env, log, cwd=workdir)
                output = peer.wait_for(options["ready"])
                if "export" in options:
                    env[options["export"]] = JOIN_RE.search(output).group(1)
                    exporters.append(peer)
                else:
                    assert peer.stop() == 0, peer.output()[-3000:]
    finally:
        for peer in exporters:
            code = peer.stop()
            assert code == 0, peer.output()[-3000:]


@pytest.mark.slow
def test_readme_python_example_generates_from_an_export(tmp_path):
    """The README's generation example, run as written against a folder exported from a real checkpoint."""
    from aux_monitor.export import ExportArguments, export
    from tests.support.model import save_tiny_checkpoint

    texts = [page.read_text() for page in documentation_pages()]
    blocks = [block for text in texts for block in PYTHON_BLOCK_RE.findall(text)]
    assert len(blocks) == sum(text.count("```python\n") for text in texts) == 1, "a python block has no marker"
    [code] = blocks
    assert len([line for line in code.splitlines() if line.strip()]) == 3
    checkpoint = save_tiny_checkpoint(tmp_path / "checkpoints", epoch=4)
    export(ExportArguments(source=checkpoint.path, output=str(tmp_path / "outputs" / "my_model"), verify=False))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "hf-modules"), HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("The swarm") and len(result.stdout.strip()) > len("The swarm")
