"""Rows of the memory benchmark: ratios to the references, targets, markdown, JSON and the chart."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

KIB, MIB = 1024, 1024**2


@dataclasses.dataclass
class Row:
    """One measured (or skipped) variant; every figure is None when the variant was skipped."""

    variant: str
    # "main" (the comparison table) or "depth" (reversible growth-with-depth check at the tiny size)
    kind: str = "main"
    layers: int | None = None
    # tokens per step (batch x sequence)
    tokens: int | None = None
    # bytes saved for backward per layer per token: (saved at full - at half depth) / layers / tokens;
    # for depth rows, the same difference between the two depths of the check
    saved_bytes_per_layer_per_token: float | None = None
    # bytes saved for backward by the whole model at `layers` depth, and grouped by shape:
    # [shape and dtype, number of storages, bytes], largest first
    saved_bytes_total: int | None = None
    saved_breakdown: list = dataclasses.field(default_factory=list)
    # peak live tensor bytes during forward + loss + backward, parameters and gradients excluded
    activation_peak_bytes: int | None = None
    # the same peak counting the parameter gradients backward adds into the pre-allocated .grad
    live_peak_bytes: int | None = None
    # median seconds of a timed step (forward + loss + backward), and each timed step
    step_seconds: float | None = None
    step_seconds_all: list[float] = dataclasses.field(default_factory=list)
    # torch.cuda.max_memory_allocated during a step minus what was allocated before it (CUDA only)
    cuda_peak_bytes: int | None = None
    checkpointed: bool = False
    autocast: str | None = None
    # why the variant was not measured
    skipped: str | None = None
    # filled by add_ratios / evaluate_targets
    memory_reference: str | None = None
    time_reference: str | None = None
    saved_ratio: float | None = None
    peak_ratio: float | None = None
    cuda_peak_ratio: float | None = None
    time_ratio: float | None = None
    # what the target requires, e.g. "saved<=0.28 peak<=0.3"; whether it was met; the table's cell
    target: str | None = None
    passed: bool | None = None
    verdict: str = ""


# Targets from issue 2, as ratios to the row's references; they are set for the default size.
TARGETS = {
    "lean_default": {"saved_ratio": 0.28, "peak_ratio": 0.30, "time_ratio": 1.10},
    "lean_ckpt": {"saved_ratio": 1.0},
}
DEPTH_TARGET = {"saved_ratio": 1.1, "peak_ratio": 1.1}
# activation peak of a row against another lean row of the same run (issue 14: chunked reversible backward)
PEAK_VS_ROW_TARGETS = {"lean_reversible_chunked": ("lean_reversible", 0.6)}
RATIO_LABELS = {"saved_ratio": "saved", "peak_ratio": "peak", "time_ratio": "time"}


def _dtype_suffix(row: Row) -> str:
    return f"_{row.autocast}" if row.autocast else ""


def _ratio(value, reference):
    if value is None or reference is None or reference == 0:
        return None
    return value / reference


def add_ratios(rows: list[Row]) -> None:
    """Ratios of each row to its references in the same run.

    Memory: HF GPT-2 eager (checkpointed rows: HF GPT-2 eager with checkpointing); time: HF GPT-2
    SDPA (checkpointed rows: SDPA with checkpointing); autocast rows use the references with the
    same autocast dtype. Depth rows compare with the shallowest depth of the check.
    """
    by_name = {row.variant: row for row in rows if row.skipped is None}
    depth_rows = [row for row in rows if row.kind == "depth" and row.skipped is None]
    shallow = min(depth_rows, key=lambda row: row.layers) if depth_rows else None
    for row in rows:
        if row.skipped is not None:
            continue
        if row.kind == "depth":
            row.memory_reference = shallow.variant
            row.saved_ratio = _ratio(row.saved_bytes_total, shallow.saved_bytes_total)
            row.peak_ratio = _ratio(row.activation_peak_bytes, shallow.activation_peak_bytes)
            continue
        ckpt = "_ckpt" if row.checkpointed else ""
        row.memory_reference = f"hf_gpt2_eager{ckpt}{_dtype_suffix(row)}"
        row.time_reference = f"hf_gpt2_sdpa{ckpt}{_dtype_suffix(row)}"
        memory_ref, time_ref = by_name.get(row.memory_reference), by_name.get(row.time_reference)
        if memory_ref is not None:
            row.saved_ratio = _ratio(row.saved_bytes_per_layer_per_token, memory_ref.saved_bytes_per_layer_per_token)
            row.peak_ratio = _ratio(row.activation_peak_bytes, memory_ref.activation_peak_bytes)
            row.cuda_peak_ratio = _ratio(row.cuda_peak_bytes, memory_ref.cuda_peak_bytes)
        if time_ref is not None:
            row.time_ratio = _ratio(row.step_seconds, time_ref.step_seconds)


def _evaluate_peak_vs_row(row: Row, by_name: dict[str, Row]) -> None:
    other_name, limit = PEAK_VS_ROW_TARGETS[row.variant]
    row.target = f"peak<={limit:g}x {other_name}"
    other = by_name.get(other_name)
    ratio = None if other is None else _ratio(row.activation_peak_bytes, other.activation_peak_bytes)
    if ratio is None:
        row.verdict = f"n/a ({other_name} missing; need {row.target})"
        return
    row.passed = ratio <= limit
    row.verdict = ("PASS" if row.passed else "FAIL") + f": peak {ratio:.2f}x {other_name}"


def evaluate_targets(rows: list[Row]) -> None:
    """Set ``target``, ``passed`` and ``verdict`` on the rows that have a target."""
    by_name = {row.variant: row for row in rows if row.skipped is None}
    for row in rows:
        if row.variant in PEAK_VS_ROW_TARGETS and row.kind == "main" and row.skipped is None:
            _evaluate_peak_vs_row(row, by_name)
    deepest = max((row for row in rows if row.kind == "depth"), key=lambda row: row.layers or 0, default=None)
    for row in rows:
        limits = TARGETS.get(row.variant) if row.kind == "main" else (DEPTH_TARGET if row is deepest else None)
        if limits is None or row.skipped is not None:
            continue
        row.target = " ".join(f"{RATIO_LABELS[name]}<={limit:g}" for name, limit in limits.items())
        ratios = {name: getattr(row, name) for name in limits}
        if None in ratios.values():
            row.verdict = f"n/a (reference missing; need {row.target})"
            continue
        failed = [
            f"{RATIO_LABELS[name]} {ratios[name]:.2f} > {limit:g}"
            for name, limit in limits.items()
            if ratios[name] > limit
        ]
        row.passed = not failed
        row.verdict = "PASS" if row.passed else "FAIL: " + ", ".join(failed)


def _fmt(value, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value / scale:.{digits}f}"


def path_list(text: str) -> list[Path]:
    """An argparse type: comma-separated files (the saved rows of several runs printed as one table)."""
    return [Path(part) for part in text.split(",") if part]


def markdown_table(header: list[str], lines: list[list[str]]) -> str:
    """A markdown table of already formatted cells (every benchmark's printed table)."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return "\n".join(out)


def main_table(rows: list[Row], with_cuda: bool) -> str:
    header = [
        "variant",
        "saved KiB/layer/token",
        "x ref (hf eager / hf eager ckpt)",
        "act. peak MiB",
        "x ref",
        "step s",
        "x hf sdpa (/ sdpa ckpt)",
    ]
    if with_cuda:
        header += ["cuda peak MiB", "x ref"]
    header.append("target")
    lines = []
    for row in rows:
        if row.kind != "main":
            continue
        if row.skipped is not None:
            lines.append([row.variant, f"skipped: {row.skipped}"] + [""] * (len(header) - 2))
            continue
        line = [
            row.variant,
            _fmt(row.saved_bytes_per_layer_per_token, KIB, 1),
            _fmt(row.saved_ratio),
            _fmt(row.activation_peak_bytes, MIB, 1),
            _fmt(row.peak_ratio),
            _fmt(row.step_seconds, 1, 3),
            _fmt(row.time_ratio),
        ]
        if with_cuda:
            line += [_fmt(row.cuda_peak_bytes, MIB, 1), _fmt(row.cuda_peak_ratio)]
        lines.append(line + [row.verdict])
    return markdown_table(header, lines)


def depth_table(rows: list[Row]) -> str:
    header = [
        "variant",
        "layers",
        "saved KiB/token (whole model)",
        "x shallowest",
        "act. peak MiB",
        "x shallowest",
        "step s",
        "target",
    ]
    lines = []
    for row in rows:
        if row.kind != "depth":
            continue
        if row.skipped is not None:
            lines.append([row.variant, "", f"skipped: {row.skipped}"] + [""] * (len(header) - 3))
            continue
        tokens_kib = row.saved_bytes_total / row.tokens / KIB
        lines.append(
            [
                row.variant,
                str(row.layers),
                f"{tokens_kib:.2f}",
                _fmt(row.saved_ratio),
                _fmt(row.activation_peak_bytes, MIB, 2),
                _fmt(row.peak_ratio),
                _fmt(row.step_seconds, 1, 3),
                row.verdict,
            ]
        )
    return markdown_table(header, lines)


def breakdown_text(rows: list[Row], top: int = 8) -> str:
    """The largest groups of saved storages (by shape) of each measured row, whole model at full depth."""
    lines = []
    for row in rows:
        if row.skipped is None and row.saved_breakdown:
            lines.append(f"{row.variant} ({row.layers} layers, {row.saved_bytes_total / KIB:.1f} KiB saved):")
            lines += [
                f"    {count:4d} x {shape:<28} {nbytes / KIB:10.1f} KiB"
                for shape, count, nbytes in row.saved_breakdown[:top]
            ]
    return "\n".join(lines)


def write_json(rows: list[Row], path: Path, meta: dict) -> None:
    """A JSON list with one object per row (``meta`` fields such as size and device on each)."""
    payload = [{**dataclasses.asdict(row), **meta} for row in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))


