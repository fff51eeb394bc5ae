"""PixelFly block-sparse linear layers (Pixelated Butterfly, arXiv:2112.00029) with a pure-PyTorch backend.

A PixelFly matrix is split into square blocks of ``block_size``; only blocks on the "flat butterfly" pattern are
stored and multiplied. The backend runs anywhere PyTorch does (CPU included) and supports every floating dtype:
blocks are grouped into dense sub-matrices (bicliques of the layout) and each group is one ordinary GEMM.
A hand-written ``autograd.Function`` saves only the input and the weight for backward, never the gathered blocks.

Also here: ``LowRank`` (x @ down @ up, the optional low-rank term of PixelFly, also used as a per-layer adapter)
and ``register_shared_module``, which lets several layers hold one module while ``state_dict`` lists it once.
"""

import logging
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------------------
# layout


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _powers_of_two_near(n: int) -> Tuple[int, int]:
    lower = 1 << (max(n, 1).bit_length() - 1)
    return lower, lower * 2


def _validate_layout_args(out_features: int, in_features: int, block_size: int) -> Tuple[int, int]:
    """Return (out_blocks, in_blocks) or raise a ValueError that says which sizes are valid."""
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer (e.g. 32 or 64), got {block_size!r}")
    for name, features in (("out_features", out_features), ("in_features", in_features)):
        if not isinstance(features, int) or features < 1:
            raise ValueError(f"{name} must be a positive integer, got {features!r}")
        if features % block_size:
            lower = features // block_size * block_size
            hint = f"{lower} or {lower + block_size}" if lower else f"{block_size}"
            raise ValueError(
                f"{name}={features} is not a multiple of block_size={block_size}; use a multiple of {block_size} "
                f"(e.g. {hint}) or a block_size that divides {features}"
            )
    out_blocks, in_blocks = out_features // block_size, in_features // block_size
    small, large = min(out_blocks, in_blocks), max(out_blocks, in_blocks)
    if not _is_power_of_two(small):
        lower, upper = _powers_of_two_near(small)
        raise ValueError(
            f"the smaller side of a PixelFly matrix must be a power-of-two number of blocks, got "
            f"min({out_features}, {in_features}) / block_size={block_size} = {small} blocks; valid sizes for this side "
            f"are {lower * block_size} or {upper * block_size} (or change block_size)"
        )
    if large % small:
        raise ValueError(
            f"the larger side of a PixelFly matrix must be a multiple of the smaller one, got "
            f"{large * block_size} and {small * block_size} (in blocks of {block_size}: {large} and {small}); "
            f"valid larger sizes are multiples of {small * block_size}"
        )
    return out_blocks, in_blocks


def butterfly_block_layout(out_features: int, in_features: int, block_size: int, stretch: bool = True) -> torch.Tensor:
    """Flat butterfly block pattern: BoolTensor [out_features // block_size, in_features // block_size].

    On a square grid of n blocks (n a power of two), block (i, j) is nonzero iff i == j or i XOR j is a power of two,
    i.e. log2(n) + 1 blocks per row and column. A rectangular matrix repeats the square pattern of its smaller side:
    ``stretch=True`` widens every block of the square pattern into a ratio x 1 (or 1 x ratio) tile, ``stretch=False``
    tiles the whole square pattern ratio times. Either way every row (and every column) has the same number of blocks.

    :raises ValueError: if a side is not a multiple of block_size, the smaller side is not a power-of-two number of
      blocks, or the larger side is not a multiple of the smaller one.
    """
    out_blocks, in_blocks = _validate_layout_args(out_features, in_features, block_size)
    n = min(out_blocks, in_blocks)
    index = torch.arange(n, device="cpu")  # explicit: layouts stay on CPU even under a meta/cuda device context
    xor = index[:, None] ^ index[None, :]
    square = (xor & (xor - 1)) == 0  # xor is 0 (diagonal) or a power of two
    ratio_out, ratio_in = out_blocks // n, in_blocks // n
    if stretch:
        return square.repeat_interleave(ratio_out, dim=0).repeat_interleave(ratio_in, dim=1)
    return square.repeat(ratio_out, ratio_in)


