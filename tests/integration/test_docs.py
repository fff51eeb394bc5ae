"""The documentation's own checks, in a second: links resolve, the README stays short, generated tables are current."""

import json
import re
from pathlib import Path

import pytest

from benchmarks import docs

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) and ![alt](target), outside code; a target may end in #anchor
LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE_RE = re.compile(r"```.*?```", re.S)
CODE_RE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def anchors(page: Path) -> set:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCE_RE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def links(page: Path) -> list:
    return LINK_RE.findall(CODE_RE.sub("", page.read_text()))


@pytest.mark.parametrize("page", [*PAGES, ROOT / "benchmarks" / "README.md"], ids=lambda page: page.name)
def test_every_relative_link_resolves(page):
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here (no network)
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: link to {target!r}, which does not exist"
        if anchor and resolved.suffix == ".md":
            assert anchor in anchors(resolved), f"{page.name}: no heading for #{anchor} in {resolved.name}"


def test_the_readme_is_short_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links(ROOT / "README.md")}
    for page in PAGES[1:]:
        assert page.resolve() in linked, f"README.md does not link docs/{page.name}"


def test_the_benchmark_page_matches_the_measured_json():
    """The golden-file check: regenerating docs/benchmarks.md from benchmarks/measured/ changes nothing."""
    assert docs.main(["--check"]) == 0, "docs/benchmarks.md is out of date: run `python -m benchmarks.docs`"
    text = docs.PAGE.read_text()
    runs = docs.load_runs()
    used = docs.regions(text)
    assert len(used) == len(set(used)), "a table is generated twice"
    assert set(used) == {f"{name}.{table}" for name, run in runs.items() for table in run["tables"]}, (
        "every measured table is shown once"
    )
    for run in runs.values():
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", run["date"]) and run["command"], run


def test_a_generated_table_names_its_command_and_date_and_formats_its_columns():
    run = {
        "command": "python -m benchmarks.x --fast",
        "date": "2026-01-02",
        "machine": "2 cores",
        "tables": {
            "t": {
                "columns": [{"name": "mode"}, {"name": "n", "format": "d"}, {"name": "loss", "format": ".3f"}],
                "rows": [["sync", 2, 7.6], ["solo", 1, None]],
            }
        },
    }
    page = "intro\n<!-- generated: x.t -->\nstale\n<!-- end generated -->\nafter\n"
    out = docs.render_page(page, {"x": run})
    assert out == (
        "intro\n<!-- generated: x.t -->\n"
        "Measured 2026-01-02 with `python -m benchmarks.x --fast` (2 cores):\n\n"
        "| mode | n | loss |\n|---|---|---|\n| sync | 2 | 7.600 |\n| solo | 1 | — |\n"
        "<!-- end generated -->\nafter\n"
    )
    assert docs.render_page(out, {"x": run}) == out, "regenerating is idempotent"
    with pytest.raises(KeyError):
        docs.render_page(page, {})


def test_every_measured_table_reads_back_from_its_markdown():
    """What --record stores from a benchmark's printed table renders to that table, and back (no drift)."""
    for name, run in docs.load_runs().items():
        for table_name, table in run["tables"].items():
            assert docs.parse_markdown_tables(docs.table_markdown(table)) == [table], f"{name}.{table_name}"
        assert docs.run_json(run) == (docs.MEASURED / f"{name}.json").read_text(), f"{name}.json is not as written"


def test_record_stores_a_printed_table_and_keeps_the_runs_other_tables(tmp_path):
    printed = (
        "command: python -m benchmarks.x\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
        "| mode | samples/s | x bound |\n|---|---|---|\n| solo | 2.80 | — |\n| mode | samples/s | x bound |\n"
        "| sync | 3.09 | 2.12 |\n"
    )
    docs.record(tmp_path, "x.first", printed, 1, "python -m benchmarks.x", "2026-01-02", None)
    path = docs.record(tmp_path, "x.second", printed, 2, "python -m benchmarks.x", "2026-01-02", "2 cores")
    run = docs.load_runs(tmp_path)["x"]
    assert list(run["tables"]) == ["first", "second"] and run["machine"] == "2 cores"
    second = run["tables"]["second"]
    assert second["columns"] == [
        {"name": "mode"},
        {"name": "samples/s", "format": ".2f"},
        {"name": "x bound", "format": ".2f"},
    ]
    assert second["rows"] == [["solo", 2.8, "—"], ["sync", 3.09, 2.12]], "the repeated header row is dropped"
    assert docs.table_markdown(second) in printed.replace("| mode | samples/s | x bound |\n| sync", "| sync")
    docs.record(tmp_path, "x.first", printed, 1, "python -m benchmarks.x --new", "2026-02-03", None)
    assert list(json.loads(path.read_text())["tables"]) == ["first"], "a new run does not keep the old run's tables"
    with pytest.raises(ValueError):
        docs.record(tmp_path, "x.third", printed, 3, "python -m benchmarks.x", "2026-01-02", None)
    with pytest.raises(ValueError):
        docs.record(tmp_path, "x", printed, 1, "python -m benchmarks.x", "2026-01-02", None)
