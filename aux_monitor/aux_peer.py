"""The auxiliary peer: joins the swarm without training, serves metrics/dashboard, keeps checkpoints.

Lifecycle: ``AuxPeer.build(config, control, parts)`` joins the swarm and starts the HTTP server; ``run()`` blocks
until a stop request; closing ``parts`` releases everything, also after a build that failed halfway. Entry points
hand ``build`` to ``peer.swarm.lifecycle.run_peer``, which does all three.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field

import torch
from hivemind.utils import get_dht_time

from aux_monitor.aggregation import SwarmSnapshot
from aux_monitor.arguments import AuxArguments
from aux_monitor.checkpoints import CheckpointManager
from aux_monitor.hub import HubUploader
from aux_monitor.monitor import AuxMonitor
from aux_monitor.replica import SwarmReplica
from aux_monitor.sampler import CheckpointSampler, SamplerSettings
from aux_monitor.server import MonitorApp, MonitorServer
from aux_monitor.state import MonitorState, StateHolder
from model import LeanGPTForCausalLM, load_config
from peer.swarm import events
from peer.swarm.config import CollaborationArguments, OptimizerArguments
from peer.swarm.data import DataArguments, build_validation_dataset, check_tokenizer_fits, load_tokenizer
from peer.swarm.events import EventArguments
from peer.swarm.joining import check_sync_mode
from peer.swarm.lifecycle import PeerControl
from peer.swarm.network import NetworkArguments, connect
from peer.swarm.optimizer import build_optimizer

logger = logging.getLogger(__name__)


@dataclass
class AuxConfig:
    """Everything an aux peer is configured with (network/collaboration/optimizer are the trainers' dataclasses)."""

    network: NetworkArguments
    collaboration: CollaborationArguments
    optimizer: OptimizerArguments
    data: DataArguments
    aux: AuxArguments
    events: EventArguments = field(default_factory=EventArguments)


def build_swarm_model(model_config: str, init_seed: int = 0) -> LeanGPTForCausalLM:
    """The model the trainers train, on the CPU, drawn as theirs are (peer.model_setup.build_model); its values are
    replaced by the swarm's state, except in a swarm of client-mode trainers that starts from it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        model = LeanGPTForCausalLM(load_config(model_config))
    model.train()
    logger.info(
        "Model %s: %.2fM parameters (CPU copy of the swarm's state)",
        model_config,
        sum(p.numel() for p in model.parameters()) / 1e6,
    )
    return model


def build_validation_set(data: DataArguments, vocab_size: int) -> list:
    """Only called when evaluation is on: the tokenizer and dataset are never loaded otherwise."""
    tokenizer = load_tokenizer(data)
    check_tokenizer_fits(tokenizer, vocab_size)
    blocks = build_validation_dataset(data, tokenizer)
    logger.info("Validation set: %d blocks of %d tokens", len(blocks), data.max_sequence_length)
    return blocks


def _wait_for_uploads(uploader: HubUploader) -> None:
    uploader.wait(timeout=60)


class AuxPeer:
    """An aux peer built whole by ``build`` (entry points run it with ``peer.swarm.lifecycle.run_peer``)."""

    def __init__(self, *, monitor: AuxMonitor, stop_requested: threading.Event):
        self.monitor, self.stop_requested = monitor, stop_requested

    @classmethod
    def build(cls, config: AuxConfig, control: PeerControl, parts: contextlib.ExitStack) -> "AuxPeer":
        """Join the swarm, build the replica of its state and the monitor, start the HTTP server.

        Each part's shutdown goes on ``parts`` as soon as the part exists; closed (``run_peer`` always does), it
        stops the server, waits for uploads, stops the sampler, leaves the swarm, then stops the watchdog and DHT."""
        net, aux = config.network, config.aux
        if net.client_mode or net.reachability == "private":
            raise ValueError(
                "an aux peer cannot run in client mode: it must accept connections to serve its "
                "state and join averaging; drop --client_mode / --reachability private (or run it where its port is "
                "reachable)"
            )
        parts.callback(logger.info, "Aux peer shut down")
        model = build_swarm_model(aux.model_config, aux.init_seed)  # before joining: a bad config fails fast
        validation = build_validation_set(config.data, model.config.vocab_size) if aux.eval_every else None
        checkpoints = (
            CheckpointManager(aux.checkpoint_dir, keep=aux.keep_checkpoints, model_class=type(model))
            if (aux.checkpoint_every or aux.resume)
            else None
        )

        # announced as "assist" (a reducer client-mode trainers can count on) unless --assist_in_averaging false
        assist = {True: "always", False: "never", None: "auto"}[aux.assist_in_averaging]
        swarm = connect(net, role=lambda: "aux" if assist == "never" else "assist")
        parts.callback(swarm.dht.shutdown)
        if swarm.watchdog is not None:
            parts.callback(swarm.watchdog.shutdown)
        parts.callback(swarm.shutdown_service)
        if assist == "auto" and not swarm.reachability.reachable:
            assist = "never"  # a reducer nobody can dial would only stall the trainers' rounds
        control.watchdog = swarm.watchdog
        check_sync_mode(swarm.dht, net.run_id, config.collaboration.sync_mode)  # before it declares its own

        # the trainers' own factory: same run_id, parameter groups, target batch size and compression
        optimizer = build_optimizer(
            model=model,
            dht=swarm.dht,
            run_id=net.run_id,
            signing_key=swarm.signing_key,
            batch_size_per_step=None,
            collab=config.collaboration,
            optim=config.optimizer,
            client_mode=False,
            auxiliary=True,
        )
        parts.callback(optimizer.shutdown)
        replica = SwarmReplica(model=model, optimizer=optimizer)
        holder = StateHolder(
            MonitorState(run_id=net.run_id, initial_peers=swarm.join_line, swarm=SwarmSnapshot.empty(get_dht_time()))
        )
        sampler = None
        if aux.sample_tokens and checkpoints is not None:
            settings = SamplerSettings(
                prompt=aux.sample_prompt,
                max_new_tokens=aux.sample_tokens,
                max_seconds=aux.sample_seconds,
                tokenizer=config.data.tokenizer,
            )
            sampler = CheckpointSampler(settings, holder)
            parts.callback(sampler.shutdown)
        uploader = None
        if aux.upload_to_hub:
            uploader = HubUploader(aux.upload_to_hub)
            parts.callback(_wait_for_uploads, uploader)
        monitor = AuxMonitor(
            dht=swarm.dht,
            run_id=net.run_id,
            args=aux,
            holder=holder,
            replica=replica,
            checkpoints=checkpoints,
            uploader=uploader,
            validation=validation,
            sampler=sampler,
            assist=assist,
            public_key=swarm.public_key,
        )
        if aux.resume:
            monitor.resume()

        server = MonitorServer(
            MonitorApp(holder.get, refresh_seconds=aux.refresh_period), host=aux.metrics_host, port=aux.metrics_port
        ).start()
        parts.callback(server.shutdown)
        logger.info(
            "Serving the dashboard on http://%s:%d/ and Prometheus metrics on http://%s:%d/metrics",
            aux.metrics_host,
            server.port,
            aux.metrics_host,
            server.port,
        )
        events.emit("serving", port=server.port, epoch=monitor.replica.held_epoch)
        return cls(monitor=monitor, stop_requested=control.stop_requested)

    def run(self) -> None:
        """Until a stop request; the assisting thread (if any) has ended, or had 30 s to, when this returns."""
        assist = None
        if self.monitor.assist != "never":
            assist = threading.Thread(
                target=self.monitor.run_assist, args=(self.stop_requested,), name="assist-averaging", daemon=True
            )
            assist.start()
            if self.monitor.assist == "always":
                logger.info("Assisting the trainers' averaging rounds")
            else:
                logger.info("Will assist in averaging while client-mode trainers are online (--assist_in_averaging)")
        try:
            self.monitor.run(self.stop_requested)
        finally:
            self.stop_requested.set()
            if assist is not None:
                assist.join(timeout=30)
