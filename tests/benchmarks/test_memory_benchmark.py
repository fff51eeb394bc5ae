"""The memory benchmark: its accountants on cases with known sizes, and smoke runs of its CLI, the ablation report
and the generation benchmark.

No performance assertions: the benchmark measures, these tests check that what it counts is right
and that one command produces the table, the JSON rows and the chart.
"""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks.memory import MemoryBenchConfig
from benchmarks.variants import SIZES, base_variants
from peer import memlib

REPO = Path(__file__).resolve().parents[2]
FLOAT = 4  # bytes per fp32 element


def test_live_peak_counts_each_storage_once_until_freed():
    x = torch.randn(1000)
    with memlib.LiveTensorPeak(memlib.storage_keys([x])) as live:
        a = x * 2  # +4000
        b = a + 1  # +4000 -> 8000 (peak)
        del a  # -4000
        c = b.exp()  # +4000 -> 8000
        b.add_(1)  # in place: same storage
        view = c.view(10, 100)  # view: same storage
        x.mul_(3)  # excluded storage
        del b, c
        assert live.current_bytes == 1000 * FLOAT  # the view keeps c's storage alive
        del view
    assert live.current_bytes == 0
    assert live.peak_bytes == 2 * 1000 * FLOAT


def test_saved_counter_counts_distinct_storages_and_skips_parameters():
    weight = torch.nn.Parameter(torch.randn(100, 100))
    inputs = torch.randn(8, 100)
    with memlib.SavedTensorCounter(memlib.storage_keys([weight])) as saved:
        # matmul saves inputs (and the excluded weight); tanh saves its output, which sin saves too
        out = torch.tanh(inputs @ weight).sin()
    assert saved.total_bytes == 2 * 8 * 100 * FLOAT
    del out


class TiedToyLM(torch.nn.Module):
    """Embedding -> tied output projection -> cross-entropy; every size is known."""

    def __init__(self, vocab=1000, dim=256):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids, labels):
        logits = self.head(self.embed(input_ids))
        return SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def test_measured_step_excludes_parameters_and_gradients():
    model, tokens, vocab, dim = TiedToyLM(), 4, 1000, 256
    input_ids = torch.randint(0, vocab, (1, tokens))
    memory = memlib.measured_step(model, input_ids)
    weight_bytes = vocab * dim * FLOAT
    logits_bytes = tokens * vocab * FLOAT
    # saved: embedding output (for the head) + log-softmax output; nll_loss adds a scalar or two
    assert 0 <= memory.saved_bytes - (tokens * dim * FLOAT + logits_bytes) <= 16
    # a handful of logits-sized buffers, nowhere near one weight (1 MB) although two weight-sized
    # gradients (head and embedding, summed into the tied .grad) exist during backward
    assert logits_bytes <= memory.activation_peak_bytes <= 4 * logits_bytes
    assert memory.live_peak_bytes >= memory.activation_peak_bytes + 2 * weight_bytes
    # gradients accumulated into the pre-allocated .grad, which is zeroed afterwards for the next step
    assert model.embed.weight.grad is not None and not model.embed.weight.grad.any()


