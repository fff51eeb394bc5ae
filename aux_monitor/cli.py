"""``leanhive-aux`` / ``python run_aux_peer.py``: parse, build, run, shut down in ``finally``."""
from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence

from aux_monitor.arguments import AuxArguments
from aux_monitor.aux_peer import AuxConfig, AuxPeer
from model import load_config
from peer import process_guard
from peer.arguments import CollaborationArguments, OptimizerArguments, TrainingArguments
from peer.cli import RUN_PRESET_DIR, configure_logging, run_peer
from peer.cli_args import DataclassArgumentParser
from peer.data import DataArguments
from peer.network import NetworkArguments, NetworkSetupError

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
        [NetworkArguments, CollaborationArguments, OptimizerArguments, DataArguments, AuxArguments],
        preset_only=[TrainingArguments], preset_dirs=[RUN_PRESET_DIR], prog="leanhive-aux",
        description=DESCRIPTION)


def parse_config(argv: Optional[Sequence[str]] = None) -> AuxConfig:
    """Parse and validate everything that can be checked before joining; bad values exit with status 2."""
    parser = build_parser()
    network, collaboration, optimizer, data, aux = parser.parse_into_dataclasses(argv)
    try:
        load_config(aux.model_config)
    except ValueError as e:
        parser.error(str(e))
    return AuxConfig(network=network, collaboration=collaboration, optimizer=optimizer, data=data, aux=aux)


def main(argv: Optional[Sequence[str]] = None) -> int:
    config = parse_config(argv)
    configure_logging()
    process_guard.install()  # before any hivemind process exists
    return run_peer(AuxPeer(config), setup_errors=(NetworkSetupError, OSError, ValueError))


if __name__ == "__main__":
    sys.exit(main())
