"""The architecture, checked: layers import only what they may (benchmarks/ no test code), no cycles, hivemind
overrides in one seam."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Set

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "peer", "aux_monitor", "configs")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> Set[str]:
    """Every module this file imports, at any depth (function-level imports included)."""
    found = set()
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(filter(None, [*anchor, base]))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # "from peer import backup"
    return found


@pytest.fixture(scope="module")
def graph() -> Dict[str, Set[str]]:
    files = [path for package in PACKAGES for path in (REPO_ROOT / package).rglob("*.py")]
    modules = {_module_name(path): path for path in files}
    return {name: {imported for imported in _imports(path) if imported in modules} for name, path in modules.items()}


def find_cycle(graph: Dict[str, Set[str]]) -> list:
    """One import cycle of ``graph`` (module -> imported modules) as a path, or [] if there is none."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list) -> list:
        state[module] = 1
        for imported in sorted(graph.get(module, ())):
            if imported == module:
                continue
            if state.get(imported) == 1:
                return path[path.index(imported) :] + [imported]
            if imported not in state:
                cycle = visit(imported, path + [imported])
                if cycle:
                    return cycle
        state[module] = 2
        return []

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [module])
            if cycle:
                return cycle
    return []


def test_cycle_finder_finds_a_hidden_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle_among_the_projects_modules(graph):
    cycle = find_cycle(graph)
    assert not cycle, "import cycle (function-level imports included): " + " -> ".join(cycle)


def test_aux_peer_imports_only_the_swarm_layer_and_the_model(graph):
    for module, imported in graph.items():
        if module.startswith("aux_monitor"):
            others = {
                name
                for name in imported
                if not name.startswith(("aux_monitor", "peer.swarm", "model")) and name != "peer"
            }
            assert not others, (
                f"{module} imports {sorted(others)}; the aux peer may use peer.swarm (the shared layer) and model only"
            )


def test_swarm_layer_imports_neither_application(graph):
    for module, imported in graph.items():
        if module.startswith("peer.swarm"):
            bad = {
                name
                for name in imported
                if name.startswith("aux_monitor") or (name.startswith("peer.") and not name.startswith("peer.swarm"))
            }
            assert not bad, f"{module} (shared swarm layer) imports application modules {sorted(bad)}"


def test_model_knows_nothing_of_hivemind_or_the_peers():
    for path in (REPO_ROOT / "model").rglob("*.py"):
        bad = {name for name in _imports(path) if name.split(".")[0] in ("hivemind", "peer", "aux_monitor")}
        assert not bad, f"{path.relative_to(REPO_ROOT)} imports {sorted(bad)}; model/ has no training or network code"


def test_no_production_module_imports_tests_or_the_testbed():
    production = [path for package in PACKAGES for path in (REPO_ROOT / package).rglob("*.py")]
    production += [REPO_ROOT / "run_trainer.py", REPO_ROOT / "run_aux_peer.py"]
    for path in production:
        bad = {name for name in _imports(path) if name.split(".")[0] in ("tests", "helpers", "benchmarks")}
        assert not bad, f"{path.relative_to(REPO_ROOT)} imports test or benchmark code {sorted(bad)}"


def test_benchmarks_import_no_test_code():
    """benchmarks/ (the test-bed package benchmarks/testbed/ included) imports nothing from tests/: what tests and
    benchmarks share lives in the test-bed, so a benchmark runs without the test suite."""
    files = sorted((REPO_ROOT / "benchmarks").rglob("*.py"))
    assert REPO_ROOT / "benchmarks" / "testbed" / "faults" / "scenarios.py" in files
    for path in files:
        bad = {name for name in _imports(path) if name.split(".")[0] == "tests"}
        assert not bad, f"{path.relative_to(REPO_ROOT)} imports test code {sorted(bad)}; move it to benchmarks/testbed/"


def test_hivemind_classes_are_subclassed_only_in_the_seam():
    seam = REPO_ROOT / "peer" / "swarm" / "hivemind_seam"
    for package in ("peer", "aux_monitor", "model"):
        for path in (REPO_ROOT / package).rglob("*.py"):
            if seam in path.parents:
                continue
            tree = ast.parse(path.read_text())
            from_hivemind = {
                alias.asname or alias.name
                for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hivemind")
                for alias in node.names
            }
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    for base in node.bases:
                        text = ast.unparse(base)
                        assert not (text.startswith("hivemind.") or text in from_hivemind), (
                            f"{path.relative_to(REPO_ROOT)}: class {node.name}({text}) subclasses hivemind; "
                            "overrides of hivemind belong in peer/swarm/hivemind_seam/"
                        )


def _hivemind_private_names() -> Set[str]:
    """Single-underscore names hivemind's source defines: functions, methods, and attributes it assigns."""
    import hivemind

    pattern = re.compile(r"\bdef\s+(_[A-Za-z]\w*)|\bself\.(_[A-Za-z]\w*)\s*[:=]|^\s*(_[A-Za-z]\w*)\s*[:=]", re.M)
    names = set()
    for path in Path(hivemind.__file__).parent.rglob("*.py"):
        for match in pattern.finditer(path.read_text()):
            names.add(next(group for group in match.groups() if group))
    return names


def _own_private_names(trees) -> Set[str]:
    """Single-underscore names LeanHive's code (outside the seam) defines itself."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def test_hivemind_private_names_appear_only_in_the_seam():
    """Production code, the run scripts and benchmarks/ reach hivemind's internals only through
    peer/swarm/hivemind_seam/ (whose tests pin each one), and the test-bed only through its own fault seam,
    benchmarks/testbed/hivemind_faults.py (pinned by tests/testbed/test_testbed.py). Flagged outside them: an
    attribute, a string (getattr, setattr) or an import naming a private hivemind name that LeanHive does not define
    itself, and any use or override of the seam's inventory (the private names in OVERRIDDEN_METHODS and
    PRIVATE_ATTRIBUTES). tests/ is not scanned: its seam tests exercise the overrides directly
    (_parse_swarm_progress_data, _local_public_key, _get_handle_name, _load_local_grads_into_optimizer_)."""
    from peer.swarm import hivemind_seam

    seam = REPO_ROOT / "peer" / "swarm" / "hivemind_seam"
    fault_seam = REPO_ROOT / "benchmarks" / "testbed" / "hivemind_faults.py"
    paths = [path for package in (*PACKAGES, "benchmarks") for path in (REPO_ROOT / package).rglob("*.py")]
    paths = [path for path in paths + sorted(REPO_ROOT.glob("run_*.py")) if seam not in path.parents]
    paths = [path for path in paths if path != fault_seam]
    trees = {path: ast.parse(path.read_text()) for path in paths}
    inventory = {name for _, name, _ in hivemind_seam.OVERRIDDEN_METHODS} | {
        name for _, _, name in hivemind_seam.PRIVATE_ATTRIBUTES
    }
    inventory = {name for name in inventory if name.startswith("_") and not name.startswith("__")}
    private = (_hivemind_private_names() - _own_private_names(trees.values())) | inventory
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hivemind"):
                names = [alias.name for alias in node.names if alias.name.startswith("_")]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [node.name] if node.name in inventory else []
            else:
                continue
            found += [f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {name}" for name in names if name in private]
    assert not found, "hivemind private names outside peer/swarm/hivemind_seam/ (add a public seam API):\n" + "\n".join(
        found
    )
