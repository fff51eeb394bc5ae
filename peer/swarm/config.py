"""A run preset's typed settings: collaboration (hivemind), optimizer (8-bit LAMB) and the trainer's loop.

Every peer of a run reads the same preset (``configs/run/``): the aux peer uses the collaboration and optimizer
settings to build the trainers' optimizer, and checks (then drops) the training settings. Network settings live
in ``peer.swarm.network.NetworkArguments`` and data settings in ``peer.swarm.data.DataArguments``. Every field
has a docstring: it is the ``--help`` text of its flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from configs import RUN_PRESETS_DIR
from peer.swarm.sparse import MAX_CHUNK, VALUE_BITS
from peer.swarm.validate import integer_at_least, non_negative, positive, require

__all__ = ["RUN_PRESETS_DIR", "SYNC_MODES", "CollaborationArguments", "OptimizerArguments", "TrainingArguments"]


SYNC_MODES = ("sync", "local")


@dataclass
class CollaborationArguments:
    """How this peer accumulates, averages and shares progress with the swarm (hivemind.Optimizer)."""

    target_batch_size: int = 4096
    """Samples the whole swarm accumulates per global step (one global epoch); the same on every peer."""
    matchmaking_time: float = 5.0
    """Seconds to wait for peers to form an averaging group (3-5 on a LAN, 10-15 over the internet)."""
    averaging_timeout: float = 60.0
    """Give up an averaging round after this many seconds (about twice the time all-reduce takes); the training loop
    waits up to 5x longer once this peer's rounds proved slower (peer/swarm/round_wait.py)."""
    allreduce_timeout: Optional[float] = None
    """Timeout of one all-reduce attempt; None means averaging_timeout (5 x averaging_timeout for client-mode and
    auxiliary peers, whose rounds cross home uplinks)."""
    request_timeout: Optional[float] = None
    """Seconds to wait for a peer's reply in matchmaking; must be below matchmaking_time (None: the smaller
    of 3 s and 0.8 x matchmaking_time)."""
    load_state_timeout: float = 120.0
    """Seconds a peer may take to start sending its state (parameters + optimizer statistics: its snapshot waits
    for its optimizer step). The rest of the download is bounded by the state's size, not by this: it may go on
    while each chunk arrives within 20 s, up to the size at 2 Mbit/s (a tenth of a 20 Mbit/s link; see
    peer.swarm.hivemind_seam.averaging.state_download_seconds), so any preset's state fits a slow link."""
    delay_optimizer_step: bool = False
    """Run the optimizer step in the background and apply it at the next step (one step of staleness)."""
    delay_grad_averaging: bool = False
    """Average gradients in the background too (needs delay_optimizer_step); with it: delayed parameter updates."""
    average_state_every: int = 1
    """Average parameters and optimizer statistics with peers every this many global epochs."""
    compression_threshold: int = 65536
    """Tensors with fewer elements are sent in fp16, larger ones 8-bit blockwise-quantized."""
    compression: Literal["adaptive", "fp16", "none"] = "adaptive"
    """Wire format of averaged tensors: adaptive (fp16 small / 8-bit large), fp16 for all, or none (fp32)."""
    min_peers: int = 1
    """Before the first step, wait until this many peers (this one included) are online: peers that share their
    state (trainers, aux peers) and client-mode trainers that report progress."""
    startup_wait: float = 60.0
    """Seconds to wait for the swarm's progress (and for min_peers) before training starts."""
    final_sync_timeout: float = 60.0
    """At max_epochs, wait at most this long for the other peers to get there too, then all take the same
    final parameters (from the peer elected by state-sharing priority); 0 skips this final barrier."""
    load_state_attempts: int = 3
    """At most this many peer downloads each time this peer needs the swarm's state (joining, recovering, re-syncing),
    each from the next best peer; once all were asked, they are asked again after a pause (a peer a moment behind may
    be ready then). Joining then trains on from the local state."""
    max_donors: int = 3
    """A state download takes disjoint parts of the state from up to this many peers at once (peers that hold the
    same state, checked part by part against the digests they announce); a slow or failing peer's parts move to the
    others. 1: one peer at a time."""
    serve_max_joiners: int = 2
    """This peer sends its state to at most this many downloading peers at a time; the others are told it is busy
    and ask another peer (its uplink also carries its averaging rounds)."""
    missed_round_resync_mb: float = 0.0
    """sync mode: after a gradient round this peer missed (hivemind then steps with this peer's own gradients, which
    leaves its parameters and optimizer statistics apart from the swarm's for many epochs), download the swarm's
    state if it is at most this many MB (e.g. 64: the tiny and bench_small presets): one download instead of a
    lasting gap. 0 (the default): never. Off by default because a download right after a round that lost a peer
    may first ask that peer: with a trainer partitioned for 30 s (fault scenario c) a survivor's re-sync took 19.5 s
    and the swarm hardly trained meanwhile. local mode always re-syncs after a missed round."""
    contribution_clip: float = 4.0
    """Robust averaging: NaN/inf contributions are dropped and each peer's deviation from the coordinate-wise
    median is clipped to this many times the median deviation (a bound on any one peer's influence); 0: plain
    mean (NaN/inf contributions are still dropped)."""
    metrics_expiration: float = 600.0
    """Seconds this peer's published metrics stay visible in the DHT after its last update."""
    verbose: bool = False
    """Log hivemind's internal events (matchmaking, averaging rounds, state downloads)."""
    sync_mode: Literal["sync", "local"] = "sync"
    """sync: every global epoch the swarm all-reduces its accumulated gradients and everyone takes one 8-bit LAMB
    step. local (DiLoCo-style, for slow links): each peer takes a LAMB step after every local step on its own
    parameters; when the swarm reaches target_batch_size samples (one round: about target_batch_size /
    (peers x batch per step) local steps per peer) it all-reduces the pseudo-gradients (shared parameters at the
    start of the round minus its own) and takes one outer Nesterov-SGD step on the shared parameters. Every peer
    of a run must use the same mode."""
    outer_learning_rate: float = 0.7
    """local mode: learning rate of the outer Nesterov SGD on the averaged pseudo-gradients (DiLoCo's 0.7)."""
    outer_momentum: float = 0.9
    """local mode: momentum of the outer Nesterov SGD (DiLoCo's 0.9; 0 with outer_learning_rate 1 is plain
    parameter averaging)."""
    outer_compression: Literal["dense", "sparse"] = "dense"
    """local mode: how pseudo-gradients travel. dense: every value, in the --compression wire format, over hivemind's
    butterfly all-reduce. sparse (for home uplinks): per chunk only the sparse_density largest values, quantized to
    sparse_bits bits, all-gathered; what is left out is kept in an error-feedback buffer and sent in later rounds
    (peer/swarm/sparse.py). Every peer of a run must use the same setting."""
    sparse_density: float = 0.05
    """outer_compression sparse: fraction of each chunk's values sent per round (1 sends all). 0.05: within 3 % of
    dense local mode's loss where 0.02-0.04 were 3-7 % above (docs/benchmarks.md, benchmarks/outer_sim.py), for about
    the bytes 0.02 took before positions were Elias-Fano coded."""
    sparse_bits: int = 2
    """outer_compression sparse: bits per sent value (1-8 on a uniform grid scaled per chunk, or 32 for float32)."""
    sparse_chunk: int = 4096
    """outer_compression sparse: values per chunk; each chunk keeps its own largest values and scale (at most
    65536, so positions fit 16 bits)."""
    sparse_feedback_decay: float = 0.95
    """outer_compression sparse: each round the error-feedback buffer (what earlier rounds left out) is multiplied by
    this before it is added to the pseudo-gradient (SparseLoCo's 0.95; 1 keeps everything). SparseLoCo also runs the
    outer step without momentum (--outer_momentum 0 --outer_learning_rate 1): the buffer plays its part."""

    def __post_init__(self):
        require(
            isinstance(self.target_batch_size, int) and self.target_batch_size > 0,
            f"target_batch_size must be a positive integer, got {self.target_batch_size!r}",
        )
        positive(self, "matchmaking_time", "averaging_timeout", "load_state_timeout")
        if self.request_timeout is None:
            self.request_timeout = min(3.0, 0.8 * self.matchmaking_time)
        positive(self, "request_timeout")
        # hivemind's matchmaking can deadlock when a reply may take longer than a matchmaking round
        require(
            self.request_timeout < self.matchmaking_time,
            f"request_timeout ({self.request_timeout}) must be smaller than matchmaking_time "
            f"({self.matchmaking_time}); e.g. --request_timeout {0.8 * self.matchmaking_time:g}",
        )
        if self.allreduce_timeout is not None:
            positive(self, "allreduce_timeout")
        require(
            not self.delay_grad_averaging or self.delay_optimizer_step,
            "delay_grad_averaging requires delay_optimizer_step: add --delay_optimizer_step",
        )
        integer_at_least(self, 1, "average_state_every", "compression_threshold", "min_peers", "load_state_attempts")
        integer_at_least(self, 1, "max_donors", "serve_max_joiners")
        non_negative(self, "startup_wait", "final_sync_timeout", "contribution_clip", "missed_round_resync_mb")
        positive(self, "metrics_expiration")
        require(
            self.sync_mode in SYNC_MODES,
            f"sync_mode must be one of {', '.join(SYNC_MODES)}, got {self.sync_mode!r}; e.g. --sync_mode local",
        )
        positive(self, "outer_learning_rate")
        require(
            isinstance(self.outer_momentum, (int, float)) and 0.0 <= self.outer_momentum < 1.0,
            f"outer_momentum must be in [0, 1), got {self.outer_momentum!r}",
        )
        self._check_outer_compression()
        if self.sync_mode == "local":
            # the outer step is cheap and rare: nothing to hide behind the next steps
            require(
                not self.delay_optimizer_step,
                "--sync_mode local takes no --delay_optimizer_step / --delay_grad_averaging (its rare outer step "
                "has nothing to overlap); remove them",
            )

    def _check_outer_compression(self) -> None:
        require(
            self.outer_compression in ("dense", "sparse"),
            f"outer_compression must be dense or sparse, got {self.outer_compression!r}; e.g. --outer_compression "
            "sparse",
        )
        require(
            self.outer_compression == "dense" or self.sync_mode == "local",
            "--outer_compression sparse compresses the pseudo-gradients of --sync_mode local: add --sync_mode local",
        )
        require(
            isinstance(self.sparse_density, (int, float)) and 0.0 < self.sparse_density <= 1.0,
            f"sparse_density must be in (0, 1], got {self.sparse_density!r}; e.g. --sparse_density 0.05",
        )
        require(
            self.sparse_bits in VALUE_BITS,
            f"sparse_bits must be one of {', '.join(map(str, VALUE_BITS))}, got {self.sparse_bits!r}; e.g. "
            "--sparse_bits 2",
        )
        require(
            isinstance(self.sparse_feedback_decay, (int, float)) and 0.0 <= self.sparse_feedback_decay <= 1.0,
            f"sparse_feedback_decay must be in [0, 1], got {self.sparse_feedback_decay!r}; e.g. "
            "--sparse_feedback_decay 0.95",
        )
        require(
            isinstance(self.sparse_chunk, int) and 1 <= self.sparse_chunk <= MAX_CHUNK,
            f"sparse_chunk must be an integer in [1, {MAX_CHUNK}] (one float32 scale serves a chunk's values), got "
            f"{self.sparse_chunk!r}; e.g. --sparse_chunk 4096",
        )