# ----------------------------------------------------------------------------------------------------------------------
# block-sparse matmul backend


class _Indices:
    """A list of indices, kept as a tensor on each device it is used on, and noted if it is a contiguous range."""

    def __init__(self, values: List[int]):
        self.values = values
        self.start = values[0] if values == list(range(values[0], values[0] + len(values))) else None
        self._tensors: Dict[torch.device, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.values)

    def on(self, device: torch.device) -> torch.Tensor:
        if device not in self._tensors:  # built lazily on the data's device, so modules can be built on "meta"
            self._tensors[device] = torch.tensor(self.values, dtype=torch.long, device=device)
        return self._tensors[device]


class _BlockSet(_Indices):
    """Block indices along one side of a matrix, with the slicing/gathering/scattering of those feature columns."""

    def __init__(self, blocks: List[int], block_size: int):
        super().__init__(blocks)
        self.block_size = block_size

    def gather(self, matrix: torch.Tensor) -> torch.Tensor:
        """These blocks' columns of matrix [rows, features] -> [rows, len(self) * block_size]; a view for a range."""
        if self.start is not None:
            return matrix.narrow(1, self.start * self.block_size, len(self) * self.block_size)
        blocked = matrix.view(matrix.shape[0], -1, self.block_size)
        return blocked.index_select(1, self.on(matrix.device)).flatten(1)

    def matmul_into(self, dest: torch.Tensor, left: torch.Tensor, right: torch.Tensor, accumulate: bool) -> None:
        """dest[:, these blocks] (+)= left @ right, writing in place (no temporary when the blocks are contiguous)."""
        if self.start is not None:
            target = dest.narrow(1, self.start * self.block_size, len(self) * self.block_size)
            target.addmm_(left, right, beta=1 if accumulate else 0)  # beta=0 ignores the uninitialised destination
            return
        blocked = dest.view(dest.shape[0], -1, self.block_size)
        product = torch.mm(left, right).view(dest.shape[0], len(self), self.block_size)
        if accumulate:
            blocked.index_add_(1, self.on(dest.device), product)
        else:
            blocked.index_copy_(1, self.on(dest.device), product)


@dataclass
class _BlockGroup:
    """A dense sub-matrix of the layout: every (row, col) block in rows x cols is nonzero; one GEMM per call."""

    rows: _BlockSet
    cols: _BlockSet
    weight_ids: _Indices  # positions of its blocks in the stored weight, row-major within the group


