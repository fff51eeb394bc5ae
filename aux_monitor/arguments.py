"""The aux peer's own settings (network, collaboration and optimizer settings are the trainers' dataclasses)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from peer.swarm.validate import integer_at_least, positive, require

_HUB_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class AuxArguments:
    """What the auxiliary peer does: metrics, dashboard, checkpoints, evaluation, upload."""

    model_config: str = "tiny"
    """Model preset name (configs/model/<name>.json) or JSON path; must be the one the trainers use."""
    refresh_period: float = 10.0
    """Seconds between two reads of the trainers' metrics from the DHT."""
    alive_window: float = 300.0
    """A trainer counts as online if it reported metrics within this many seconds (more than one epoch)."""
    metrics_host: str = "0.0.0.0"
    """Address the HTTP server (Prometheus /metrics and the dashboard) listens on. 0.0.0.0 (all interfaces) lets
    Prometheus on another host or container scrape it; the endpoints are read-only and show only what the DHT
    already publishes. Use 127.0.0.1 to keep them on this machine (e.g. behind a reverse proxy)."""
    metrics_port: int = 9100
    """Port of the HTTP server: /metrics for Prometheus, / for the dashboard, /api/state as JSON; 0 picks one."""
    checkpoint_dir: str = "checkpoints"
    """Folder the swarm's checkpoints are written to (one sub-folder per checkpoint)."""
    checkpoint_every: int = 10
    """Download the swarm's state and write a checkpoint every this many global epochs; 0 disables."""
    keep_checkpoints: int = 3
    """How many of the newest valid checkpoints to keep; older ones are deleted."""
    resume: bool = False
    """At start, load the newest valid checkpoint from checkpoint_dir and offer it to joining trainers."""
    assist_in_averaging: Optional[bool] = None
    """Take part in the trainers' all-reduce rounds as a reducer (this machine's bandwidth; contributes no data).
    Default (none): only while client-mode trainers (volunteers nobody can dial) are online and this aux can be
    dialled, since they cannot average without a reachable peer; true: whenever trainers are online; false: never."""
    assist_refresh: float = 0.2
    """Seconds between checks for a new averaging round while assisting: a round is scheduled when the trainers'
    epoch is less than matchmaking_time away, so a slower check misses short windows (tiny preset: 1 s; measured:
    every round joined at 0.2 s, two thirds at 1 s)."""
    eval_every: int = 0
    """Evaluate the swarm's state on the validation split every this many global epochs; 0 disables."""
    eval_batch_size: int = 8
    """Sequences per evaluation batch."""
    eval_max_batches: int = 64
    """At most this many validation batches per evaluation (bounds the time one evaluation takes)."""
    sample_tokens: int = 32
    """Generate this many tokens from each new checkpoint (a continuation of sample_prompt, shown on the dashboard
    and in /api/state; in a background thread); 0 disables."""
    sample_prompt: str = "The"
    """The fixed prompt each checkpoint continues, so the samples show the model learning."""
    sample_seconds: float = 20.0
    """Generation of one sample stops after this many seconds, however many tokens it has."""
    init_seed: int = 0
    """Seed of the initial parameters, the trainers' (their run preset's init_seed): a swarm of client-mode trainers
    starts from this aux peer's state, which must then be theirs."""
    upload_to_hub: Optional[str] = None
    """Hugging Face Hub model repo (user/name) to upload each new checkpoint to; needs HF_TOKEN or a login."""

    def __post_init__(self):
        require(bool(self.model_config), "model_config must name a preset (e.g. tiny) or a JSON file")
        positive(self, "refresh_period", "alive_window", "assist_refresh", "sample_seconds", unit="number of seconds")
        require(
            isinstance(self.metrics_port, int) and 0 <= self.metrics_port <= 65535,
            f"metrics_port must be a TCP port (0-65535; 0 picks a free one), got {self.metrics_port!r}",
        )
        require(bool(self.checkpoint_dir), "checkpoint_dir must be a folder path")
        integer_at_least(self, 0, "checkpoint_every", "eval_every", "sample_tokens", note="(0 disables it)")
        require(bool(self.sample_prompt), "sample_prompt must be a non-empty text, e.g. 'The'")
        integer_at_least(self, 1, "keep_checkpoints", "eval_batch_size", "eval_max_batches")
        if self.upload_to_hub is not None:
            require(
                bool(_HUB_REPO.match(self.upload_to_hub)),
                f"upload_to_hub must be a Hub repo id like my-org/leanhive-gpt, got {self.upload_to_hub!r}",
            )
            require(self.checkpoint_every > 0, "upload_to_hub uploads checkpoints: set --checkpoint_every > 0")