@dataclass
class OptimizerArguments:
    """8-bit LAMB (statistics quantized with bitsandbytes, kept on the CPU) and its learning-rate schedule."""

    learning_rate: float = 2.5e-3
    """Peak learning rate, reached at the end of warmup."""
    min_learning_rate: float = 1e-5
    """Learning rate at the end of the decay (an absolute value, not a fraction of learning_rate)."""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup: cosine or linear down to min_learning_rate, or constant."""
    warmup_steps: int = 100
    """Global steps (= global epochs) of linear warmup from 0 to learning_rate."""
    total_steps: int = 10000
    """Global step at which the decay reaches min_learning_rate (it stays there afterwards)."""
    adam_beta1: float = 0.9
    """LAMB's first-moment decay."""
    adam_beta2: float = 0.999
    """LAMB's second-moment decay."""
    adam_epsilon: float = 1e-6
    """Added to the second-moment root for numerical stability."""
    weight_decay: float = 0.01
    """Decoupled weight decay; biases and normalization weights never decay."""
    max_grad_norm: float = 1.0
    """Clip the global norm of the swarm-averaged gradients to this; 0 disables clipping."""
    clamp_value: float = 10.0
    """Trust-ratio clamp: the parameter norm in LAMB's ratio |param| / |update| is capped at this."""
    bias_correction: bool = True
    """Divide the moment estimates by (1 - beta^step), as Adam does."""
    min_8bit_size: int = 4096
    """Tensors with fewer elements keep fp32 statistics; larger ones store them in 8 bits."""

    def __post_init__(self):
        positive(self, "learning_rate", "adam_epsilon", "clamp_value")
        non_negative(self, "min_learning_rate", "weight_decay", "max_grad_norm")
        require(
            self.min_learning_rate <= self.learning_rate,
            f"min_learning_rate ({self.min_learning_rate}) must not exceed learning_rate ({self.learning_rate})",
        )
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            require(0.0 <= value < 1.0, f"{name} must be in [0, 1), got {value}")
        require(
            isinstance(self.warmup_steps, int) and self.warmup_steps >= 0,
            f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}",
        )
        require(
            isinstance(self.total_steps, int) and self.total_steps > self.warmup_steps,
            f"total_steps ({self.total_steps}) must be an integer larger than warmup_steps ({self.warmup_steps})",
        )
        require(
            isinstance(self.min_8bit_size, int) and self.min_8bit_size >= 1,
            f"min_8bit_size must be an integer >= 1, got {self.min_8bit_size!r}",
        )