class BlockSparsePlan:
    """How to multiply by a block-sparse matrix with a given layout: the layout cut into dense groups.

    Blocks are grouped either by output rows that share the same set of input blocks, or by input columns that share
    the same output blocks; the grouping whose smaller GEMM dimension is larger wins (fewer, squarer GEMMs).
    The stored weight is [nnz_blocks, block_size, block_size] in row-major order of ``layout.nonzero()``.
    """

    def __init__(self, layout: torch.Tensor, block_size: int):
        layout = layout.detach().to("cpu", torch.bool)
        if layout.ndim != 2 or not bool(layout.any(0).all()) or not bool(layout.any(1).all()):
            raise ValueError(
                "a block-sparse layout must be a 2D bool tensor with a nonzero block in every row and column"
            )
        self.layout, self.block_size = layout, block_size
        self.out_blocks, self.in_blocks = layout.shape
        nonzero = layout.nonzero()
        self.block_rows, self.block_cols = nonzero[:, 0], nonzero[:, 1]
        position = torch.full(layout.shape, -1, dtype=torch.long, device="cpu")
        position[self.block_rows, self.block_cols] = torch.arange(len(nonzero), device="cpu")

        by_rows = self._group(layout)
        by_cols = [(rows, cols) for cols, rows in self._group(layout.t())]
        # the output is written once per row (no accumulation) when grouping by rows; prefer it on ties
        self.grouped_by_rows = self._gemm_size(by_rows) >= self._gemm_size(by_cols)
        chosen = by_rows if self.grouped_by_rows else by_cols
        self.groups = []
        for rows, cols in chosen:
            ids = position[torch.tensor(rows, device="cpu")[:, None], torch.tensor(cols, device="cpu")[None, :]]
            self.groups.append(
                _BlockGroup(_BlockSet(rows, block_size), _BlockSet(cols, block_size), _Indices(ids.flatten().tolist()))
            )
        weight_ids = sorted(i for group in self.groups for i in group.weight_ids.values)
        assert weight_ids == list(range(len(nonzero))), "the groups must cover every nonzero block exactly once"
        logger.debug(
            "block-sparse plan %s: %d groups by %s",
            tuple(layout.shape),
            len(self.groups),
            "rows" if self.grouped_by_rows else "columns",
        )

    @staticmethod
    def _group(layout: torch.Tensor) -> List[Tuple[List[int], List[int]]]:
        """Rows of `layout` that have the same nonzero columns, as (rows, cols) pairs in order of first appearance."""
        groups: Dict[Tuple[int, ...], List[int]] = {}
        for row, mask in enumerate(layout.tolist()):
            groups.setdefault(tuple(col for col, nz in enumerate(mask) if nz), []).append(row)
        return [(rows, list(cols)) for cols, rows in groups.items()]

    @staticmethod
    def _gemm_size(groups: List[Tuple[List[int], List[int]]]) -> int:
        return min(min(len(rows), len(cols)) for rows, cols in groups)

    @property
    def nnz_blocks(self) -> int:
        return len(self.block_rows)

    def _group_weight(self, weight: torch.Tensor, group: _BlockGroup) -> torch.Tensor:
        """The group's blocks as one dense [len(rows) * block, len(cols) * block] matrix (a copy)."""
        ids = group.weight_ids
        if ids.start is not None:
            blocks = weight.narrow(0, ids.start, len(ids))
        else:
            blocks = weight.index_select(0, ids.on(weight.device))
        rows, cols, size = len(group.rows), len(group.cols), self.block_size
        return blocks.view(rows, cols, size, size).transpose(1, 2).reshape(rows * size, cols * size)

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [batch, in_features] -> x @ W^T [batch, out_features] for the block-sparse W stored in `weight`."""
        size = self.block_size
        if self.grouped_by_rows:  # every output block is written exactly once
            out = x.new_empty(x.shape[0], self.out_blocks * size)
        else:
            out = x.new_zeros(x.shape[0], self.out_blocks * size)
        for group in self.groups:
            group.rows.matmul_into(
                out, group.cols.gather(x), self._group_weight(weight, group).t(), accumulate=not self.grouped_by_rows
            )
        return out

    def backward(
        self, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_input: bool, need_weight: bool
    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Gradients of forward w.r.t. x [batch, in] and weight [nnz, block, block], recomputing gathers per group."""
        size = self.block_size
        grad_x = grad_w = None
        if need_input:
            if self.grouped_by_rows:
                grad_x = x.new_zeros(x.shape)
            else:  # grouped by columns: every input block is written exactly once
                grad_x = x.new_empty(x.shape)
        if need_weight:
            grad_w = torch.empty_like(weight)
        for group in self.groups:
            grad_group = group.rows.gather(grad_out)  # [batch, rows * size]
            if need_input:
                group.cols.matmul_into(
                    grad_x, grad_group, self._group_weight(weight, group), accumulate=self.grouped_by_rows
                )
            if need_weight:
                grad_blocks = torch.mm(grad_group.t(), group.cols.gather(x))  # [rows * size, cols * size]
                rows, cols = len(group.rows), len(group.cols)
                grad_blocks = grad_blocks.view(rows, size, cols, size).transpose(1, 2).reshape(-1, size, size)
                grad_w.index_copy_(0, group.weight_ids.on(weight.device), grad_blocks)
        return grad_x, grad_w


