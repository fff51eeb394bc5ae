"""The checkpoint sampler: a continuation of the fixed prompt from a real checkpoint, published in the monitor
state from a background thread; a checkpoint it cannot load is logged and skipped, never raised."""

import logging

from aux_monitor.aggregation import SwarmSnapshot
from aux_monitor.sampler import CheckpointSampler, SamplerSettings
from aux_monitor.state import CheckpointInfo, MonitorState, StateHolder
from peer.swarm.data import shipped_tokenizer_dir
from tests.support.model import save_tiny_checkpoint


def test_sampler_publishes_a_continuation_and_survives_a_bad_checkpoint(tmp_path, caplog):
    holder = StateHolder(MonitorState(run_id="r", initial_peers="", swarm=SwarmSnapshot.empty()))
    settings = SamplerSettings(
        prompt="The swarm", max_new_tokens=8, max_seconds=30.0, tokenizer=str(shipped_tokenizer_dir())
    )
    sampler = CheckpointSampler(settings, holder)
    try:
        checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", epoch=3)
        sampler.submit(checkpoint)
        assert sampler.wait_idle(timeout=120)
        sample = holder.get().sample
        assert sample.epoch == 3 and sample.prompt == "The swarm" and sample.seconds > 0
        assert sample.text == sampler.sample(checkpoint).text  # greedy: the checkpoint always continues alike

        with caplog.at_level(logging.ERROR, logger="aux_monitor.sampler"):
            sampler.submit(CheckpointInfo(epoch=9, time=0.0, path=str(tmp_path / "deleted_by_rotation")))
            assert sampler.wait_idle(timeout=60)
        assert holder.get().sample == sample  # unchanged
        assert any("Could not generate a sample" in r.getMessage() for r in caplog.records)
    finally:
        sampler.shutdown()
    assert not sampler._thread.is_alive()
