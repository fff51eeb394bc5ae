"""``leanhive-aux`` / ``python run_aux_peer.py``: parse, build, run, shut down in ``finally``."""

from __future__ import annotations

import logging
import sys
from functools import partial
from typing import Optional, Sequence

from aux_monitor.arguments import AuxArguments
from aux_monitor.aux_peer import AuxConfig, AuxPeer
from model import load_config
from peer.swarm import process_guard
from peer.swarm.cli_args import DataclassArgumentParser
from peer.swarm.config import RUN_PRESETS_DIR, CollaborationArguments, OptimizerArguments, TrainingArguments
from peer.swarm.data import DataArguments
from peer.swarm.events import EventArguments
from peer.swarm.lifecycle import configure_logging, run_peer
from peer.swarm.network import NetworkArguments, NetworkSetupError

logger = logging.getLogger(__name__)

DESCRIPTION = """Run an auxiliary peer: it joins a LeanHive swarm without training, serves Prometheus metrics
and a dashboard, keeps checkpoints of the swarm's state, and can restore the swarm from them.

  leanhive-aux --run_id my_run --initial_peers /ip4/.../p2p/12D3Koo... --metrics_port 9500
  leanhive-aux --run_id my_run --resume          (restart a swarm from the newest checkpoint)

Collaboration, optimizer and data settings must be the trainers': give the aux peer the trainers' --config
preset (settings only trainers have are skipped) and the same flags on top of it.
"""


def build_parser() -> DataclassArgumentParser:
    # preset_only: one --config gives the aux peer the trainers' settings; trainer-only keys are checked, then dropped
    return DataclassArgumentParser(
        [NetworkArguments, CollaborationArguments, OptimizerArguments, DataArguments, AuxArguments, EventArguments],
        preset_only=[TrainingArguments],
        preset_dirs=[RUN_PRESETS_DIR],
        prog="leanhive-aux",
        description=DESCRIPTION,
    )


def parse_config(argv: Optional[Sequence[str]] = None) -> AuxConfig:
    """Parse and validate everything that can be checked before joining; bad values exit with status 2."""
    parser = build_parser()
    network, collaboration, optimizer, data, aux, events = parser.parse_into_dataclasses(argv)
    try:
        load_config(aux.model_config)
    except ValueError as e:
        parser.error(str(e))
    return AuxConfig(
        network=network, collaboration=collaboration, optimizer=optimizer, data=data, aux=aux, events=events
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    config = parse_config(argv)
    configure_logging()
    process_guard.install()  # before any hivemind process exists
    return run_peer(
        partial(AuxPeer.build, config),
        setup_errors=(NetworkSetupError, OSError, ValueError),
        events_file=config.events.events_file,
    )


if __name__ == "__main__":
    sys.exit(main())
