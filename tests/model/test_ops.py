"""torch.autograd.gradcheck on every custom autograd Function, and the attention cores against the
plain reference (float64)."""

import pytest
import torch
import torch.nn as nn

from model.ops.attention import AttentionSpec, LeanAttentionFunction
from model.ops.attention_core import attention_backward, attention_forward, attention_reference
from model.ops.ffn import FFNSpec, LeanFFNFunction
from model.ops.loss import ChunkedLMLossFunction
from model.ops.projection import ComputeContext, projection_params
from model.ops.rotary import rotary_tables, rotate, rotate_, rotate_inverse_into

DTYPE = torch.float64
COMPUTE = ComputeContext("cpu", DTYPE, False)
HIDDEN, HEADS, BATCH, SEQ = 8, 2, 2, 5


class LowRankPlusDense(nn.Module):
    """A projection that is not nn.Linear: exercises the generic (recompute + autograd) projection path."""

    def __init__(self, fan_in, fan_out):
        super().__init__()
        self.dense = nn.Linear(fan_in, fan_out, dtype=DTYPE)
        self.down = nn.Parameter(torch.randn(fan_in, 2, dtype=DTYPE))
        self.up = nn.Parameter(torch.randn(2, fan_out, dtype=DTYPE))

    def forward(self, x):
        return self.dense(x) + x @ self.down @ self.up


def _projection(fan_in, fan_out, generic):
    return LowRankPlusDense(fan_in, fan_out) if generic else nn.Linear(fan_in, fan_out, dtype=DTYPE)


def _norm_params(enabled=True):
    if not enabled:
        return None, None
    weight = (1 + 0.1 * torch.randn(HIDDEN, dtype=DTYPE)).requires_grad_()
    return weight, (0.1 * torch.randn(HIDDEN, dtype=DTYPE)).requires_grad_()


def _input():
    return torch.randn(BATCH, SEQ, HIDDEN, dtype=DTYPE, requires_grad=True)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("variant", ["plain", "sandwich", "dropout", "generic_projection", "no_residual"])
def test_ffn_function_gradcheck(variant, gated):
    torch.manual_seed(0)
    inner = 6
    up = _projection(HIDDEN, inner * (2 if gated else 1), variant == "generic_projection")
    down = _projection(inner, HIDDEN, variant == "generic_projection")
    spec = FFNSpec(
        up=up,
        down=down,
        activation="gelu",
        gated=gated,
        eps=1e-5,
        dropout_p=0.3,
        dropout_seed=1234 if variant == "dropout" else None,
        residual=variant != "no_residual",
        compute=COMPUTE,
    )
    inputs = (
        _input(),
        *_norm_params(),
        *_norm_params(variant == "sandwich"),
        spec,
        *projection_params(up),
        *projection_params(down),
    )
    assert torch.autograd.gradcheck(LeanFFNFunction.apply, inputs)


