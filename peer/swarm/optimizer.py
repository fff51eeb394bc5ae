"""Building the collaborative optimizer: parameter groups, LR schedule, 8-bit LAMB, compression, averagers.

Trainers and auxiliary peers build it with the same factory, so their states can be exchanged.
"""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import Dict, List, Optional, Type

import hivemind
import torch
from hivemind.compression import (
    BlockwiseQuantization,
    CompressionBase,
    Float16Compression,
    NoCompression,
    SizeAdaptiveCompression,
)
from hivemind.utils.crypto import RSAPrivateKey

from peer.swarm import round_wait
from peer.swarm.config import CollaborationArguments, OptimizerArguments
from peer.swarm.hivemind_seam import (
    AveragingPolicy,
    LeanHiveGradientAverager,
    LeanHiveOptimizer,
    PseudoGradientAverager,
    SparsePseudoGradientAverager,
    StateDownloadSettings,
    authorized_peer_ids,
)
from peer.swarm.hivemind_seam.progress import REPORT_SHARE
from peer.swarm.lamb import CPULamb8Bit
from peer.swarm.reachability import assisting_aux_peers

logger = logging.getLogger(__name__)

_NO_DECAY_MARKERS = ("bias", "norm", "ln_")


# ---------------------------------------------------------------------------------------------- groups


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> List[dict]:
    """Two groups: matrices decay, biases and normalization weights (any 1-d tensor) do not."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        lowered = name.lower()
        if param.ndim <= 1 or any(marker in lowered for marker in _NO_DECAY_MARKERS):
            no_decay.append(param)
        else:
            decay.append(param)
    return [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]


# --------------------------------------------------------------------------------------- lr schedule


def learning_rate_at(step: int, args: OptimizerArguments) -> float:
    """Absolute learning rate at a global step: linear warmup, then decay to min_learning_rate."""
    if args.warmup_steps and step < args.warmup_steps:
        return args.learning_rate * (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant":
        return args.learning_rate
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.total_steps - args.warmup_steps))
    if args.lr_schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return args.min_learning_rate + (args.learning_rate - args.min_learning_rate) * decay


def make_scheduler(optimizer: torch.optim.Optimizer, args: OptimizerArguments):
    """hivemind steps the scheduler once per global epoch, so steps here are global steps."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: learning_rate_at(step, args) / args.learning_rate)


def make_lamb(param_groups: List[dict], args: OptimizerArguments) -> CPULamb8Bit:
    return CPULamb8Bit(
        param_groups,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
        clamp_value=args.clamp_value,
        bias_correction=args.bias_correction,
        max_grad_norm=args.max_grad_norm or None,
        min_8bit_size=args.min_8bit_size,
    )


def make_outer_sgd(params, args: CollaborationArguments) -> torch.optim.SGD:
    """The outer optimizer of --sync_mode local: Nesterov SGD on the shared parameters (DiLoCo)."""
    groups = list(params)
    if groups and isinstance(groups[0], dict):
        # hivemind hands over parameter_groups(), whose groups carry the inner LAMB's weight_decay; SGD would apply
        # it to the shared parameters on top of the averaged pseudo-gradient (decay belongs to the inner steps)
        groups = [dict(params=group["params"]) for group in groups]
    momentum = args.outer_momentum
    return torch.optim.SGD(
        groups, lr=args.outer_learning_rate, momentum=momentum, nesterov=momentum > 0, weight_decay=0.0
    )


def set_inner_learning_rate(inner: torch.optim.Optimizer, epoch: int, args: OptimizerArguments) -> float:
    """--sync_mode local: the inner LAMB follows the schedule of the global epoch (= round), as hivemind's
    local-updates mode does, so a peer that joins mid-run takes the swarm's rate without any state of its own."""
    lr = learning_rate_at(epoch, args)
    for group in inner.param_groups:
        group["lr"] = lr
    return lr


# --------------------------------------------------------------------------------------- compression


def make_compression(args: CollaborationArguments) -> CompressionBase:
    """fp16 for small tensors (biases, norms), 8-bit blockwise for large ones, as in hivemind's ALBERT example."""
    if args.compression == "none":
        return NoCompression()
    if args.compression == "fp16":
        return Float16Compression()
    return SizeAdaptiveCompression(
        threshold=args.compression_threshold, less=Float16Compression(), greater_equal=BlockwiseQuantization()
    )


# ------------------------------------------------------------------------------------------ factory

GRADIENT_AVERAGERS: Dict[str, Type[LeanHiveGradientAverager]] = {
    "sync": LeanHiveGradientAverager,
    "local": PseudoGradientAverager,
    "local_sparse": SparsePseudoGradientAverager,  # --sync_mode local --outer_compression sparse
}
"""The averager of each ``--sync_mode``'s all-reduce. LeanHive never changes this table; the tests' fault entry point
(tests/support/fault_trainer.py) puts subclasses that inject faults here before it builds its peer, so no production
signature or entry point takes an averager class."""


def make_inner_optimizer(model: torch.nn.Module, optim: OptimizerArguments) -> CPULamb8Bit:
    """--sync_mode local: this peer's own 8-bit LAMB over the model's parameters (never shared)."""
    return make_lamb(parameter_groups(model, optim.weight_decay), optim)