def test_hf_gpt2_eager_saved_bytes_match_the_analytic_count():
    """8 d + heads x seq + 5 f + 4 floats per token per layer (the 144 KiB of the issue at the default size)."""
    size = SIZES["tiny"]
    hf_eager = next(variant for variant in base_variants() if variant.name == "hf_gpt2_eager")
    input_ids = torch.randint(0, size.vocab_size, (size.batch_size, size.seq_len))
    saved = [memlib.forward_saved_bytes(hf_eager.build(size, layers), input_ids) for layers in (2, 1)]
    per_layer_per_token = (saved[0] - saved[1]) / size.tokens
    # ln1 in/out, qkv (3d), merged heads, ln2 in/out: 8d; softmax probs; gelu_new input, tanh,
    # 0.5x, 1+tanh and output: 5f; mean and rstd of both layer norms: 4
    expected = (8 * size.hidden_size + size.num_heads * size.seq_len + 5 * size.intermediate_size + 4) * FLOAT
    assert per_layer_per_token == expected


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"size": "huge"}, "valid sizes"),
        ({"steps": 0}, "--steps"),
        ({"variants": ("lean_fast",)}, "valid:"),
        ({"depth_layers": (48, 4)}, "SHALLOW < DEEP"),
    ],
)
def test_config_rejects_bad_values_with_a_hint(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MemoryBenchConfig(**kwargs)


def test_cli_smoke_tiny(tmp_path):
    json_path, plot_path = tmp_path / "rows.json", tmp_path / "chart.png"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.memory",
            "--size",
            "tiny",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--threads",
            "1",
            "--depth-layers",
            "2,6",
            "--json",
            str(json_path),
            "--plot",
            str(plot_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    assert "| variant | saved KiB/layer/token" in result.stdout
    assert "Skipped on CPU (CUDA only)" in result.stdout or not torch.cuda.is_available()
    rows = json.loads(json_path.read_text())
    names = [row["variant"] for row in rows]
    assert names == [variant.name for variant in base_variants()] + ["lean_reversible_L2", "lean_reversible_L6"]
    for row in rows:
        assert {"variant", "saved_bytes_per_layer_per_token", "activation_peak_bytes", "step_seconds"} <= row.keys()
        if row["skipped"] is None:
            # a reversible stack may save nothing per layer, so only the type is checked here
            assert isinstance(row["saved_bytes_per_layer_per_token"], (int, float))
            assert row["activation_peak_bytes"] > 0 and row["step_seconds"] > 0
    measured = {row["variant"]: row for row in rows if row["skipped"] is None}
    assert {
        "hf_gpt2_eager",
        "hf_gpt2_sdpa",
        "hf_gpt2_eager_ckpt",
        "hf_gpt2_sdpa_ckpt",
        "lean_default",
    } <= measured.keys()
    assert measured["hf_gpt2_eager"]["saved_ratio"] == 1.0
    assert measured["lean_default"]["memory_reference"] == "hf_gpt2_eager"
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback of --device cuda")
def test_cli_cuda_request_falls_back_to_cpu_and_says_so(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.memory",
            "--size",
            "tiny",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--threads",
            "1",
            "--device",
            "cuda",
            "--variants",
            "hf_gpt2_sdpa",
            "--depth-layers",
            "1,2",
            "--plot",
            str(tmp_path / "chart.png"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    assert "CUDA requested but not available: running on CPU." in result.stdout
    assert "Skipped on CPU (CUDA only)" in result.stdout
    assert "| hf_gpt2_sdpa |" in result.stdout and "_bf16" not in result.stdout


def test_ablation_report_smoke_tiny(tmp_path, capsys):
    from benchmarks import ablation

    rows = ablation.main(["--size", "tiny", "--threads", "1", "--plot", str(tmp_path / "ablation.png")])
    by_option = {row["option"]: row for row in rows}
    assert rows[0]["option"] == "plain" and rows[0]["peak_ratio"] == 1.0
    assert by_option["sharing"]["parameter_ratio"] < 1.0  # the exact figures are the benchmark's business
    # mixed precision is measured on CPU too (below the default size): autocast saves half-precision activations
    assert by_option["mixed_precision_bf16"]["peak_ratio"] < 1.0 and "mixed_precision_fp16" in by_option
    assert (tmp_path / "ablation.png").stat().st_size > 0
    assert "8-bit LAMB in CPU RAM" in capsys.readouterr().out


def test_generation_benchmark_smoke(tmp_path, capsys):
    """One small run of the generation benchmark: the table, the JSON rows and the chart (no timing asserted)."""
    from benchmarks import generation

    argv = ["--prompts", "8,24", "--new_tokens", "2", "--repeats", "1", "--hidden_size", "32", "--num_layers", "1"]
    argv += ["--vocab_size", "64", "--json", str(tmp_path / "rows.json"), "--plot", str(tmp_path / "gen.png")]
    assert generation.main(argv) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert {(r["variant"], r["prompt"]) for r in rows} == {
        (variant, prompt) for variant in ("lean_cache", "lean_no_cache", "hf_gpt2_cache") for prompt in (8, 24)
    }
    assert all(r["ms_per_token"] >= 0 for r in rows)
    assert "growth (log-log slope)" in capsys.readouterr().out
    assert (tmp_path / "gen.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):
        generation.main(["--prompts", "64,8"])  # not increasing: a clear argparse error
