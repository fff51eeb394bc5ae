"""``leanhive-trainer`` / ``python run_trainer.py``: parse, build, run, shut down in ``finally``."""

from __future__ import annotations

import sys
from typing import Optional, Sequence, Type

from model import load_config
from peer.model_setup import choose_placement
from peer.swarm import process_guard
from peer.swarm.cli_args import DataclassArgumentParser
from peer.swarm.config import RUN_PRESETS_DIR, CollaborationArguments, OptimizerArguments, TrainingArguments
from peer.swarm.data import DataArguments, check_tokenizer_fits, load_tokenizer
from peer.swarm.events import EventArguments
from peer.swarm.lifecycle import configure_logging, run_peer
from peer.swarm.network import NetworkArguments
from peer.trainer import TrainerConfig, TrainerPeer

DESCRIPTION = """Train a LeanHive model together with other peers.

Start a new collaboration:   leanhive-trainer --config tiny --run_id my_run
Join it (paste the line the first peer logs):
                             leanhive-trainer --config tiny --run_id my_run --initial_peers /ip4/.../p2p/12D3Koo...
Values come from the dataclass defaults, then the --config preset, then the flags given here.
"""


def build_parser() -> DataclassArgumentParser:
    return DataclassArgumentParser(
        [
            NetworkArguments,
            CollaborationArguments,
            OptimizerArguments,
            TrainingArguments,
            DataArguments,
            EventArguments,
        ],
        preset_dirs=[RUN_PRESETS_DIR],
        prog="leanhive-trainer",
        description=DESCRIPTION,
    )


def parse_config(argv: Optional[Sequence[str]] = None) -> TrainerConfig:
    """Parse and validate everything that can be checked before joining; bad values exit with status 2."""
    parser = build_parser()
    network, collaboration, optimizer, training, data, events = parser.parse_into_dataclasses(argv)
    try:
        model_config = load_config(training.model_config)
        if choose_placement(training).uses_grad_scaler and collaboration.sync_mode == "local":
            raise ValueError("--sync_mode local does not support fp16 yet: use --precision bf16 or fp32")
        check_tokenizer_fits(load_tokenizer(data), model_config.vocab_size)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    return TrainerConfig(
        network=network, collaboration=collaboration, optimizer=optimizer, training=training, data=data, events=events
    )


def main(argv: Optional[Sequence[str]] = None, *, peer_class: Type[TrainerPeer] = TrainerPeer) -> int:
    """Run a trainer peer; ``peer_class`` lets a test entry point run a subclass (run_trainer.py never does)."""
    config = parse_config(argv)
    configure_logging()
    process_guard.install()  # before any hivemind process exists
    return run_peer(peer_class(config), events_file=config.events.events_file)


if __name__ == "__main__":
    sys.exit(main())
