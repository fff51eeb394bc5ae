"""The optimizer's numerics: 8-bit LAMB (peer.swarm.lamb) against a float64 textbook reference, its clipping,
trust ratio and state dict; parameter groups without decay for biases and norms; the learning-rate schedule; the
adaptive compression of the averaged tensors (a codec per tensor size)."""

from __future__ import annotations

import math

import pytest
import torch
from hivemind.compression import BlockwiseQuantization, Float16Compression, deserialize_torch_tensor
from hivemind.compression.base import CompressionInfo

from peer.swarm.config import CollaborationArguments, OptimizerArguments
from peer.swarm.lamb import CPULamb8Bit
from peer.swarm.optimizer import learning_rate_at, make_compression, parameter_groups

pytestmark = pytest.mark.deps


def _reference_lamb_step(param, grad, state, *, lr, betas, eps, weight_decay, clamp_value, step):
    """Textbook LAMB in float64 (bias-corrected Adam direction, decoupled decay, clamped trust ratio)."""
    beta1, beta2 = betas
    state["m"] = beta1 * state["m"] + (1 - beta1) * grad
    state["v"] = beta2 * state["v"] + (1 - beta2) * grad * grad
    update = (state["m"] / (1 - beta1**step)) / ((state["v"] / (1 - beta2**step)).sqrt() + eps)
    update = update + weight_decay * param
    trust = min(float(param.norm()), clamp_value) / float(update.norm())
    return param - lr * trust * update


@pytest.mark.parametrize("quantized", [False, True])
def test_lamb_matches_reference(quantized):
    torch.manual_seed(0)
    initial = torch.randn(64, 80)
    param = torch.nn.Parameter(initial.clone())
    hyper = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1, clamp_value=10.0)
    opt = CPULamb8Bit([param], min_8bit_size=1 if quantized else 10**9, max_grad_norm=None, **hyper)
    assert ("exp_avg_q" in opt.state[param]) == quantized
    reference = initial.double()
    state = dict(m=torch.zeros_like(reference), v=torch.zeros_like(reference))
    for step in range(1, 6):
        grad = torch.randn(64, 80)
        param.grad = grad.clone()
        opt.step()
        reference = _reference_lamb_step(reference, grad.double(), state, step=step, **hyper)
    error = float((param.detach().double() - reference).abs().max() / (reference - initial.double()).abs().max())
    assert error < (0.05 if quantized else 1e-4), f"relative error {error}"  # fp32 vs a float64 reference


def test_lamb_clips_the_global_gradient_norm_and_skips_non_finite():
    a, b = torch.nn.Parameter(torch.ones(10)), torch.nn.Parameter(torch.ones(20))
    opt = CPULamb8Bit([a, b], lr=0.1, betas=(0.5, 0.9), max_grad_norm=1.0, min_8bit_size=10**9)
    a.grad, b.grad = torch.full((10,), 3.0), torch.full((20,), 4.0)
    norm = math.sqrt(10 * 9 + 20 * 16)
    opt.step()
    assert opt.last_grad_norm == pytest.approx(norm)
    # the first moment saw the clipped gradient: (1 - beta1) * grad * max_norm / norm
    assert torch.allclose(opt.state[a]["exp_avg"], torch.full((10,), 0.5 * 3.0 / norm), rtol=1e-4)
    before = [a.detach().clone(), b.detach().clone()]
    a.grad[0] = float("inf")
    opt.step()
    assert opt.skipped_steps == 1 and opt.state[a]["step"] == 1
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])


def test_lamb_trust_ratio_is_clamped():
    param = torch.nn.Parameter(torch.full((100,), 5.0))  # norm 50, clamped to 2
    opt = CPULamb8Bit([param], lr=0.1, weight_decay=0.0, clamp_value=2.0, min_8bit_size=10**9)
    param.grad = torch.randn(100)
    before = param.detach().clone()
    opt.step()
    assert float((param.detach() - before).norm()) == pytest.approx(0.1 * 2.0, rel=1e-4)


def test_lamb_state_dict_round_trip_keeps_8bit_codes():
    param = torch.nn.Parameter(torch.randn(4096))
    opt = CPULamb8Bit([param], lr=0.01, min_8bit_size=1)
    param.grad = torch.randn(4096)
    opt.step()
    other = CPULamb8Bit([torch.nn.Parameter(param.detach().clone())], lr=0.01, min_8bit_size=1)
    other.load_state_dict(opt.state_dict())
    (state,) = other.state.values()
    assert state["exp_avg_q"].dtype == torch.uint8 and state["step"] == 1
    assert torch.equal(state["exp_avg_q"], opt.state[param]["exp_avg_q"])
    # two bytes of statistics per parameter (plus one fp32 absmax per 256-element block and moment)
    assert state["exp_avg_q"].numel() + state["exp_avg_sq_q"].numel() == 2 * 4096


def test_no_decay_for_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = parameter_groups(model, weight_decay=0.1)
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1


# ------------------------------------------------------------------------------------------- schedule


def test_learning_rate_schedule():
    args = OptimizerArguments(learning_rate=1.0, min_learning_rate=0.1, warmup_steps=10, total_steps=110)
    assert learning_rate_at(0, args) == pytest.approx(0.1)
    assert learning_rate_at(9, args) == pytest.approx(1.0)
    assert learning_rate_at(60, args) == pytest.approx(0.55)  # cosine half way
    assert learning_rate_at(110, args) == pytest.approx(0.1) == learning_rate_at(500, args)
    linear = OptimizerArguments(
        learning_rate=1.0, min_learning_rate=0.2, warmup_steps=0, total_steps=100, lr_schedule="linear"
    )
    assert learning_rate_at(50, linear) == pytest.approx(0.6)


# ---------------------------------------------------------------------------------------- compression


@pytest.mark.parametrize("numel,codec,bound", [(1000, Float16Compression, 1e-3), (70000, BlockwiseQuantization, 0.02)])
def test_adaptive_compression_round_trips(numel, codec, bound):
    compression = make_compression(CollaborationArguments(compression_threshold=65536))
    torch.manual_seed(0)
    tensor = torch.randn(numel)
    serialized = compression.compress(tensor, CompressionInfo.from_tensor(tensor))
    assert serialized.compression == codec.compression_type
    restored = deserialize_torch_tensor(serialized)
    assert restored.shape == tensor.shape and torch.isfinite(restored).all()
    assert float((restored - tensor).abs().mean() / tensor.abs().mean()) <= bound


def test_the_state_survives_a_load_on_the_parameters_device_with_uint8_codes():
    """torch's load_state_dict casts the state to each parameter's device and dtype: the codes stay uint8, the state
    on the parameters' device (the host here; a GPU model's inner optimizer in local mode: test_gpu.py)."""
    params = [torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(16))]
    opt = CPULamb8Bit(params, lr=0.01, min_8bit_size=1024)
    for param in params:
        param.grad = torch.randn_like(param)
    opt.step()
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = CPULamb8Bit(copies, lr=0.01, min_8bit_size=1024)
    other.load_state_dict(opt.state_dict())
    states = [other.state[p] for p in copies]
    assert states[0]["exp_avg_q"].dtype == torch.uint8 and states[1]["exp_avg"].dtype == torch.float32
    for param, state in zip(copies, states):
        assert all(v.device == param.device for v in state.values() if torch.is_tensor(v))
    for ours, theirs in zip((opt.state[p] for p in params), states):
        assert all(torch.equal(ours[k], theirs[k]) for k in ours if torch.is_tensor(ours[k]))