def write_chart(rows: list[Row], path: Path, title: str) -> None:
    """Grouped bars of the three ratios per variant, and the reversible depth ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = [row for row in rows if row.kind == "main" and row.skipped is None]
    depth = [row for row in rows if row.kind == "depth" and row.skipped is None]
    fig, (ax_main, ax_depth) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [4, 1]})
    metrics = [("saved_ratio", "saved/layer/token"), ("peak_ratio", "activation peak"), ("time_ratio", "step time")]
    width = 0.8 / len(metrics)
    for index, (name, label) in enumerate(metrics):
        values = [getattr(row, name) or 0.0 for row in main]
        ax_main.bar([i + (index - 1) * width for i in range(len(main))], values, width, label=label)
    ax_main.axhline(1.0, color="black", linewidth=0.8)
    ax_main.set_xticks(range(len(main)), [row.variant for row in main], rotation=30, ha="right")
    ax_main.set_ylabel("ratio to HF GPT-2 reference (lower is better)")
    ax_main.set_title(title)
    ax_main.legend()
    deep = [row for row in depth if row.peak_ratio is not None]
    labels = [f"{row.layers}L {kind}" for row in deep for kind in ("saved", "peak")]
    values = [value for row in deep for value in (row.saved_ratio or 0.0, row.peak_ratio or 0.0)]
    ax_depth.bar(range(len(values)), values, color="tab:purple")
    ax_depth.axhline(DEPTH_TARGET["peak_ratio"], color="red", linewidth=0.8, linestyle="--", label="target 1.1")
    ax_depth.set_xticks(range(len(values)), labels, rotation=30, ha="right")
    ax_depth.set_title("reversible: x shallowest depth")
    if not deep:
        ax_depth.text(0.5, 0.5, "not measured\n(see table)", ha="center", va="center", transform=ax_depth.transAxes)
    ax_depth.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
