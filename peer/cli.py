"""``leanhive-trainer`` / ``python run_trainer.py``: parse, build, run, shut down in ``finally``."""

from __future__ import annotations

import logging
import sys
from functools import partial
from typing import Optional, Sequence, Tuple

from model import load_config
from peer.memory_plan import MemoryPlan, MemoryPlanArguments, apply_plan, plan_for_training
from peer.model_setup import check_memory_options, choose_placement
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
            MemoryPlanArguments,
        ],
        preset_dirs=[RUN_PRESETS_DIR],
        prog="leanhive-trainer",
        description=DESCRIPTION,
    )


def parse_config(argv: Optional[Sequence[str]] = None) -> TrainerConfig:
    """Parse and validate everything that can be checked before joining; bad values exit with status 2.

    With --memory_budget the memory planner's choices replace the flags it plans (see peer/memory_plan.py)."""
    return parse_and_plan(argv)[0]


def parse_and_plan(argv: Optional[Sequence[str]] = None) -> Tuple[TrainerConfig, Optional[MemoryPlan], bool]:
    """(config, memory plan or None, plan_only)."""
    parser = build_parser()
    network, collaboration, optimizer, training, data, events, memory = parser.parse_into_dataclasses(argv)
    plan = None
    try:
        model_config = load_config(training.model_config)
        if choose_placement(training).uses_grad_scaler and collaboration.sync_mode == "local":
            raise ValueError("--sync_mode local does not support fp16 yet: use --precision bf16 or fp32")
        check_memory_options(training)
        check_tokenizer_fits(load_tokenizer(data), model_config.vocab_size)
        if memory.memory_budget is not None:
            plan = plan_for_training(training, data.max_sequence_length, memory)
            if not memory.plan_only:
                training = apply_plan(training, plan, model_config.reversible)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    config = TrainerConfig(
        network=network, collaboration=collaboration, optimizer=optimizer, training=training, data=data, events=events
    )
    return config, plan, memory.plan_only


def print_plan(plan: MemoryPlan) -> int:
    """--plan_only: one JSON line, then a readable table; status 1 when nothing fits."""
    print(plan.to_json())
    print(plan.table())
    return 0 if plan.chosen is not None else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run a trainer peer."""
    config, plan, plan_only = parse_and_plan(argv)
    if plan_only:
        return print_plan(plan)
    configure_logging()
    if plan is not None:
        logging.getLogger(__name__).info("memory plan: %s", plan.to_json())
    process_guard.install()  # before any hivemind process exists
    return run_peer(partial(TrainerPeer.build, config), events_file=config.events.events_file)


if __name__ == "__main__":
    sys.exit(main())
