"""Memory planner: the fastest training configuration whose predicted peak fits a memory budget.

It chooses the micro-batch (``per_device_batch_size``) and ``gradient_accumulation_steps`` (their
product, the peer's samples per local step, stays what was asked), checkpointing (a plain stack) or
chunked backward (a reversible stack: reversible is architecture, fixed by the model config, so every
peer computes the same function), ``loss_chunk_size`` and the precision.

The prediction is analytical: parameters and gradients, plus the activation peak of one step, the
larger of the end of forward (saved activations of every layer, hidden-size buffers outside the
layers, the loss head's logits chunk and gradients) and the top of backward (the same plus the last
layer's backward buffers). It is calibrated by one short measured step on the actual device: one
micro-batch of one sequence in the configuration ranked first, measured with the exact live-tensor
accounting of ``peer.memlib`` on CPU and ``torch.cuda.max_memory_allocated`` on CUDA; the measured
minus predicted bytes of that step (what the formulas miss: allocator rounding, small buffers) are
added to every prediction. Speed is ranked, not predicted: no recomputation first, then half
precision (CUDA), then the largest micro-batch, then the fewest chunks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from model import LeanGPTForCausalLM, LeanTransformerConfig, apply_memory_options, load_config
from peer import memlib
from peer.model_setup import choose_placement
from peer.swarm.config import TrainingArguments
from peer.swarm.validate import require

logger = logging.getLogger(__name__)

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
MIB = 2**20
# loss chunk sizes the planner tries besides the model config's own
LOSS_CHUNKS = (128,)
# reversible backward chunks tried (tokens, heads); (0, 0) is revlib's whole-sub-layer backward
REVERSIBLE_CHUNKS = ((0, 0), (256, 4), (64, 1))


def parse_size(text: str) -> int:
    """'8GiB', '7.5 GB', '512MiB', '1048576' -> bytes (GiB/MiB/KiB: powers of 1024; GB/MB/KB: of 1000)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read the memory size {text!r}: give a number with a unit, e.g. 8GiB, 7.5GB, 512MiB")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / MIB:.1f} MiB"


@dataclass
class MemoryPlanArguments:
    """Pick batch size, accumulation, checkpointing/chunking, loss chunk and precision to fit a memory budget."""

    memory_budget: Optional[str] = None
    """Plan for this much device memory (e.g. 8GiB, 7.5GB): the planner then sets per_device_batch_size,
    gradient_accumulation_steps (same samples per step), checkpoint_layers or the reversible chunks,
    loss_chunk_size and precision. On CUDA 'auto' means the device's total memory minus --memory_reserve;
    None: no planning."""
    memory_reserve: str = "1GiB"
    """With --memory_budget auto on CUDA: memory left to the CUDA context, the allocator's cache and others."""
    plan_only: bool = False
    """Print the memory plan (one JSON line, then a table) and exit without training; needs --memory_budget."""

    def __post_init__(self):
        if self.memory_budget is not None and self.memory_budget != "auto":
            require(parse_size(self.memory_budget) > 0, f"memory_budget must be positive, got {self.memory_budget!r}")
        parse_size(self.memory_reserve)
        require(
            not self.plan_only or self.memory_budget is not None,
            "--plan_only prints a memory plan: give --memory_budget too (e.g. --memory_budget 8GiB, or auto on CUDA)",
        )