def build_optimizer(
    *,
    model: torch.nn.Module,
    dht: hivemind.DHT,
    run_id: str,
    signing_key: RSAPrivateKey,
    batch_size_per_step: Optional[int],
    collab: CollaborationArguments,
    optim: OptimizerArguments,
    client_mode: bool,
    reuse_grad_buffers: bool = False,
    auxiliary: bool = False,
) -> LeanHiveOptimizer:
    """The collaborative optimizer: 8-bit LAMB offloaded to the CPU, averaged across the swarm.

    Auxiliary peers (aux_monitor) pass ``auxiliary=True`` and ``batch_size_per_step=None``: they build the
    same parameter groups and optimizer state (so states can be exchanged) but never accumulate gradients.

    ``--sync_mode local``: the optimizer built here is the outer one (Nesterov SGD over the shared parameters,
    whose state joiners download); the trainer steps its own inner 8-bit LAMB (``make_inner_optimizer``).
    """
    local = collab.sync_mode == "local"
    compression = make_compression(collab)
    allreduce_timeout = collab.allreduce_timeout or collab.averaging_timeout
    if collab.allreduce_timeout is None and (client_mode or auxiliary):
        # their rounds cross a client's home uplink: an attempt cut at averaging_timeout lost rounds whose bytes had
        # all been sent (the training loop's wait grows the same way, peer.swarm.round_wait)
        allreduce_timeout = round_wait.CAP * collab.averaging_timeout
    policy = AveragingPolicy(authorized_peers=authorized_peer_ids(dht), contribution_clip=collab.contribution_clip)
    # averager_opts reach only the state averager; the gradient averager gets the same through its factory
    averager_opts = dict(request_timeout=collab.request_timeout)
    # hivemind waits matchmaking_time for a sender's next chunk; in local mode a peer enters the round's all-reduce
    # after its current local step (seconds), and a reducer that gives up on it keeps its own pseudo-gradient in that
    # shard ("received 50.0% of input tensors"), which leaves the peers' shared parameters apart after the round.
    # Rounds take minutes in this mode, so waiting longer costs little.
    next_chunk_timeout = max(collab.matchmaking_time, allreduce_timeout / 3) if local else None
    sparse = local and collab.outer_compression == "sparse"
    averager_class = GRADIENT_AVERAGERS["local_sparse" if sparse else collab.sync_mode]
    if local:  # the averager of pseudo-gradients; the wrapped optimizer is the outer one (trainers own the inner)
        grad_averager_factory = partial(averager_class, policy=policy, run_id=run_id, **averager_opts)
        if sparse:
            grad_averager_factory = partial(
                grad_averager_factory,
                density=collab.sparse_density,
                bits=collab.sparse_bits,
                chunk=collab.sparse_chunk,
                feedback_decay=collab.sparse_feedback_decay,
            )
        optimizer, scheduler = partial(make_outer_sgd, args=collab), None
    else:
        grad_averager_factory = partial(averager_class, policy=policy, **averager_opts)
        optimizer, scheduler = partial(make_lamb, args=optim), partial(make_scheduler, args=optim)
    return LeanHiveOptimizer(
        policy=policy,
        assisting_peers=partial(assisting_aux_peers, dht, run_id),
        dht=dht,
        run_id=run_id,
        target_batch_size=collab.target_batch_size,
        batch_size_per_step=batch_size_per_step,
        params=parameter_groups(model, optim.weight_decay),
        optimizer=optimizer,
        scheduler=scheduler,
        matchmaking_time=collab.matchmaking_time,
        averaging_timeout=collab.averaging_timeout,
        allreduce_timeout=allreduce_timeout,
        download_settings=StateDownloadSettings(
            attempts=collab.load_state_attempts,
            first_chunk_timeout=collab.load_state_timeout,
            max_donors=collab.max_donors,
            serve_max_joiners=collab.serve_max_joiners,
        ),
        next_chunk_timeout=next_chunk_timeout,
        offload_optimizer=True,
        reuse_grad_buffers=reuse_grad_buffers and not local,
        delay_optimizer_step=collab.delay_optimizer_step,
        delay_grad_averaging=collab.delay_grad_averaging,
        average_state_every=collab.average_state_every,
        # local mode: a background state averaging round would copy the shared parameters over the model's when
        # it finishes, wiping the local steps taken meanwhile; it runs at the round's end instead
        delay_state_averaging=not local,
        client_mode=client_mode,
        auxiliary=auxiliary,
        grad_compression=compression,
        grad_averager_factory=grad_averager_factory,
        state_averaging_compression=compression,
        load_state_compression=NoCompression(),  # joiners get exact parameters and 8-bit codes
        averager_opts=averager_opts,
        # the progress tracker must sign with the same key as the DHT's signature validator
        tracker_opts=dict(
            private_key=signing_key,
            min_refresh_period=0.5,
            default_refresh_period=1.0,
            # local mode: a record per share of the round, not per local step (rounds take minutes; progress.py),
            # and one per step from two matchmaking windows before the round's end (the others schedule on them)
            report_share=REPORT_SHARE if local else None,
            report_every_step_within=2 * collab.matchmaking_time,
        ),
        verbose=collab.verbose,
    )
