"""Writes the result tables of docs/benchmarks.md from the measured runs in benchmarks/measured/*.json.

    python -m benchmarks.docs            # rewrite the generated tables of docs/benchmarks.md
    python -m benchmarks.docs --check    # exit 1 if the page differs from what the JSON gives (the docs test)
    python -m benchmarks.swarm --from_json rows.json | python -m benchmarks.docs --record swarm_sync.main \\
        --command "sudo .venv/bin/python -m benchmarks.swarm ..." --date 2026-11-22 --machine "2 cores"

The page is edited by hand everywhere except between ``<!-- generated: RUN.TABLE -->`` and
``<!-- end generated -->``: that region is the table TABLE of benchmarks/measured/RUN.json, under a line naming
the command that measured it and the date. A run's JSON:

    {"command": "python -m benchmarks.planner", "date": "2026-11-22", "machine": "CPU, 2 threads",
     "tables": {"main": {"columns": [{"name": "model"}, {"name": "seq", "format": "d"}, ...],
                         "rows": [["tiny", 64, ...], ...]}}}

A cell is printed with its column's ``format`` (Python's format spec) when it is a number, as it is otherwise,
and ``null`` as "—". ``--record`` stores a table a benchmark printed (every benchmark prints markdown; the
``--nth`` table of standard input): cells that are plain numbers become numbers, and a column whose numbers all
have the same number of decimals gets that format, so the page shows the table as the benchmark printed it.
Standard library only, so the check runs in the fast tests.
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
NUMBER_RE = re.compile(r"-?\d+(?:\.(\d+))?")
DATE_RE = re.compile(r"\d{4}-\d{2}-\d{2}")


def load_runs(folder: Path = MEASURED) -> dict[str, dict]:
    """Every measured run, by file name without ``.json``."""
    return {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(folder.glob("*.json"))}


def cell(value, column: dict) -> str:
    if value is None:
        return MISSING
    if isinstance(value, (int, float)) and not isinstance(value, bool) and "format" in column:
        return format(value, column["format"])
    return str(value)


def table_markdown(table: dict) -> str:
    columns = table["columns"]
    lines = []
    for row in table["rows"]:
        if len(row) != len(columns):
            raise ValueError(f"a row has {len(row)} cells for {len(columns)} columns: {row}")
        lines.append([cell(value, column) for value, column in zip(row, columns)])
    return markdown_table([column["name"] for column in columns], lines)


def render_table(run: dict, table_name: str) -> str:
    """The caption (date, command, machine) and the markdown table of one table of a run."""
    caption = f"Measured {run['date']} with `{run['command']}`" + (f" ({run['machine']})" if run.get("machine") else "")
    return caption + ":\n\n" + table_markdown(run["tables"][table_name]) + "\n"


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


def parse_markdown_tables(text: str) -> list[dict]:
    """Every markdown table in ``text`` (a benchmark's printed output) as ``{"columns", "rows"}``.

    A repeated header row inside a table is dropped. A cell that is a plain number becomes a number; a column
    whose numbers all have the same number of decimals gets that format (``d`` for integers), and in a column
    without one every cell stays the text it was, so that rendering the table prints the same cells.
    """
    tables, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if not (lines[i].startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|(?:-+\|)+", lines[i + 1])):
            i += 1
            continue
        split = [[c.strip() for c in line.strip()[1:-1].split("|")] for line in lines[i : i + 2]]
        header, separator, body = split[0], split[1], []
        i += 2
        while i < len(lines) and lines[i].startswith("|"):
            row = [c.strip() for c in lines[i].strip()[1:-1].split("|")]
            if row != header and row != separator:
                body.append(row)
            i += 1
        columns = []
        for j, name in enumerate(header):
            numbers = [m for m in (NUMBER_RE.fullmatch(row[j]) for row in body) if m]
            decimals = {len(m.group(1)) if m.group(1) is not None else None for m in numbers}
            column = {"name": name}
            if numbers and len(decimals) == 1:
                places = decimals.pop()
                column["format"] = "d" if places is None else f".{places}f"
            columns.append(column)
        rows = [
            [
                (int(value) if column["format"] == "d" else float(value))
                if "format" in column and NUMBER_RE.fullmatch(value)
                else value
                for value, column in zip(row, columns)
            ]
            for row in body
        ]
        tables.append({"columns": columns, "rows": rows})
    return tables


def run_json(run: dict) -> str:
    """A run as JSON with one column and one row per line, so a new measurement reads well in a diff."""

    def rows(items: list, indent: str) -> list[str]:
        return [
            indent + json.dumps(item, ensure_ascii=False) + ("," if k < len(items) - 1 else "")
            for k, item in enumerate(items)
        ]

    out = ["{"] + [f" {json.dumps(key)}: {json.dumps(run[key], ensure_ascii=False)}," for key in run if key != "tables"]
    out.append(' "tables": {')
    for k, (name, table) in enumerate(run["tables"].items()):
        out += [f"  {json.dumps(name)}: {{", '   "columns": [', *rows(table["columns"], "    "), "   ],"]
        out += [
            '   "rows": [',
            *rows(table["rows"], "    "),
            "   ]",
            "  }" + ("," if k < len(run["tables"]) - 1 else ""),
        ]
    return "\n".join(out + [" }", "}"]) + "\n"


def record(folder: Path, target: str, text: str, nth: int, command: str, date: str, machine: str | None) -> Path:
    """Store the ``nth`` (1-based) markdown table of ``text`` as table TABLE of run RUN (``target`` = RUN.TABLE)."""
    name, _, table_name = target.partition(".")
    if not (name and table_name):
        raise ValueError(f"--record takes RUN.TABLE (e.g. swarm_sync.main), not {target!r}")
    if not DATE_RE.fullmatch(date):
        raise ValueError(f"--date must be YYYY-MM-DD, not {date!r}")
    tables = parse_markdown_tables(text)
    if not 1 <= nth <= len(tables):
        raise ValueError(f"the input has {len(tables)} markdown tables; --nth {nth} is not one of them")
    path = folder / f"{name}.json"
    old = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    if old and (old["command"], old["date"]) != (command, date):
        old = {}  # another run: its other tables are not this run's
    run = {"command": command, "date": date, **({"machine": machine} if machine else {})}
    run["tables"] = {**old.get("tables", {}), table_name: tables[nth - 1]}
    path.write_text(run_json(run), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the page is out of date")
    parser.add_argument("--page", type=Path, default=PAGE)
    parser.add_argument("--measured", type=Path, default=MEASURED, help="folder of the runs' JSON files")
    parser.add_argument("--record", metavar="RUN.TABLE", help="store a markdown table read from stdin, then rewrite")
    parser.add_argument("--nth", type=int, default=1, help="with --record: which table of the input (default 1)")
    parser.add_argument("--command", help="with --record: the command that measured it")
    parser.add_argument("--date", help="with --record: when, as YYYY-MM-DD")
    parser.add_argument("--machine", help="with --record: the machine and settings, e.g. '2-core CPU, torch 2.13.0'")
    args = parser.parse_args(argv)
    if args.record:
        if not (args.command and args.date):
            parser.error("--record needs --command and --date")
        try:
            path = record(args.measured, args.record, sys.stdin.read(), args.nth, args.command, args.date, args.machine)
        except ValueError as error:
            parser.error(str(error))
        print(f"recorded {args.record} in {path}")
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
