"""PixelFly layout and block-sparse linear layer: exact against a dense masked reference in float64."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from model.pixelfly import (
    BlockSparsePlan,
    LowRank,
    PixelflyLinear,
    _BlockSparseMatmul,
    butterfly_block_layout,
)

# (in_features, out_features, block_size, stretch): square, wide, tall, tiled, single block
SHAPES = [
    (64, 64, 8, True),
    (32, 128, 8, True),
    (128, 32, 8, True),
    (32, 128, 8, False),
    (128, 32, 8, False),
    (16, 16, 16, True),
]


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-300)).item()


def _randomize(module: torch.nn.Module) -> None:
    """Nonzero values everywhere (the low-rank `up` starts at zero, which would hide gradient bugs)."""
    with torch.no_grad():
        for param in module.parameters():
            param.normal_()


# ---------------------------------------------------------------------------------------------------- layout


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32])
def test_square_layout_is_flat_butterfly(n):
    layout = butterfly_block_layout(n * 4, n * 4, block_size=4)
    assert layout.shape == (n, n) and layout.dtype == torch.bool
    assert bool(layout.diagonal().all())
    assert torch.equal(layout, layout.t())
    for i in range(n):
        for j in range(n):
            xor = i ^ j
            assert bool(layout[i, j]) == (xor == 0 or xor & (xor - 1) == 0)
    expected_per_row = int(math.log2(n)) + 1
    assert (layout.sum(0) == expected_per_row).all() and (layout.sum(1) == expected_per_row).all()
    assert layout.float().mean().item() == pytest.approx((math.log2(n) + 1) / n)


@pytest.mark.parametrize("stretch", [True, False])
@pytest.mark.parametrize("out_blocks,in_blocks", [(32, 8), (8, 32), (8, 16)])
def test_rectangular_layout_repeats_square_pattern(out_blocks, in_blocks, stretch):
    layout = butterfly_block_layout(out_blocks * 2, in_blocks * 2, block_size=2, stretch=stretch)
    n = min(out_blocks, in_blocks)
    square = butterfly_block_layout(n, n, block_size=1)
    ratio_out, ratio_in = out_blocks // n, in_blocks // n
    assert layout.shape == (out_blocks, in_blocks)
    for i in range(out_blocks):
        for j in range(in_blocks):
            base = (i // ratio_out, j // ratio_in) if stretch else (i % n, j % n)
            assert layout[i, j] == square[base]
    # every output sums the same number of inputs (a uniform fan-in) and every input feeds as many outputs
    assert len(layout.sum(1).unique()) == 1 and len(layout.sum(0).unique()) == 1


@pytest.mark.parametrize(
    "out_features,in_features,block_size,message",
    [
        (100, 64, 32, "out_features=100 is not a multiple of block_size=32"),
        (64, 100, 32, "in_features=100 is not a multiple of block_size=32"),
        (96, 96, 32, "power-of-two number of blocks"),
        (192, 128, 32, "must be a multiple of the smaller one"),
        (64, 64, 0, "block_size must be a positive integer"),
    ],
)
def test_layout_rejects_invalid_sizes_and_says_what_is_valid(out_features, in_features, block_size, message):
    with pytest.raises(ValueError, match=message) as error:
        butterfly_block_layout(out_features, in_features, block_size)
    if "power-of-two" in message:
        assert "valid sizes for this side are 64 or 128" in str(error.value)
    if "smaller one" in message:
        assert "multiples of 128" in str(error.value)


def test_layout_is_built_on_cpu_under_a_meta_device_context():
    with torch.device("meta"):
        layout = butterfly_block_layout(64, 64, 8)
        layer = PixelflyLinear(64, 64, block_size=8)
    assert layout.device.type == "cpu" and bool(layout.diagonal().all())
    assert layer.weight.device.type == "meta"


# ---------------------------------------------------------------------------------------------------- forward/backward


@pytest.mark.parametrize("in_features,out_features,block_size,stretch", SHAPES)
@pytest.mark.parametrize("lowrank_dim,bias", [(0, True), (3, True), (0, False)])
def test_forward_and_gradients_match_dense_masked_reference(
    in_features, out_features, block_size, stretch, lowrank_dim, bias
):
    torch.manual_seed(0)
    layer = PixelflyLinear(
        in_features,
        out_features,
        block_size=block_size,
        lowrank_dim=lowrank_dim,
        bias=bias,
        stretch=stretch,
        dtype=torch.float64,
    )
    _randomize(layer)
    x = torch.randn(2, 3, in_features, dtype=torch.float64, requires_grad=True)

    out = layer(x)
    # reference: the same parameters through a dense matrix built by scattering the blocks (plain autograd)
    reference = F.linear(x, layer.to_dense(), layer.bias)
    if lowrank_dim:
        reference = reference + x @ layer.lowrank.down @ layer.lowrank.up
    assert out.shape == (2, 3, out_features)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-12)

    grad_out = torch.randn_like(out)
    inputs = [x] + list(layer.parameters())
    grads = torch.autograd.grad(out, inputs, grad_out)
    reference_grads = torch.autograd.grad(reference, inputs, grad_out)
    for name, grad, reference_grad in zip(["input"] + [n for n, _ in layer.named_parameters()], grads, reference_grads):
        assert _rel_err(grad, reference_grad) <= 1e-6, name


def test_dense_equivalent_is_masked_to_the_layout():
    layer = PixelflyLinear(32, 128, block_size=8, dtype=torch.float64)
    dense = layer.to_dense()
    block_mask = layer.layout.repeat_interleave(8, 0).repeat_interleave(8, 1)
    assert bool((dense[~block_mask] == 0).all()) and bool((dense[block_mask] != 0).all())
    assert layer.weight.shape == (int(layer.layout.sum()), 8, 8)


@pytest.mark.parametrize(
    "in_features,out_features,block_size,stretch",
    [(16, 16, 4, True), (8, 32, 4, True), (32, 8, 4, True), (8, 32, 4, False), (32, 8, 4, False)],
)
def test_custom_function_passes_gradcheck(in_features, out_features, block_size, stretch):
    torch.manual_seed(0)
    plan = BlockSparsePlan(butterfly_block_layout(out_features, in_features, block_size, stretch), block_size)
    x = torch.randn(2, in_features, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(plan.nnz_blocks, block_size, block_size, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: _BlockSparseMatmul.apply(x, w, plan), (x, weight))


def test_plan_groups_rows_or_columns_whichever_gives_larger_gemms():
    wide = BlockSparsePlan(butterfly_block_layout(128, 32, 8), 8)  # 4 output rows share each column set
    tall = BlockSparsePlan(butterfly_block_layout(32, 128, 8), 8)  # 4 input columns share each row set
    assert wide.grouped_by_rows and not tall.grouped_by_rows
    assert len(wide.groups) == len(tall.groups) == 4


@pytest.mark.parametrize("needs", [(True, False), (False, True)])
def test_backward_computes_only_requested_gradients(needs):
    layer = PixelflyLinear(32, 64, block_size=8, bias=False, dtype=torch.float64)
    x = torch.randn(5, 32, dtype=torch.float64, requires_grad=needs[0])
    layer.weight.requires_grad_(needs[1])
    layer(x).sum().backward()
    assert (x.grad is not None) == needs[0] and (layer.weight.grad is not None) == needs[1]


def test_non_contiguous_input():
    layer = PixelflyLinear(32, 64, block_size=8, dtype=torch.float64)
    x = torch.randn(32, 6, dtype=torch.float64).t()
    torch.testing.assert_close(layer(x), F.linear(x, layer.to_dense(), layer.bias), rtol=0, atol=1e-12)


def test_autocast_runs_in_the_autocast_dtype():
    torch.manual_seed(0)
    layer = PixelflyLinear(64, 64, block_size=16)
    x = torch.randn(4, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), layer(x), rtol=0.05, atol=0.05)
    out.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------- init, low-rank


def test_init_matches_nn_linear_variance_of_the_dense_equivalent():
    torch.manual_seed(0)
    layer = PixelflyLinear(256, 1024, block_size=16, lowrank_dim=8)
    fan_in = int(layer.layout.sum(1)[0]) * 16
    assert layer.fan_in == fan_in == 5 * 16  # 16 input blocks: log2(16) + 1 per output row
    # nn.Linear default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), std = 1/sqrt(3 * fan_in)
    assert layer.weight.std().item() == pytest.approx(1 / math.sqrt(3 * fan_in), rel=0.02)
    assert layer.weight.abs().max().item() <= 1 / math.sqrt(fan_in)
    assert layer.bias.abs().max().item() <= 1 / math.sqrt(fan_in)
    assert bool((layer.lowrank.up == 0).all())  # low-rank term starts silent: output variance is the sparse one's
    # the output variance equals nn.Linear's on the same inputs (each output sums fan_in terms of the same variance)
    x = torch.randn(4096, 256)
    with torch.no_grad():
        sparse_var = (layer(x) - layer.bias).var().item()
        dense_var = F.linear(x, torch.nn.Linear(256, 1024).weight).var().item()
    assert sparse_var == pytest.approx(dense_var, rel=0.1)


def test_shared_lowrank_receives_summed_gradients_and_is_saved_once():
    torch.manual_seed(0)
    shared = LowRank(32, 64, rank=4, dtype=torch.float64)
    _randomize(shared)
    first = PixelflyLinear(32, 64, block_size=8, shared_lowrank=shared, dtype=torch.float64)
    second = PixelflyLinear(32, 64, block_size=8, shared_lowrank=shared, dtype=torch.float64)
    x = torch.randn(5, 32, dtype=torch.float64)

    def grads_of(loss):
        shared.zero_grad()
        loss.backward()
        return shared.down.grad.clone(), shared.up.grad.clone()

    separate = [grads_of(first(x).square().sum()), grads_of(second(x).pow(3).sum())]
    together = grads_of(first(x).square().sum() + second(x).pow(3).sum())
    for total, part_a, part_b in zip(together, *separate):
        assert _rel_err(total, part_a + part_b) <= 1e-12

    container = torch.nn.ModuleList([first, second])
    assert first.lowrank is second.lowrank is shared
    assert sum(1 for _, p in container.named_parameters() if p is shared.down) == 1
    keys = list(container.state_dict())
    assert keys.count("0.lowrank.down") == 1 and not any(key.startswith("1.lowrank.") for key in keys)
    clone = copy.deepcopy(container)  # a copy keeps one shared module, one owner
    assert clone[0].lowrank is clone[1].lowrank and list(clone.state_dict()) == keys
    with torch.no_grad():
        clone[0].lowrank.up.zero_()
    clone.load_state_dict(container.state_dict(), strict=True)
    assert torch.equal(clone[1].lowrank.up, shared.up)


def test_lowrank_argument_validation():
    shared = LowRank(32, 64, rank=4)
    with pytest.raises(ValueError, match="conflicts with shared_lowrank of rank 4"):
        PixelflyLinear(32, 64, block_size=8, lowrank_dim=2, shared_lowrank=shared)
    with pytest.raises(ValueError, match="32 -> 64, but this layer needs 64 -> 64"):
        PixelflyLinear(64, 64, block_size=8, shared_lowrank=shared)
    with pytest.raises(ValueError, match="lowrank_dim must be >= 0"):
        PixelflyLinear(32, 64, block_size=8, lowrank_dim=-1)


def test_meta_device_construction_and_shape_inference():
    layer = PixelflyLinear(1024, 4096, block_size=32, lowrank_dim=16, device="meta", dtype=torch.bfloat16)
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in layer.parameters())
    out = layer(torch.empty(2, 7, 1024, device="meta", dtype=torch.bfloat16))
    assert out.shape == (2, 7, 4096) and out.device.type == "meta"
    # materialise later, as from_pretrained / to_empty do
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    assert torch.isfinite(layer.weight).all()


def test_backward_saves_only_the_input_and_the_stored_blocks():
    """No gathered copies of the input are kept for backward: the memory of a dense layer's input, not more."""
    layer = PixelflyLinear(64, 256, block_size=8)
    x = torch.randn(4, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x).sum().backward()
    assert {t.untyped_storage().data_ptr() for t in saved} == {
        x.untyped_storage().data_ptr(),
        layer.weight.untyped_storage().data_ptr(),
    }
    assert sum(t.numel() for t in saved) == x.numel() + layer.weight.numel()
