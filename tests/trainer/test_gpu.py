"""CUDA paths (AMP fp16 with hivemind's GradScaler, bf16): run on a GPU machine, skipped cleanly elsewhere."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.testbed.trainers import LOCAL_MODE, epoch_losses, final_params, start_trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


# fp16 per block: per-block gradient scaling (peer/grad_scaling.py) instead of hivemind's GradScaler
PRECISION_FLAGS = {
    "fp16": ["--precision", "fp16"],
    "bf16": ["--precision", "bf16"],
    "fp16_per_block": ["--precision", "fp16", "--per_block_grad_scaling", "--grad_scale_growth_interval", "2"],
    # the home presets' mode: the inner 8-bit LAMB steps the model's own parameters, its state on the GPU beside them
    "bf16_local_sparse": ["--precision", "bf16", *LOCAL_MODE, "--outer_compression", "sparse"],
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", list(PRECISION_FLAGS))
def test_training_on_cuda(tmp_path, precision):
    if precision.startswith("bf16") and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    peer = start_trainer(
        tmp_path,
        "gpu",
        f"gpu_{precision}",
        extra=["--device", "cuda", *PRECISION_FLAGS[precision], "--max_epochs", "6"],
    )
    try:
        assert peer.wait(timeout=240) == 0, peer.tail()
    finally:
        peer.kill_tree()
    losses = epoch_losses(peer)
    assert losses and all(math.isfinite(v) for v in losses.values())
    assert losses[max(losses)] < losses[min(losses)]
    assert all(torch.isfinite(t).all() for t in final_params(tmp_path / "gpu").values())
