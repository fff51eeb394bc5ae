"""Linear layers the model builds everywhere: dense, PixelFly block-sparse, or shared across layers with adapters.

``make_linear`` is the one factory. Parameter sharing: build a ``SharedMatrix`` once (``make_shared_matrix``) and pass
it as ``shared=`` to several ``make_linear`` calls; each call returns an ``AdaptedLinear`` that adds its own low-rank
adapter and bias to the shared product. The shared parameters are the same objects in every layer, so optimizers,
``parameters()`` and ``state_dict()`` see them once (see ``register_shared_module``).
"""

import logging
import math
from typing import Optional

import torch
import torch.nn as nn

from model.pixelfly import LowRank, PixelflyLinear, register_shared_module

logger = logging.getLogger(__name__)


def _check_sizes(in_features: int, out_features: int, block_size: int, lowrank_dim: int) -> None:
    for name, value in (("in_features", in_features), ("out_features", out_features)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if block_size < 0 or lowrank_dim < 0:
        raise ValueError(
            f"block_size and lowrank_dim must be >= 0 (0 = dense / no low-rank term), got {block_size}, {lowrank_dim}"
        )
    if lowrank_dim and not block_size:
        raise ValueError(
            f"lowrank_dim={lowrank_dim} needs a block-sparse matrix (block_size > 0): a low-rank term adds nothing to "
            "a dense matrix; set block_size (e.g. 32) or lowrank_dim=0"
        )


def _build_core(
    in_features: int, out_features: int, *, bias: bool, block_size: int, lowrank_dim: int, device, dtype
) -> nn.Module:
    """nn.Linear when block_size == 0, else PixelflyLinear (with an own low-rank term of rank lowrank_dim)."""
    _check_sizes(in_features, out_features, block_size, lowrank_dim)
    if not block_size:
        return nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
    return PixelflyLinear(
        in_features, out_features, block_size=block_size, lowrank_dim=lowrank_dim, bias=bias, device=device, dtype=dtype
    )


class SharedMatrix(nn.Module):
    """One weight matrix (no bias) meant to be used by several layers: a dense [out, in] weight or a PixelFly core.

    Pass it to ``make_linear(..., shared=...)`` / ``AdaptedLinear``; do not register it elsewhere in the model.
    """

    def __init__(
        self, in_features: int, out_features: int, *, block_size: int = 0, lowrank_dim: int = 0, device=None, dtype=None
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block_size, self.lowrank_dim = block_size, lowrank_dim
        self.core = _build_core(
            in_features,
            out_features,
            bias=False,
            block_size=block_size,
            lowrank_dim=lowrank_dim,
            device=device,
            dtype=dtype,
        )

    @property
    def fan_in(self) -> int:
        """Inputs summed into each output: in_features when dense, fewer when block-sparse (used for bias init)."""
        return getattr(self.core, "fan_in", self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.core(x)


class AdaptedLinear(nn.Module):
    """A layer over a SharedMatrix: y = shared(x) + (x @ A) @ B + bias, with adapter A, B and bias its own.

    B starts at zero, so a fresh layer computes exactly shared(x) + bias. Built on the shared matrix's device/dtype.
    """

    def __init__(self, shared: SharedMatrix, *, adapter_dim: int = 0, bias: bool = True):
        super().__init__()
        if not isinstance(shared, SharedMatrix):
            raise TypeError(f"shared must be a SharedMatrix (see make_shared_matrix), got {type(shared).__name__}")
        if adapter_dim < 0:
            raise ValueError(f"adapter_dim must be >= 0 (0 = no adapter), got {adapter_dim}")
        self.in_features, self.out_features = shared.in_features, shared.out_features
        register_shared_module(self, "shared", shared)
        reference = next(shared.parameters())
        factory = dict(device=reference.device, dtype=reference.dtype)
        self.adapter = LowRank(self.in_features, self.out_features, adapter_dim, **factory) if adapter_dim else None
        self.bias = nn.Parameter(torch.empty(self.out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Reset this layer's own parameters (adapter and bias); the shared matrix is left as is."""
        if self.adapter is not None:
            self.adapter.reset_parameters()
        if self.bias is not None:
            bound = 1 / math.sqrt(self.shared.fan_in)  # nn.Linear's bias init for the shared matrix's fan-in
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared(x)  # a fresh tensor nothing saves for backward: safe to add into in place
        if self.adapter is not None:
            out = out.add_(self.adapter(x))
        if self.bias is not None:
            out = out.add_(self.bias)
        return out

    def extra_repr(self) -> str:
        adapter_dim = self.adapter.rank if self.adapter is not None else 0
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, adapter_dim={adapter_dim}, "
            f"bias={self.bias is not None}"
        )


def make_shared_matrix(
    in_features: int, out_features: int, *, block_size: int = 0, lowrank_dim: int = 0, device=None, dtype=None
) -> SharedMatrix:
    """A matrix to share across layers: dense if block_size == 0, else PixelFly (+ low-rank term of lowrank_dim)."""
    return SharedMatrix(
        in_features, out_features, block_size=block_size, lowrank_dim=lowrank_dim, device=device, dtype=dtype
    )


def make_linear(
    in_features: int,
    out_features: int,
    *,
    bias: bool = True,
    block_size: int = 0,
    lowrank_dim: int = 0,
    shared: Optional[SharedMatrix] = None,
    adapter_dim: int = 0,
    device=None,
    dtype=None,
) -> nn.Module:
    """The linear layer for every projection of the model; maps [..., in_features] -> [..., out_features].

    - ``shared`` given: ``AdaptedLinear`` over it (own adapter of rank ``adapter_dim`` and own bias). ``block_size``
      and ``lowrank_dim`` may be left 0 or repeat the shared matrix's values; the shared matrix decides them.
    - else ``block_size == 0``: ``nn.Linear``; ``block_size > 0``: ``PixelflyLinear`` (with a low-rank term of rank
      ``lowrank_dim`` if nonzero).
    """
    if shared is None:
        if adapter_dim:
            raise ValueError(
                f"adapter_dim={adapter_dim} needs shared=SharedMatrix (adapters specialise a shared matrix per layer); "
                "pass shared=make_shared_matrix(...) or adapter_dim=0"
            )
        return _build_core(
            in_features,
            out_features,
            bias=bias,
            block_size=block_size,
            lowrank_dim=lowrank_dim,
            device=device,
            dtype=dtype,
        )
    if (shared.in_features, shared.out_features) != (in_features, out_features):
        raise ValueError(
            f"shared matrix maps {shared.in_features} -> {shared.out_features}, but this layer needs "
            f"{in_features} -> {out_features}; share a matrix only between projections of the same shape"
        )
    for name, asked, actual in (
        ("block_size", block_size, shared.block_size),
        ("lowrank_dim", lowrank_dim, shared.lowrank_dim),
    ):
        if asked not in (0, actual):
            raise ValueError(
                f"{name}={asked} conflicts with the shared matrix's {name}={actual}; pass 0 or {actual} with shared="
            )
    _check_same_placement(shared, device, dtype)
    return AdaptedLinear(shared, adapter_dim=adapter_dim, bias=bias)


def _check_same_placement(shared: SharedMatrix, device, dtype) -> None:
    """An AdaptedLinear lives where its shared matrix does; refuse a request for another device or dtype."""
    reference = next(shared.parameters())
    if device is not None:
        device = torch.device(device)
        if device.type != reference.device.type or device.index not in (None, reference.device.index):
            raise ValueError(
                f"device={device} differs from the shared matrix's device {reference.device}; "
                "build the shared matrix on the same device"
            )
    if dtype is not None and dtype != reference.dtype:
        raise ValueError(
            f"dtype={dtype} differs from the shared matrix's dtype {reference.dtype}; "
            "build the shared matrix with the same dtype"
        )