@dataclass(frozen=True)
class Candidate:
    """One training configuration the planner considers."""

    per_device_batch_size: int
    gradient_accumulation_steps: int
    checkpoint_layers: bool
    reversible_chunk_tokens: int
    reversible_chunk_heads: int
    loss_chunk_size: int
    precision: str  # fp32, fp16 or bf16

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        return {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[self.precision]

    def memory_options(self, reversible: bool) -> dict:
        options = dict(loss_chunk_size=self.loss_chunk_size)
        if reversible:
            options.update(
                reversible_chunk_tokens=self.reversible_chunk_tokens, reversible_chunk_heads=self.reversible_chunk_heads
            )
        else:
            options.update(checkpoint_layers=self.checkpoint_layers)
        return options

    def speed_rank(self) -> tuple:
        """Smaller is faster (a ranking, not a prediction): no recomputation, half precision, large
        micro-batches, then fewer and larger chunks."""
        unchunked = 10**9
        return (
            self.checkpoint_layers,
            self.precision == "fp32",
            -self.per_device_batch_size,
            -(self.reversible_chunk_tokens or unchunked),
            -(self.reversible_chunk_heads or unchunked),
            -(self.loss_chunk_size or unchunked),
        )


@dataclass
class ModelShape:
    """What the formulas need from a model config."""

    hidden: int
    inner: int  # FFN up-projection width (2x intermediate when gated)
    intermediate: int
    layers: int
    heads: int
    vocab: int
    embedding: int
    reversible: bool
    params: int
    largest_layer_params: int

    @classmethod
    def from_config(cls, config: LeanTransformerConfig) -> "ModelShape":
        with torch.device("meta"):
            model = LeanGPTForCausalLM(config)
        params = sum(p.numel() for p in model.parameters())
        layer = model.transformer.stack.groups[0]
        return cls(
            hidden=config.hidden_size,
            inner=config.intermediate_size * (2 if config.gated_ffn else 1),
            intermediate=config.intermediate_size,
            layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            vocab=config.vocab_size,
            embedding=config.embedding_size,
            reversible=config.reversible,
            params=params,
            largest_layer_params=max(p.numel() for p in layer.parameters()),
        )


def predict_peak_bytes(shape: ModelShape, candidate: Candidate, seq_len: int) -> int:
    """Analytical device peak of one micro-batch: parameters + gradients + activation peak (bytes)."""
    h, f, V, L = shape.hidden, shape.inner, shape.vocab, shape.layers
    tokens = candidate.per_device_batch_size * seq_len
    act = 4 if candidate.precision == "fp32" else 2  # activation bytes per element
    half_copy = 0 if candidate.precision == "fp32" else 2  # autocast keeps half copies of weights in use
    static = shape.params * 4 * 2  # fp32 parameters and their gradients (the optimizer state is in CPU RAM)
    # saved for backward per layer per token: attention input, q/k/v, output and logsumexp; FFN input and
    # pre-activation (custom backward); one hidden state with checkpointing; nothing when reversible
    if shape.reversible:
        per_layer, outside = 0, 4  # two streams, the stack output, the final norm output
    elif candidate.checkpoint_layers:
        per_layer, outside = h * act, 2
    else:
        per_layer, outside = (6 * h + f) * act + shape.heads * 4, 2
    saved = L * per_layer * tokens + outside * tokens * h * act
    chunk = min(candidate.loss_chunk_size or tokens, tokens)
    # chunked loss: gradient of the hidden states and of the (tied) output embedding held from forward,
    # plus one chunk of logits in fp32 (and its half-precision matmul output)
    loss = tokens * shape.embedding * 4 + V * shape.embedding * 4 + chunk * V * (4 + half_copy)
    forward_end = saved + loss
    # top of backward: the stream gradients, the last sub-layer's recomputed activations and backward
    # buffers, and one layer's parameter gradients on their way into .grad
    grads_flowing = 2 * tokens * h * 4
    layer_grads = shape.largest_layer_params * (4 + half_copy) * 2
    if shape.reversible:
        streams = 4 * tokens * h * act  # two streams and their gradients, rebuilt in place
        if candidate.reversible_chunk_tokens or candidate.reversible_chunk_heads:
            ffn_tokens = min(candidate.reversible_chunk_tokens or tokens, tokens)
            share = (candidate.reversible_chunk_heads or shape.heads) / shape.heads
            ffn = ffn_tokens * (2 * h + 2 * f + shape.intermediate) * act
            attention = tokens * h * act * (5 + 6 * share)  # norm, y, gradients + one group's q/k/v buffers
            backward_top = streams + max(ffn, attention)
        else:  # revlib: four streams, their rebuilt copies and one sub-layer's whole activations
            backward_top = streams + tokens * (5 * h + 3 * shape.intermediate) * act
    else:
        recomputed = (6 * h + f) * act * tokens if candidate.checkpoint_layers else 0
        backward_top = saved + recomputed + tokens * shape.intermediate * act + grads_flowing
    backward_top += V * shape.embedding * 4 + layer_grads
    # end of backward: the embedding's dense gradient beside the loss head's, and the gradients into it
    # (three: the two contributions to the tied matrix and their sum)
    embedding_end = 3 * V * shape.embedding * 4 + grads_flowing
    return int(static + max(forward_end, backward_top, embedding_end))


@dataclass
class PlanRow:
    candidate: Candidate
    predicted_bytes: int
    fits: bool


@dataclass
class MemoryPlan:
    """The planner's answer: the chosen configuration (None when nothing fits) and every candidate's figures."""

    device: str
    budget_bytes: int
    seq_len: int
    samples_per_step: int
    calibration_offset_bytes: int
    calibration_measured_bytes: int
    chosen: Optional[PlanRow]
    rows: List[PlanRow]

    @property
    def needed_bytes(self) -> int:
        """The smallest predicted peak of all candidates: the budget that would fit something."""
        return min(row.predicted_bytes for row in self.rows)

    def to_json(self) -> str:
        chosen = None
        if self.chosen is not None:
            chosen = dict(dataclasses.asdict(self.chosen.candidate), predicted_peak_bytes=self.chosen.predicted_bytes)
        return json.dumps(
            dict(
                device=self.device,
                budget_bytes=self.budget_bytes,
                seq_len=self.seq_len,
                samples_per_step=self.samples_per_step,
                fits=self.chosen is not None,
                chosen=chosen,
                needed_bytes=self.needed_bytes,
                calibration_offset_bytes=self.calibration_offset_bytes,
                calibration_measured_bytes=self.calibration_measured_bytes,
                candidates=len(self.rows),
            ),
            sort_keys=True,
        )

    def table(self, top: int = 12) -> str:
        header = "| micro-batch | accumulation | checkpoint | rev. chunks (tokens/heads) | loss chunk | precision |"
        header += " predicted peak | fits |"
        lines = [header, "|" + "---|" * 8]
        ranked = sorted(self.rows, key=lambda row: (not row.fits, row.candidate.speed_rank()))
        for row in ranked[:top]:
            c = row.candidate
            mark = "CHOSEN" if self.chosen is not None and row.candidate == self.chosen.candidate else str(row.fits)
            lines.append(
                f"| {c.per_device_batch_size} | {c.gradient_accumulation_steps} | {c.checkpoint_layers} | "
                f"{c.reversible_chunk_tokens}/{c.reversible_chunk_heads} | {c.loss_chunk_size} | {c.precision} | "
                f"{format_size(row.predicted_bytes)} | {mark} |"
            )
        summary = (
            f"budget {format_size(self.budget_bytes)} on {self.device}, sequence length {self.seq_len}, "
            f"{self.samples_per_step} samples per step; calibration: one measured step "
            f"({format_size(self.calibration_measured_bytes)}, "
            f"formula offset {self.calibration_offset_bytes / MIB:+.1f} MiB)"
        )
        if self.chosen is None:
            summary += f"\nNOTHING FITS: the smallest configuration needs {format_size(self.needed_bytes)}"
        return summary + "\n" + "\n".join(lines)


def candidates(
    config: LeanTransformerConfig, samples_per_step: int, precisions: List[str], reversible_chunks: bool = True
) -> List[Candidate]:
    """reversible_chunks=False leaves out the chunked reversible backward (per-block gradient scaling refuses it)."""
    batches = [b for b in range(1, samples_per_step + 1) if samples_per_step % b == 0]
    loss_chunks = sorted({config.loss_chunk_size or 256, *LOSS_CHUNKS})
    if config.reversible:
        chunk_modes = REVERSIBLE_CHUNKS if reversible_chunks else REVERSIBLE_CHUNKS[:1]
        layer_modes = [(False, tokens, heads) for tokens, heads in chunk_modes]
    else:
        layer_modes = [(False, 0, 0), (True, 0, 0)]
    return [
        Candidate(b, samples_per_step // b, ckpt, tokens, heads, loss_chunk, precision)
        for b in batches
        for ckpt, tokens, heads in layer_modes
        for loss_chunk in loss_chunks
        for precision in precisions
    ]


def build_for(config: LeanTransformerConfig, candidate: Candidate, device: torch.device) -> torch.nn.Module:
    model = LeanGPTForCausalLM(config)
    apply_memory_options(model, **candidate.memory_options(config.reversible))
    return model.to(device).train()


def measure_peak_bytes(model: torch.nn.Module, input_ids: torch.Tensor, autocast_dtype) -> int:
    """Measured device peak of one training step: parameters + gradients + live activations at their peak."""
    device = input_ids.device
    memlib.preallocate_grads(model)
    static = sum(p.numel() * p.element_size() for p in model.parameters()) * 2
    if device.type == "cuda":
        peak = memlib.cuda_peak_bytes(lambda: memlib.train_step(model, input_ids, autocast_dtype), device)
        return static + peak
    return static + memlib.measured_step(model, input_ids, autocast_dtype).live_peak_bytes


def make_plan(
    config: LeanTransformerConfig,
    *,
    budget_bytes: int,
    seq_len: int,
    samples_per_step: int,
    device: torch.device,
    precisions: List[str],
    measure: Callable[[torch.nn.Module, torch.Tensor, Optional[torch.dtype]], int] = measure_peak_bytes,
    reversible_chunks: bool = True,
) -> MemoryPlan:
    """Rank the candidates, calibrate with one measured step, keep the fastest that fits."""
    require(budget_bytes > 0, f"the memory budget must be positive, got {budget_bytes}")
    shape = ModelShape.from_config(config)
    pool = candidates(config, samples_per_step, precisions, reversible_chunks)
    ranked = sorted(pool, key=lambda c: c.speed_rank())
    # calibration: one sequence in the leading layer mode (what the plan most likely uses)
    probe = dataclasses.replace(ranked[0], per_device_batch_size=1, gradient_accumulation_steps=samples_per_step)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=generator).to(device)
    torch.manual_seed(0)
    model = build_for(config, probe, device)
    measured = measure(model, input_ids, probe.autocast_dtype)
    del model
    offset = measured - predict_peak_bytes(shape, probe, seq_len)
    logger.info(
        "memory plan calibration: one step measured %s (formula offset %+d bytes)", format_size(measured), offset
    )
    rows = [PlanRow(c, predict_peak_bytes(shape, c, seq_len) + offset, False) for c in ranked]
    for row in rows:
        row.fits = row.predicted_bytes <= budget_bytes
    chosen = next((row for row in rows if row.fits), None)
    return MemoryPlan(
        device=str(device),
        budget_bytes=budget_bytes,
        seq_len=seq_len,
        samples_per_step=samples_per_step,
        calibration_offset_bytes=offset,
        calibration_measured_bytes=measured,
        chosen=chosen,
        rows=rows,
    )


def resolve_budget(args: MemoryPlanArguments, device: torch.device) -> int:
    """Bytes to plan for: the given budget, or on CUDA with 'auto' the device total minus the reserve."""
    if args.memory_budget not in (None, "auto"):
        return parse_size(args.memory_budget)
    if device.type != "cuda":
        raise ValueError(
            "on CPU the memory planner needs an explicit budget: pass --memory_budget SIZE (e.g. 8GiB); "
            "'auto' reads the total memory of a CUDA device"
        )
    total = torch.cuda.get_device_properties(device).total_memory
    budget = total - parse_size(args.memory_reserve)
    require(budget > 0, f"--memory_reserve {args.memory_reserve} is larger than the device's {format_size(total)}")
    return budget


def precisions_for(device: torch.device, requested: str) -> List[str]:
    if requested != "auto":
        return [requested]
    if device.type != "cuda":
        return ["fp32"]
    return ["fp16", "fp32"]  # as --precision auto: fp16 (with the trainer's GradScaler) on CUDA


def plan_for_training(training: TrainingArguments, seq_len: int, args: MemoryPlanArguments) -> MemoryPlan:
    """The plan for a trainer's arguments: its model, device, requested precision and samples per step."""
    placement = choose_placement(training)
    config = load_config(training.model_config)
    return make_plan(
        config,
        budget_bytes=resolve_budget(args, placement.device),
        seq_len=seq_len,
        samples_per_step=training.per_device_batch_size * training.gradient_accumulation_steps,
        device=placement.device,
        precisions=precisions_for(placement.device, training.precision),
        reversible_chunks=not training.per_block_grad_scaling,
    )


def apply_plan(training: TrainingArguments, plan: MemoryPlan, reversible: bool) -> TrainingArguments:
    """Training arguments with the plan's choices (the planner overrides the flags it chooses)."""
    if plan.chosen is None:
        raise ValueError(
            f"no configuration fits the memory budget of {format_size(plan.budget_bytes)}: the smallest needs "
            f"{format_size(plan.needed_bytes)}; raise --memory_budget to at least that, or pick a smaller "
            "model or --max_sequence_length"
        )
    chosen = plan.chosen.candidate
    return dataclasses.replace(
        training,
        per_device_batch_size=chosen.per_device_batch_size,
        gradient_accumulation_steps=chosen.gradient_accumulation_steps,
        precision=chosen.precision,
        **chosen.memory_options(reversible),
    )
