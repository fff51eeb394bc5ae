"""The test-bed's seam: the only place outside ``peer/swarm/hivemind_seam/`` that reaches into hivemind's internals,
to play a faulty or hostile peer that no public API can play. Production code never imports it; each private name
below is pinned by ``tests/testbed/test_testbed.py`` (it must still exist, with the signature used here), as the
production seam's are.

- ``DecentralizedAverager._run_allreduce_inplace_``: wrapped by ``AllReduceFaults`` to corrupt what a peer sends, or
  to die in the middle of a round;
- ``DecentralizedAverager._step``: wrapped by ``AllReduceFaults`` so that a peer sits a round out (``sit_out``);
- ``BoundedAllReduceRunner._generate_input_for_peer``: wrapped by ``send_bad_shapes`` (parts of the wrong shape);
- ``RSASignatureValidator._serialize_record``: the bytes a record's signature covers (``record_bytes_to_sign``), to
  sign crafted records exactly as an honest peer does.
"""

from __future__ import annotations

import asyncio
import logging

import torch

logger = logging.getLogger(__name__)

PINNED = [
    ("hivemind.averaging.averager", "DecentralizedAverager", "_run_allreduce_inplace_"),
    ("hivemind.averaging.averager", "DecentralizedAverager", "_step"),
    ("hivemind.averaging.allreduce", "AllReduceRunner", "_generate_input_for_peer"),
    ("hivemind.dht.crypto", "RSASignatureValidator", "_serialize_record"),
]


class AllReduceFaults:
    """A mixin for an averager class: ``before_allreduce(self, kwargs)`` and ``after_allreduce(self, tensors, error)``
    run around each all-reduce round, in the averager's own process."""

    def before_allreduce(self, tensors, kwargs: dict) -> None:
        pass

    def after_allreduce(self, tensors, error) -> None:
        pass

    def sits_out_step(self) -> bool:
        """Whether the step (round) that begins now finds no group on purpose (``sit_out``)."""
        return False

    async def _step(self, *, step, future_for_init):
        if not self.sits_out_step():
            return await super()._step(step=step, future_for_init=future_for_init)
        await sit_out(step, future_for_init)

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        self.before_allreduce(tensors, kwargs)
        try:
            await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
        except BaseException as e:
            self.after_allreduce(tensors, e)
            raise
        self.after_allreduce(tensors, None)


async def sit_out(step, future_for_init) -> None:
    """hivemind's ``DecentralizedAverager._step`` for a peer that neither leads nor joins a group: it waits out the
    step's deadline (or its cancellation) and fails as hivemind does when matchmaking finds nobody. The others see
    a peer that is online and reports progress but is in none of their groups."""
    from hivemind.averaging.control import AveragingStage
    from hivemind.averaging.partition import AllreduceException
    from hivemind.utils import MPFuture, get_dht_time

    trigger, cancel = MPFuture(), MPFuture()
    step.attach(trigger, cancel)
    future_for_init.set_result((trigger, cancel))
    step.stage = AveragingStage.LOOKING_FOR_GROUP
    try:
        while not step.done() and not step.cancelled() and get_dht_time() < step.deadline:
            await asyncio.sleep(0.1)
    finally:
        step.stage = AveragingStage.FINISHED
        if not step.done():
            step.set_exception(AllreduceException("FAULT INJECTION: this peer sat the round out (no group)"))


def send_bad_shapes() -> None:
    """From now on, every part this process sends to another reducer is a 1-element tensor."""
    from hivemind.compression import serialize_torch_tensor

    from peer.swarm.hivemind_seam import BoundedAllReduceRunner

    if getattr(BoundedAllReduceRunner, "_bad_shapes", False):
        return
    original = BoundedAllReduceRunner._generate_input_for_peer

    async def bad_shapes(self, peer_index):
        async for message in original(self, peer_index):
            message.tensor_part.CopyFrom(serialize_torch_tensor(torch.ones(1)))
            yield message

    BoundedAllReduceRunner._generate_input_for_peer = bad_shapes
    BoundedAllReduceRunner._bad_shapes = True
    logger.warning("FAULT INJECTION: sending 1-element parts instead of gradient shards")


def record_bytes_to_sign(validator, record) -> bytes:
    """What ``RSASignatureValidator`` signs for ``record`` (a ``DHTRecord``)."""
    return validator._serialize_record(record)
