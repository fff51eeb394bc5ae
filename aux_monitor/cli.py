"""``leanhive-aux`` / ``python run_aux_peer.py``: parse, build, run, shut down in ``finally``."""
from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import typing
from typing import Optional, Sequence, Type

from aux_monitor.arguments import AuxArguments
from aux_monitor.aux_peer import AuxConfig, AuxPeer
from model import load_config
from peer import process_guard
from peer.arguments import CollaborationArguments, OptimizerArguments, TrainingArguments
from peer.cli import RUN_PRESET_DIR, configure_logging
from peer.cli_args import DataclassArgumentParser, _flag_kwargs
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


class SharedPresetParser(DataclassArgumentParser):
    """Reads the trainers' run presets as well: values of trainer-only settings are type-checked, then dropped.

    So one ``--config`` gives the aux peer exactly the trainers' collaboration, optimizer and data settings,
    while a misspelt key still ends the program. Trainer-only settings get no command-line flag.
    """

    def __init__(self, dataclass_types: Sequence[Type], *, preset_only: Sequence[Type], **kwargs):
        super().__init__(dataclass_types, **kwargs)
        for cls in preset_only:
            hints = typing.get_type_hints(cls)
            for field in dataclasses.fields(cls):
                if field.init and field.name not in self._owner:
                    # owned by a class that is never constructed, so parse_into_dataclasses drops the value
                    self._owner[field.name] = cls
                    self._parsers[field.name] = _flag_kwargs(hints[field.name])


def build_parser() -> DataclassArgumentParser:
    return SharedPresetParser(
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


def _install_signal_handlers(peer: AuxPeer) -> None:
    def handle(signum, _frame):
        logger.info("Received %s: shutting down", signal.Signals(signum).name)
        peer.request_stop()

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)


def main(argv: Optional[Sequence[str]] = None) -> int:
    config = parse_config(argv)
    configure_logging()
    process_guard.install()  # before any hivemind process exists
    peer = AuxPeer(config)
    _install_signal_handlers(peer)
    try:
        peer.start()
        peer.run()
    except (NetworkSetupError, OSError, ValueError) as e:
        logger.error("%s", e)
        return 1
    finally:
        peer.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
