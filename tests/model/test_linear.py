"""The linear-layer factory and parameter sharing: shared matrices with per-layer adapters."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from model.linear import AdaptedLinear, SharedMatrix, make_linear, make_shared_matrix
from model.pixelfly import PixelflyLinear

F64 = dict(dtype=torch.float64)
# shared-core variants: dense, PixelFly, PixelFly with a low-rank term
CORES = [dict(block_size=0), dict(block_size=8), dict(block_size=8, lowrank_dim=3)]


def _randomize(module: nn.Module) -> None:
    with torch.no_grad():
        for param in module.parameters():
            param.normal_()


def _dense_weight(shared: SharedMatrix) -> torch.Tensor:
    core = shared.core
    if isinstance(core, PixelflyLinear):
        weight = core.to_dense()
        if core.lowrank is not None:
            weight = weight + (core.lowrank.down @ core.lowrank.up).t()
        return weight
    return core.weight


def _two_layers(core: dict, adapter_dim: int = 2):
    torch.manual_seed(0)
    shared = make_shared_matrix(32, 64, **core, **F64)
    layers = nn.ModuleList(
        [make_linear(32, 64, shared=shared, adapter_dim=adapter_dim, **core, **F64) for _ in range(2)]
    )
    return shared, layers


def test_make_linear_returns_the_right_types():
    dense = make_linear(32, 64)
    sparse = make_linear(32, 64, block_size=8, lowrank_dim=4, bias=False)
    shared = make_shared_matrix(32, 64, block_size=8)
    adapted = make_linear(32, 64, shared=shared, adapter_dim=4, block_size=8)
    assert type(dense) is nn.Linear and dense.bias is not None
    assert type(sparse) is PixelflyLinear and sparse.bias is None and sparse.lowrank.rank == 4
    assert type(shared) is SharedMatrix and type(shared.core) is PixelflyLinear and shared.core.bias is None
    assert type(make_shared_matrix(32, 64).core) is nn.Linear
    assert type(adapted) is AdaptedLinear and adapted.shared is shared and adapted.adapter.rank == 4
    x = torch.randn(2, 3, 32)
    for module in (dense, sparse, shared, adapted):
        assert (module.in_features, module.out_features) == (32, 64)
        assert module(x).shape == (2, 3, 64)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(adapter_dim=4), "adapter_dim=4 needs shared=SharedMatrix"),
        (dict(lowrank_dim=4), "lowrank_dim=4 needs a block-sparse matrix"),
        (dict(block_size=-1), "must be >= 0"),
        (dict(block_size=24), "not a multiple of block_size=24"),
    ],
)
def test_make_linear_rejects_invalid_combinations(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_linear(32, 64, **kwargs)


def test_make_linear_rejects_a_mismatched_shared_matrix():
    shared = make_shared_matrix(32, 64, block_size=8)
    with pytest.raises(ValueError, match="shared matrix maps 32 -> 64, but this layer needs 64 -> 64"):
        make_linear(64, 64, shared=shared)
    with pytest.raises(ValueError, match="block_size=16 conflicts with the shared matrix's block_size=8"):
        make_linear(32, 64, shared=shared, block_size=16)
    with pytest.raises(ValueError, match="dtype=torch.float64 differs"):
        make_linear(32, 64, shared=shared, dtype=torch.float64)
    with pytest.raises(TypeError, match="shared must be a SharedMatrix"):
        AdaptedLinear(nn.Linear(32, 64))


@pytest.mark.parametrize("core", CORES)
def test_layers_share_the_same_parameter_objects(core):
    shared, layers = _two_layers(core)
    shared_params = list(shared.parameters())
    for first, second in zip(layers[0].shared.parameters(), layers[1].shared.parameters()):
        assert first is second and first.data_ptr() == second.data_ptr()
    listed = [param for _, param in layers.named_parameters()]
    for param in shared_params:
        assert sum(p is param for p in listed) == 1
    own = 2 * 3  # per layer: adapter down, adapter up, bias
    assert len(listed) == len(shared_params) + own
    optimizer = torch.optim.SGD(layers.parameters(), lr=0.1)  # would raise on duplicate parameters
    assert sum(len(group["params"]) for group in optimizer.param_groups) == len(listed)


@pytest.mark.parametrize("core", CORES)
def test_shared_gradients_accumulate_from_both_layers(core):
    shared, layers = _two_layers(core)
    _randomize(layers)
    x = torch.randn(5, 32, **F64)

    def shared_grads(loss):
        layers.zero_grad()
        loss.backward()
        return [param.grad.clone() for param in shared.parameters()]

    first_only = shared_grads(layers[0](x).square().sum())
    second_only = shared_grads(layers[1](x).pow(3).sum())
    both = shared_grads(layers[0](x).square().sum() + layers[1](x).pow(3).sum())
    for total, part_a, part_b in zip(both, first_only, second_only):
        torch.testing.assert_close(total, part_a + part_b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("core", CORES)
def test_adapted_layer_matches_dense_reference_including_gradients(core):
    shared, layers = _two_layers(core, adapter_dim=3)
    _randomize(layers)
    layer = layers[1]
    x = torch.randn(2, 4, 32, **F64, requires_grad=True)
    out = layer(x)
    reference = F.linear(x, _dense_weight(shared), layer.bias) + x @ layer.adapter.down @ layer.adapter.up
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-12)
    inputs = [x] + list(layer.parameters())
    grad_out = torch.randn_like(out)
    for grad, reference_grad in zip(
        torch.autograd.grad(out, inputs, grad_out), torch.autograd.grad(reference, inputs, grad_out)
    ):
        assert ((grad - reference_grad).norm() / reference_grad.norm()).item() <= 1e-6


@pytest.mark.parametrize("core", CORES)
def test_fresh_adapter_is_neutral(core):
    shared, layers = _two_layers(core, adapter_dim=4)
    x = torch.randn(3, 32, **F64)
    for layer in layers:
        assert bool((layer.adapter.up == 0).all())
        assert torch.equal(layer(x), shared(x) + layer.bias)
    assert not torch.equal(layers[0].bias, layers[1].bias)  # own biases, initialised independently


@pytest.mark.parametrize("core", CORES)
def test_state_dict_lists_shared_tensors_once_and_round_trips(core):
    shared, layers = _two_layers(core)
    _randomize(layers)
    keys = list(layers.state_dict())
    shared_keys = [key for key in keys if ".shared." in key]
    assert len(shared_keys) == len(list(shared.parameters()))
    assert all(key.startswith("0.shared.") for key in shared_keys)

    _, fresh = _two_layers(core)
    fresh.load_state_dict(layers.state_dict(), strict=True)
    x = torch.randn(3, 32, **F64)
    for layer, fresh_layer in zip(layers, fresh):
        assert torch.equal(fresh_layer(x), layer(x))
    assert fresh[0].shared is fresh[1].shared

    copied = copy.deepcopy(layers)
    assert copied[0].shared is copied[1].shared and list(copied.state_dict()) == keys


def test_hugging_face_save_and_load_keeps_sharing(tmp_path):
    """save_pretrained refuses aliased tensors it does not know about; the shared matrix must be stored once."""
    transformers = pytest.importorskip("transformers")

    class TinyConfig(transformers.PretrainedConfig):
        model_type = "leanhive-linear-test"

    class TinyModel(transformers.PreTrainedModel):
        config_class = TinyConfig

        def __init__(self, config):
            super().__init__(config)
            shared = make_shared_matrix(32, 64, block_size=8, lowrank_dim=2)
            self.layers = nn.ModuleList(make_linear(32, 64, shared=shared, adapter_dim=2) for _ in range(3))
            self.post_init()

        def _init_weights(self, module):
            pass

        def forward(self, x):
            return sum(layer(x) for layer in self.layers)

    model = TinyModel(TinyConfig())
    _randomize(model)
    model.save_pretrained(tmp_path)
    loaded = TinyModel.from_pretrained(tmp_path)
    x = torch.randn(3, 32)
    assert torch.equal(loaded(x), model(x))
    assert loaded.layers[0].shared is loaded.layers[2].shared


@pytest.mark.parametrize("kwargs", [dict(), dict(block_size=32, lowrank_dim=8)])
def test_meta_device_construction(kwargs):
    layer = make_linear(1024, 4096, device="meta", dtype=torch.bfloat16, **kwargs)
    shared = make_shared_matrix(1024, 4096, device="meta", dtype=torch.bfloat16, **kwargs)
    adapted = make_linear(1024, 4096, shared=shared, adapter_dim=8, device="meta", dtype=torch.bfloat16)
    for module in (layer, shared, adapted):
        assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in module.parameters())
        out = module(torch.empty(2, 1024, device="meta", dtype=torch.bfloat16))
        assert out.shape == (2, 4096) and out.device.type == "meta"


def test_built_directly_in_the_requested_dtype():
    for module in (
        make_linear(32, 64, **F64),
        make_linear(32, 64, block_size=8, lowrank_dim=2, **F64),
        make_linear(32, 64, shared=make_shared_matrix(32, 64, **F64), adapter_dim=2),
    ):
        assert all(param.dtype == torch.float64 for param in module.parameters())