@pytest.mark.parametrize(
    "variant",
    [
        "causal",
        "bidirectional",
        "padding",
        "attention_dropout",
        "hidden_dropout",
        "absolute",
        "sandwich",
        "generic_projection",
        "no_residual",
    ],
)
def test_attention_function_gradcheck(variant):
    torch.manual_seed(0)
    qkv = _projection(HIDDEN, 3 * HIDDEN, variant == "generic_projection")
    out = _projection(HIDDEN, HIDDEN, variant == "generic_projection")
    spec = AttentionSpec(
        qkv=qkv,
        out=out,
        num_heads=HEADS,
        causal=variant != "bidirectional",
        eps=1e-5,
        attn_dropout_p=0.3,
        attn_dropout_seed=99 if variant == "attention_dropout" else None,
        dropout_p=0.2,
        dropout_seed=7 if variant == "hidden_dropout" else None,
        residual=variant != "no_residual",
        compute=COMPUTE,
    )
    cos, sin = (None, None) if variant == "absolute" else rotary_tables(SEQ, HIDDEN // HEADS, 10000.0, "cpu", DTYPE)
    mask = None
    if variant in ("padding", "attention_dropout"):
        mask = torch.ones(BATCH, SEQ, dtype=torch.bool)
        mask[0, :2] = False
        mask[1, -1] = False
    inputs = (
        _input(),
        *_norm_params(),
        *_norm_params(variant == "sandwich"),
        cos,
        sin,
        mask,
        spec,
        *projection_params(qkv),
        *projection_params(out),
    )
    assert torch.autograd.gradcheck(LeanAttentionFunction.apply, inputs)


@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_loss_gradcheck(with_bias):
    torch.manual_seed(0)
    hidden = torch.randn(9, 4, dtype=DTYPE, requires_grad=True)
    weight = torch.randn(11, 4, dtype=DTYPE, requires_grad=True)
    bias = torch.randn(11, dtype=DTYPE, requires_grad=True) if with_bias else None
    labels = torch.randint(0, 11, (9,))
    labels[[1, 5]] = -100
    needs = (True, True, with_bias)
    assert torch.autograd.gradcheck(ChunkedLMLossFunction.apply, (hidden, weight, bias, labels, 4, DTYPE, needs))


def test_rotary_inverse_is_transpose_and_in_place_variants_agree():
    cos, sin = rotary_tables(SEQ, 6, 100.0, "cpu", DTYPE)
    x, y = torch.randn(2, SEQ, 3, 6, dtype=DTYPE), torch.randn(2, SEQ, 3, 6, dtype=DTYPE)
    assert torch.allclose(rotate(rotate(x, cos, sin), cos, sin, inverse=True), x)
    assert torch.allclose((rotate(x, cos, sin) * y).sum(), (x * rotate(y, cos, sin, inverse=True)).sum())
    buffer = torch.stack([x, y], dim=2)  # rotate a strided view in place, as the attention Function does
    assert torch.allclose(rotate_(buffer[:, :, 0], cos, sin), rotate(x, cos, sin))
    out = torch.empty_like(buffer)
    assert torch.allclose(rotate_inverse_into(y, cos, sin, out[:, :, 1]), rotate(y, cos, sin, inverse=True))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("core", ["flash", "chunked", "chunked_dropout"])
def test_attention_cores_match_reference(causal, padding, core, monkeypatch):
    dropout = core == "chunked_dropout"  # the flash core has no dropout: dropout always runs the chunked core
    if core != "flash":  # the chunked core runs by itself on GPUs; force it here, with several chunks
        monkeypatch.setattr("model.ops.attention_core.use_flash", lambda q, seed: False)
        monkeypatch.setattr("model.ops.attention_core._CHUNK_ELEMENTS", 2 * 3 * 4 * 16)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 4, dtype=DTYPE, requires_grad=True) for _ in range(3))
    mask = None
    if padding:
        mask = torch.ones(2, 16, dtype=torch.bool)
        mask[0, :4] = False
        mask[1, 10:] = False
    seed = 5 if dropout else None
    expected = attention_reference(q, k, v, causal, mask, 0.25, seed)
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    with torch.no_grad():
        out, lse = attention_forward(q, k, v, causal, mask, 0.25, seed)
        grads = attention_backward(grad_out, q, k, v, out, lse, causal, mask, 0.25, seed)
    assert torch.allclose(out, expected, rtol=1e-10, atol=1e-12)
    for grad, expected_grad in zip(grads, expected_grads):
        assert torch.allclose(grad, expected_grad, rtol=1e-10, atol=1e-12)


def test_chunked_core_keeps_low_precision_inputs_accurate(monkeypatch):
    """bf16 inputs: scores, softmax and accumulators run in fp32 (the chunked core serves GPUs)."""
    monkeypatch.setattr("model.ops.attention_core.use_flash", lambda q, seed: False)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 64, 16, dtype=DTYPE, requires_grad=True) for _ in range(3))
    expected = attention_reference(q, k, v, True, None, 0.0, None)
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    low = [t.detach().to(torch.bfloat16) for t in (q, k, v)]
    out, lse = attention_forward(*low, True, None, 0.0, None)
    grads = attention_backward(grad_out.to(torch.bfloat16), *low, out, lse, True, None, 0.0, None)
    assert lse.dtype == torch.float32 and out.dtype == torch.bfloat16
    assert torch.allclose(out.double(), expected, atol=3e-2)
    for grad, expected_grad in zip(grads, expected_grads):
        assert grad.dtype == torch.bfloat16
        assert torch.allclose(grad.double(), expected_grad, atol=5e-2, rtol=5e-2)