PRECISIONS = ("auto", "fp32", "fp16", "bf16")


@dataclass
class TrainingArguments:
    """The local training loop: model, batch, precision, memory options, backups and stopping."""

    model_config: str = "tiny"
    """Model preset name (configs/model/<name>.json) or path to a LeanTransformerConfig JSON file."""
    output_dir: str = "outputs"
    """Where local backups and the final parameters are written."""
    per_device_batch_size: int = 8
    """Sequences per micro-batch on the device the model trains on."""
    gradient_accumulation_steps: int = 1
    """Micro-batches accumulated per local step (samples per local step = per_device_batch_size x this: the model
    trains on one device, however many GPUs the host has)."""
    max_epochs: Optional[int] = None
    """Stop cleanly once the swarm reaches this global epoch (None: train until interrupted)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs: auto picks cuda when available, else cpu."""
    precision: Literal["auto", "fp32", "fp16", "bf16"] = "auto"
    """Autocast precision: fp16 (with hivemind's GradScaler) or bf16 need CUDA; auto is fp16 on CUDA, fp32 on CPU."""
    checkpoint_layers: Optional[bool] = None
    """Recompute layer activations in backward to save memory (None keeps the model config's choice)."""
    custom_ffn: Optional[bool] = None
    """Use the memory-lean FFN with hand-written backward (None keeps the model config's choice)."""
    custom_attention: Optional[bool] = None
    """Use the memory-lean attention with hand-written backward (None keeps the model config's choice)."""
    loss_chunk_size: Optional[int] = None
    """Tokens per chunk of the LM loss, so full logits never exist at once; 0 computes full logits
    (None keeps the config's value)."""
    reversible_chunk_tokens: Optional[int] = None
    """Reversible models: FFN backward this many tokens at a time; 0 = all at once (None keeps the config's value)."""
    reversible_chunk_heads: Optional[int] = None
    """Reversible models: attention backward this many heads at a time; 0 = all at once (None keeps the config's)."""
    per_block_grad_scaling: bool = False
    """fp16 only: every attention/FFN block scales its own gradients (Ramesh et al., 2021) instead of one global
    loss scale, so no block overflows or underflows while the others are fine (peer/grad_scaling.py)."""
    grad_scale_growth_interval: int = 2000
    """With per_block_grad_scaling: a block's scale doubles after this many local steps without an overflow in it."""
    init_seed: int = 0
    """Seed of the model initialization (the same on every peer, so epoch-0 parameters agree)."""
    backup_every_epochs: int = 5
    """Write a local backup (parameters + optimizer state) every this many global epochs; 0 disables."""
    log_every_steps: int = 1
    """Log a progress line every this many local steps."""
    log_health_every_epochs: int = 10
    """Log a swarm health line (averaging rounds ok/failed, compute share, MB sent/received) every this many global
    epochs; 0 turns it off. The aux peer's dashboard shows the same numbers for every trainer."""
    torch_threads: Optional[int] = None
    """CPU threads torch may use (None: torch's default, which honours OMP_NUM_THREADS)."""

    def __post_init__(self):
        integer_at_least(self, 1, "per_device_batch_size", "gradient_accumulation_steps", "log_every_steps")
        integer_at_least(self, 0, "log_health_every_epochs")
        require(
            self.max_epochs is None or (isinstance(self.max_epochs, int) and self.max_epochs >= 1),
            f"max_epochs must be an integer >= 1 (or None to train until interrupted), got {self.max_epochs!r}",
        )
        require(
            isinstance(self.backup_every_epochs, int) and self.backup_every_epochs >= 0,
            f"backup_every_epochs must be an integer >= 0 (0 disables backups), got {self.backup_every_epochs!r}",
        )
        require(
            self.precision in PRECISIONS, f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
        )
        require(
            self.loss_chunk_size is None or self.loss_chunk_size >= 0,
            f"loss_chunk_size must be a number of tokens >= 0 (0: full logits), got {self.loss_chunk_size!r}",
        )
        for name in ("reversible_chunk_tokens", "reversible_chunk_heads"):
            value = getattr(self, name)
            require(
                value is None or (isinstance(value, int) and value >= 0),
                f"{name} must be an integer >= 0 (0: no chunking), got {value!r}",
            )
        integer_at_least(self, 1, "grad_scale_growth_interval")
        require(
            not self.per_block_grad_scaling or self.precision == "fp16",
            f"per_block_grad_scaling replaces the fp16 loss scale, so it needs --precision fp16 (got "
            f"{self.precision}); add --precision fp16 or drop --per_block_grad_scaling",
        )
        require(
            not (self.per_block_grad_scaling and (self.reversible_chunk_tokens or self.reversible_chunk_heads)),
            "per_block_grad_scaling cannot be combined with the chunked reversible backward: set "
            "--reversible_chunk_tokens 0 --reversible_chunk_heads 0 (revlib's backward supports it) or drop "
            "--per_block_grad_scaling",
        )
        require(
            self.torch_threads is None or self.torch_threads >= 1,
            f"torch_threads must be a positive integer, got {self.torch_threads!r}",
        )
        require(bool(self.model_config), "model_config must name a preset (e.g. tiny) or a JSON file")
