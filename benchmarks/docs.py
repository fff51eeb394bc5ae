"""Writes the result tables of docs/benchmarks.md from the measured runs in benchmarks/measured/*.json.

    python -m benchmarks.docs            # rewrite the generated tables of docs/benchmarks.md
    python -m benchmarks.docs --check    # exit 1 if the page differs from what the JSON gives (the docs test)

The page is edited by hand everywhere except between ``<!-- generated: RUN.TABLE -->`` and
``<!-- end generated -->``: that region is the table TABLE of benchmarks/measured/RUN.json, under a line naming
the command that measured it and the date. A run's JSON:

    {"command": "python -m benchmarks.planner", "date": "2026-11-22", "machine": "CPU, 2 threads",
     "tables": {"main": {"columns": [{"name": "model"}, {"name": "seq", "format": "d"}, ...],
                         "rows": [["tiny", 64, ...], ...]}}}

A cell is printed with its column's ``format`` (Python's format spec) when it is a number, as it is otherwise,
and ``null`` as "—". Standard library only, so the check runs in the fast tests.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

from benchmarks.report import markdown_table

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "benchmarks" / "measured"
PAGE = ROOT / "docs" / "benchmarks.md"
REGION_RE = re.compile(
    r"(<!-- generated: (?P<name>[\w-]+)\.(?P<table>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S
)
MISSING = "—"


def load_runs(folder: Path = MEASURED) -> dict[str, dict]:
    """Every measured run, by file name without ``.json``."""
    return {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(folder.glob("*.json"))}


def cell(value, column: dict) -> str:
    if value is None:
        return MISSING
    if isinstance(value, (int, float)) and not isinstance(value, bool) and "format" in column:
        return format(value, column["format"])
    return str(value)


def render_table(run: dict, table_name: str) -> str:
    """The caption (command, date, machine) and the markdown table of one table of a run."""
    table = run["tables"][table_name]
    columns = table["columns"]
    lines = []
    for row in table["rows"]:
        if len(row) != len(columns):
            raise ValueError(f"a row of table {table_name!r} has {len(row)} cells for {len(columns)} columns: {row}")
        lines.append([cell(value, column) for value, column in zip(row, columns)])
    caption = f"Measured {run['date']} with `{run['command']}`" + (f" ({run['machine']})" if run.get("machine") else "")
    return caption + ":\n\n" + markdown_table([column["name"] for column in columns], lines) + "\n"


def render_page(text: str, runs: dict[str, dict]) -> str:
    """``text`` with every generated region rewritten from ``runs``."""

    def replace(match: re.Match) -> str:
        name, table = match.group("name"), match.group("table")
        if name not in runs or table not in runs[name].get("tables", {}):
            raise KeyError(f"docs page asks for {name}.{table}: no such table in {MEASURED.relative_to(ROOT)}/")
        return match.group(1) + render_table(runs[name], table) + match.group(5)

    return REGION_RE.sub(replace, text)


def regions(text: str) -> list[str]:
    """The ``RUN.TABLE`` names of the generated regions of a page, in order."""
    return [f"{m.group('name')}.{m.group('table')}" for m in REGION_RE.finditer(text)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the page is out of date")
    parser.add_argument("--page", type=Path, default=PAGE)
    parser.add_argument("--measured", type=Path, default=MEASURED, help="folder of the runs' JSON files")
    args = parser.parse_args(argv)
    text = args.page.read_text(encoding="utf-8")
    new = render_page(text, load_runs(args.measured))
    if args.check:
        if new != text:
            diff = difflib.unified_diff(text.splitlines(), new.splitlines(), str(args.page), "generated", lineterm="")
            print("\n".join(diff))
            print(f"\n{args.page} is out of date: run `python -m benchmarks.docs`", file=sys.stderr)
            return 1
        return 0
    if new != text:
        args.page.write_text(new, encoding="utf-8")
    print(f"{args.page}: {len(regions(new))} tables from {args.measured}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