class _BlockSparseMatmul(torch.autograd.Function):
    """y = x @ W_sparse^T; saves only x and the stored blocks for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, plan: BlockSparsePlan) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.plan = plan
        return plan.forward(x, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x, grad_w = ctx.plan.backward(
            grad_out.contiguous(), x, weight, need_input=ctx.needs_input_grad[0], need_weight=ctx.needs_input_grad[1]
        )
        return grad_x, grad_w, None


def blocksparse_matmul(x: torch.Tensor, weight: torch.Tensor, plan: BlockSparsePlan) -> torch.Tensor:
    """x [batch, in_features] @ W_sparse^T -> [batch, out_features]; W_sparse's blocks are weight [nnz, block, block].

    Under autocast, x and weight are cast to the autocast dtype first, as autocast does for F.linear.
    """
    device_type = x.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
    return _BlockSparseMatmul.apply(x.contiguous(), weight, plan)


# ----------------------------------------------------------------------------------------------------------------------
# modules


_SHARED_OWNERSHIP = "_shared_submodules_owned"  # on a parent: {child name: whether this parent saves it}
_SHARED_CLAIMED = "_shared_claimed"  # on a shared child: whether some parent already saves it


def register_shared_module(parent: nn.Module, name: str, child: nn.Module) -> None:
    """Register `child` as ``parent.<name>`` where several parents may hold the same child (parameter sharing).

    Parameters stay the same objects everywhere, so ``parameters()`` and ``named_parameters()`` of a model holding
    several parents list them once. ``state_dict()`` lists them once too: only the first parent registered with this
    child saves its tensors; the others leave them out on save and take the child's current values on load, so strict
    loading works and checkpoints (e.g. safetensors, which forbids aliased tensors) hold one copy.
    """
    parent.add_module(name, child)
    owned = not getattr(child, _SHARED_CLAIMED, False)
    child.__dict__[_SHARED_CLAIMED] = True
    if _SHARED_OWNERSHIP not in parent.__dict__:
        parent.__dict__[_SHARED_OWNERSHIP] = {}
        parent.register_state_dict_post_hook(_drop_unowned_shared)
        parent.register_load_state_dict_pre_hook(_fill_unowned_shared)
    parent.__dict__[_SHARED_OWNERSHIP][name] = owned


def _drop_unowned_shared(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for name, owned in module.__dict__[_SHARED_OWNERSHIP].items():
        if not owned:
            child_prefix = f"{prefix}{name}."
            for key in [key for key in state_dict if key.startswith(child_prefix)]:
                del state_dict[key]


def _fill_unowned_shared(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    for name, owned in module.__dict__[_SHARED_OWNERSHIP].items():
        if not owned:  # the owner loads the shared values; here the child just keeps (re-loads) what it holds
            for key, value in module._modules[name].state_dict(prefix=f"{prefix}{name}.").items():
                state_dict.setdefault(key, value)


class LowRank(nn.Module):
    """x @ down @ up with down [in_features, rank] and up [rank, out_features].

    ``up`` starts at zero, so the term adds nothing until trained: a layer keeps the output variance of its main
    matrix, and an adapter starts neutral.
    """

    def __init__(self, in_features: int, out_features: int, rank: int, *, device=None, dtype=None):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LowRank rank must be >= 1, got {rank}; use no low-rank term instead of rank 0")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.down = nn.Parameter(torch.empty(in_features, rank, device=device, dtype=dtype))
        self.up = nn.Parameter(torch.empty(rank, out_features, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1 / math.sqrt(self.in_features)  # nn.Linear's default for a [in -> rank] projection
        nn.init.uniform_(self.down, -bound, bound)
        nn.init.zeros_(self.up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.down) @ self.up

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"


class PixelflyLinear(nn.Module):
    """A linear layer whose matrix is PixelFly block-sparse, plus an optional (possibly shared) low-rank term.

    y = x @ W_sparse^T + x @ U @ V + bias. Only nonzero blocks are stored: ``weight`` is [nnz_blocks, block, block],
    block t being (``block_rows[t]``, ``block_cols[t]``) of the ``layout`` (row-major order).

    :param block_size: side of the square blocks; in/out features must fit ``butterfly_block_layout``
    :param lowrank_dim: rank of a low-rank term owned by this layer (0 = none)
    :param shared_lowrank: a ``LowRank`` module (or any module mapping [..., in] -> [..., out]) used by several
      layers; gradients from all of them accumulate in its parameters. Excludes an own low-rank term.
    :param stretch: how a rectangular layout repeats the square pattern (see ``butterfly_block_layout``)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        block_size: int = 32,
        lowrank_dim: int = 0,
        bias: bool = True,
        shared_lowrank: Optional[nn.Module] = None,
        stretch: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if lowrank_dim < 0:
            raise ValueError(f"lowrank_dim must be >= 0 (0 disables the low-rank term), got {lowrank_dim}")
        self.in_features, self.out_features, self.block_size = in_features, out_features, block_size
        self.plan = BlockSparsePlan(butterfly_block_layout(out_features, in_features, block_size, stretch), block_size)
        # each output sums this many inputs: the fan-in that nn.Linear's init would use for the dense equivalent
        self.fan_in = int(self.layout.sum(1).max()) * block_size
        weight_shape = (self.plan.nnz_blocks, block_size, block_size)
        self.weight = nn.Parameter(torch.empty(weight_shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.lowrank_is_shared = False
        if shared_lowrank is not None:
            _check_features(shared_lowrank, in_features, out_features, "shared_lowrank")
            if lowrank_dim not in (0, getattr(shared_lowrank, "rank", lowrank_dim)):
                raise ValueError(
                    f"lowrank_dim={lowrank_dim} conflicts with shared_lowrank of rank {shared_lowrank.rank}; "
                    f"pass lowrank_dim=0 (or {shared_lowrank.rank}) together with shared_lowrank"
                )
            register_shared_module(self, "lowrank", shared_lowrank)
            self.lowrank_is_shared = True
        elif lowrank_dim:
            self.lowrank = LowRank(in_features, out_features, lowrank_dim, device=device, dtype=dtype)
        else:
            self.lowrank = None
        self.reset_parameters()

    @property
    def layout(self) -> torch.Tensor:
        return self.plan.layout

    @property
    def block_rows(self) -> torch.Tensor:
        return self.plan.block_rows

    @property
    def block_cols(self) -> torch.Tensor:
        return self.plan.block_cols

    def reset_parameters(self) -> None:
        """nn.Linear's default init with the fan-in of the nonzero connections (the shared low-rank is left as is)."""
        bound = 1 / math.sqrt(self.fan_in)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)
        if self.lowrank is not None and not self.lowrank_is_shared:
            self.lowrank.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected input [..., {self.in_features}], got {tuple(x.shape)}")
        x2d = x.reshape(-1, self.in_features)
        out = blocksparse_matmul(x2d, self.weight, self.plan)
        # in place: the sparse output is not saved for backward, so this avoids another [batch, out] tensor
        if self.lowrank is not None:
            out = out.add_(self.lowrank(x2d))
        if self.bias is not None:
            out = out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def to_dense(self) -> torch.Tensor:
        """The sparse matrix W_sparse as a dense [out_features, in_features] tensor (differentiable; for tests)."""
        size = self.block_size
        dense = self.weight.new_zeros(self.plan.out_blocks, self.plan.in_blocks, size, size)
        device = self.weight.device
        dense = dense.index_put((self.block_rows.to(device), self.block_cols.to(device)), self.weight)
        return dense.transpose(1, 2).reshape(self.out_features, self.in_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, block_size={self.block_size}, "
            f"nnz_blocks={self.plan.nnz_blocks}, density={self.plan.nnz_blocks / self.layout.numel():.3f}, "
            f"bias={self.bias is not None}"
        )


def _check_features(module: nn.Module, in_features: int, out_features: int, what: str) -> None:
    """Raise a ValueError unless `module` maps in_features -> out_features."""
    got = (getattr(module, "in_features", None), getattr(module, "out_features", None))
    if got != (in_features, out_features):
        raise ValueError(
            f"{what} maps in_features -> out_features = {got[0]} -> {got[1]}, but this layer needs "
            f"{in_features} -> {out_features}; build {what} with matching sizes"
        )
