"""The auxiliary peer: joins the swarm without training, serves metrics/dashboard, keeps checkpoints.

Explicit lifecycle: ``AuxPeer(config)`` only stores settings; ``start()`` joins the swarm and starts the
HTTP server; ``run()`` blocks until ``request_stop()``; ``shutdown()`` releases everything and is safe
after a failed ``start()``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import List, Optional

import hivemind
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
from peer.swarm.network import NetworkArguments, connect
from peer.swarm.optimizer import build_optimizer
from peer.swarm.watchdog import DHTWatchdog

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


def build_swarm_model(model_config: str) -> LeanGPTForCausalLM:
    """The model the trainers train, on the CPU; its initial values are replaced by the swarm's state."""
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


class AuxPeer:
    def __init__(self, config: AuxConfig):
        self.config = config
        self.stop_requested = threading.Event()
        self.running = False  # set once start() is done: before that a stop request interrupts at once
        self.dht: Optional[hivemind.DHT] = None
        self.watchdog: Optional[DHTWatchdog] = None
        self.optimizer: Optional[hivemind.Optimizer] = None
        self.server: Optional[MonitorServer] = None
        self.monitor: Optional[AuxMonitor] = None
        self.uploader: Optional[HubUploader] = None
        self.sampler: Optional[CheckpointSampler] = None
        self._threads: List[threading.Thread] = []

    def start(self) -> None:
        net, aux = self.config.network, self.config.aux
        if net.client_mode:
            raise ValueError(
                "an aux peer cannot run in client mode: it must accept connections to serve its "
                "state and join averaging; drop --client_mode (or run it where its port is reachable)"
            )
        model = build_swarm_model(aux.model_config)  # before joining: a bad config fails fast
        validation = build_validation_set(self.config.data, model.config.vocab_size) if aux.eval_every else None
        checkpoints = (
            CheckpointManager(aux.checkpoint_dir, keep=aux.keep_checkpoints, model_class=type(model))
            if (aux.checkpoint_every or aux.resume)
            else None
        )

        swarm = connect(net)
        self.dht, self.watchdog = swarm.dht, swarm.watchdog
        check_sync_mode(self.dht, net.run_id, self.config.collaboration.sync_mode)  # before it declares its own

        # the trainers' own factory: same run_id, parameter groups, target batch size and compression
        self.optimizer = build_optimizer(
            model=model,
            dht=self.dht,
            run_id=net.run_id,
            signing_key=swarm.signing_key,
            batch_size_per_step=None,
            collab=self.config.collaboration,
            optim=self.config.optimizer,
            client_mode=False,
            auxiliary=True,
        )
        replica = SwarmReplica(
            model=model, optimizer=self.optimizer, load_state_timeout=self.config.collaboration.load_state_timeout
        )
        holder = StateHolder(
            MonitorState(run_id=net.run_id, initial_peers=swarm.join_line, swarm=SwarmSnapshot.empty(get_dht_time()))
        )
        if aux.upload_to_hub:
            self.uploader = HubUploader(aux.upload_to_hub)
        if aux.sample_tokens and checkpoints is not None:
            settings = SamplerSettings(
                prompt=aux.sample_prompt,
                max_new_tokens=aux.sample_tokens,
                max_seconds=aux.sample_seconds,
                tokenizer=self.config.data.tokenizer,
            )
            self.sampler = CheckpointSampler(settings, holder)
        self.monitor = AuxMonitor(
            dht=self.dht,
            run_id=net.run_id,
            args=aux,
            holder=holder,
            replica=replica,
            checkpoints=checkpoints,
            uploader=self.uploader,
            validation=validation,
            sampler=self.sampler,
        )
        if aux.resume:
            self.monitor.resume()

        self.server = MonitorServer(
            MonitorApp(holder.get, refresh_seconds=aux.refresh_period), host=aux.metrics_host, port=aux.metrics_port
        ).start()
        logger.info(
            "Serving the dashboard on http://%s:%d/ and Prometheus metrics on http://%s:%d/metrics",
            aux.metrics_host,
            self.server.port,
            aux.metrics_host,
            self.server.port,
        )
        events.emit("serving", port=self.server.port, epoch=self.monitor.replica.held_epoch)
        self.running = True

    def request_stop(self) -> None:
        self.stop_requested.set()

    def run(self) -> None:
        if self.config.aux.assist_in_averaging:
            thread = threading.Thread(
                target=self.monitor.run_assist, args=(self.stop_requested,), name="assist-averaging", daemon=True
            )
            thread.start()
            self._threads.append(thread)
            logger.info("Assisting the trainers' averaging rounds")
        self.monitor.run(self.stop_requested)

    def shutdown(self) -> None:
        self.stop_requested.set()
        for thread in self._threads:
            thread.join(timeout=30)
        if self.server is not None:
            self.server.shutdown()
        if self.uploader is not None:
            self.uploader.wait(timeout=60)
        if self.sampler is not None:
            self.sampler.shutdown()
        if self.optimizer is not None:
            self.optimizer.shutdown()
        if self.watchdog is not None:
            self.watchdog.shutdown()
        if self.dht is not None:
            self.dht.shutdown()
        logger.info("Aux peer shut down")
