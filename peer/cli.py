"""``leanhive-trainer`` / ``python run_trainer.py``: parse, build, run, shut down in ``finally``."""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Optional, Sequence

from peer import process_guard
from peer.arguments import CollaborationArguments, OptimizerArguments, TrainingArguments
from peer.cli_args import DataclassArgumentParser
from peer.data import DataArguments
from peer.model_setup import choose_placement, load_model_config
from peer.network import NetworkArguments, NetworkSetupError
from peer.trainer import TrainerConfig, TrainerPeer

logger = logging.getLogger(__name__)

RUN_PRESET_DIR = Path(__file__).resolve().parent.parent / "configs" / "run"
LOG_LEVEL_ENV = "LEANHIVE_LOG_LEVEL"

DESCRIPTION = """Train a LeanHive model together with other peers.

Start a new collaboration:   leanhive-trainer --config tiny --run_id my_run
Join it (paste the line the first peer logs):
                             leanhive-trainer --config tiny --run_id my_run --initial_peers /ip4/.../p2p/12D3Koo...
Values come from the dataclass defaults, then the --config preset, then the flags given here.
"""


def build_parser() -> DataclassArgumentParser:
    return DataclassArgumentParser(
        [NetworkArguments, CollaborationArguments, OptimizerArguments, TrainingArguments, DataArguments],
        preset_dirs=[RUN_PRESET_DIR], prog="leanhive-trainer", description=DESCRIPTION)


def parse_config(argv: Optional[Sequence[str]] = None) -> TrainerConfig:
    """Parse and validate everything that can be checked before joining; bad values exit with status 2."""
    parser = build_parser()
    network, collaboration, optimizer, training, data = parser.parse_into_dataclasses(argv)
    try:
        load_model_config(training.model_config)
        choose_placement(training)
    except ValueError as e:
        parser.error(str(e))
    return TrainerConfig(network=network, collaboration=collaboration, optimizer=optimizer,
                         training=training, data=data)


def configure_logging() -> None:
    """Once per process: our format and level (LEANHIVE_LOG_LEVEL, default INFO) for us and hivemind."""
    from hivemind.utils.logging import use_hivemind_log_handler

    level = os.environ.get(LOG_LEVEL_ENV, "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s [%(name)s] %(message)s", force=True)
    use_hivemind_log_handler("in_root_logger")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    # hivemind replays the LR schedule on joining, before any optimizer step: expected, not a mistake
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")


def _install_signal_handlers(peer: TrainerPeer) -> None:
    def handle(signum, _frame):
        if peer.stop_requested.is_set() or not peer.running:
            raise KeyboardInterrupt  # a second signal, or still joining: stop now
        logger.info("Received %s: finishing the current step, then leaving the swarm",
                    signal.Signals(signum).name)
        peer.request_stop()

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)


def main(argv: Optional[Sequence[str]] = None) -> int:
    config = parse_config(argv)
    configure_logging()
    process_guard.install()  # before any hivemind process exists
    peer = TrainerPeer(config)
    _install_signal_handlers(peer)
    code = 0
    try:
        peer.start()
        peer.run()
    except NetworkSetupError as e:
        logger.error("%s", e)
        code = 1
    except KeyboardInterrupt:
        logger.warning("Interrupted: leaving without finishing the current step")
    finally:
        peer.shutdown()
    return exit_despite_stray_threads(code)


def exit_despite_stray_threads(code: int) -> int:
    """End the process with ``code`` once our own shutdown has run (backup written, DHT and averagers stopped).

    A signal that interrupts hivemind.Optimizer's constructor while joining leaves parts it already started
    (its ProgressTracker thread, an averager process) without an owner, and the interpreter's exit would wait
    for them forever (multiprocessing joins its children at exit). So the CLI exits explicitly; hivemind's
    child processes die with us (process_guard).
    """
    stray = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    if stray:
        logger.debug("Exiting with threads still running: %s", ", ".join(stray))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
