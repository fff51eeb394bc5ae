"""The layer stack: plain, checkpointed (one saved hidden state per layer) or reversible (revlib, or
model.reversible when its backward is chunked).

Parameter sharing lives here too: ALBERT-style groups of consecutive layers reuse one ``LeanLayer``,
and ``share_large_matrices`` hands every layer the same projection matrices (each layer keeps its own
norms, biases and optional low-rank adapters).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.utils.checkpoint
from revlib.core import ReversibleModule, replace_grad

from model.config import LeanTransformerConfig
from model.grad_scaling import BlockGradScales, divide_grad, multiply_grad
from model.layers import LeanLayer
from model.linear import make_shared_matrix
from model.ops.rotary import RotaryTables
from model.reversible import ReversibleChunks, reversible_stack


def _make_shared_matrices(config: LeanTransformerConfig) -> Dict[str, nn.Module]:
    """One matrix per projection kind; each AdaptedLinear registers it (state_dict lists it once)."""
    return {
        name: make_shared_matrix(fan_in, fan_out, block_size=config.block_size, lowrank_dim=config.lowrank_dim)
        for name, (fan_in, fan_out) in config.projection_shapes().items()
    }


CHUNKED_REVERSIBLE_SCALING_ERROR = (
    "per-block gradient scaling cannot be combined with the chunked reversible backward (its hand-written "
    "backward bypasses the sub-layers' scaled branches): set reversible_chunk_tokens and reversible_chunk_heads "
    "to 0 (revlib's backward, which supports it) or turn per_block_grad_scaling off"
)


class LayerStack(nn.Module):
    """``num_hidden_layers`` layers over ``num_hidden_groups`` parameter groups."""

    def __init__(self, config: LeanTransformerConfig):
        super().__init__()
        self.num_layers = config.num_hidden_layers
        self.layers_per_group = config.num_hidden_layers // config.num_hidden_groups
        # not registered here: the layers' AdaptedLinear modules register (and save) them
        shared = _make_shared_matrices(config) if config.share_large_matrices else None
        # a reversible stack adds residuals through revlib's coupling, so sub-layers return f(x) only
        self.groups = nn.ModuleList(
            LeanLayer(config, shared, residual=not config.reversible) for _ in range(config.num_hidden_groups)
        )
        self.reversible = config.reversible
        self.checkpoint_layers = config.checkpoint_layers
        # False runs the reversible architecture with plain autograd (the reference); a memory option
        self.reversible_memory_savings = True
        # chunked reversible backward (model.reversible); all zero keeps revlib's whole-sub-layer backward
        self.reversible_chunks = ReversibleChunks(config.reversible_chunk_tokens, config.reversible_chunk_heads)
        # per-block gradient scaling (model.grad_scaling); set by model.memory.apply_memory_options
        self.grad_scales: Optional[BlockGradScales] = None

    def layer(self, index: int) -> LeanLayer:
        return self.groups[index // self.layers_per_group]

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: Optional[RotaryTables] = None,
        key_padding_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        scales = self.grad_scales
        if scales is None:
            return self._forward_layers(hidden, rotary, key_padding_mask)
        # block 0 (outside the stack) runs at its own factor: divided out of the gradient entering the stack
        # from the head, multiplied back into the gradient leaving it for the embeddings
        hidden = self._forward_layers(multiply_grad(hidden, scales, 0), rotary, key_padding_mask)
        return divide_grad(hidden, scales, 0)

    def _forward_layers(self, hidden, rotary, key_padding_mask):
        if self.reversible:
            return self._forward_reversible(hidden, rotary, key_padding_mask)
        for index in range(self.num_layers):
            layer = self.layer(index)
            if self.checkpoint_layers and torch.is_grad_enabled():
                hidden = _checkpoint(layer, hidden, rotary, key_padding_mask)
            else:
                hidden = layer(hidden, rotary, key_padding_mask)
        return hidden

    def _sublayers(self) -> List[nn.Module]:
        return [sub for index in range(self.num_layers) for sub in (self.layer(index).attention, self.layer(index).ffn)]

    def _forward_reversible(self, hidden, rotary, key_padding_mask):
        # Both streams start from the input; stream sums reproduce x + f1 + g1 + ... (see lean_transformer).
        # Wrappers are rebuilt per call: they hold no parameters and capture the current autocast state.
        savings = self.reversible_memory_savings and torch.is_grad_enabled()
        autocast = _AutocastState.current(hidden.device.type)
        if savings and (self.reversible_chunks.tokens or self.reversible_chunks.heads):
            if self.grad_scales is not None:
                raise ValueError(CHUNKED_REVERSIBLE_SCALING_ERROR)
            return reversible_stack(
                self._sublayers(), hidden, rotary, key_padding_mask, self.reversible_chunks, autocast
            )
        wrappers = [ReversibleModule(_WithAutocast(sub, autocast), memory_savings=savings) for sub in self._sublayers()]
        zeros = torch.zeros_like(hidden)
        streams = (hidden, hidden, zeros, zeros) if savings else (hidden, hidden)
        for wrapper in wrappers:
            streams = wrapper(streams, rotary, key_padding_mask)
        out0, out1 = replace_grad(*streams) if savings else streams[:2]
        return out0 + out1 - hidden


class _AutocastState:
    def __init__(self, device_type: str, enabled: bool, dtype: torch.dtype):
        self.device_type, self.enabled, self.dtype = device_type, enabled, dtype

    @classmethod
    def current(cls, device_type: str) -> "_AutocastState":
        return cls(device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))

    def context(self):
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


class _WithAutocast(nn.Module):
    """Runs a sub-layer under the autocast state of the forward pass, also when revlib recomputes it
    in backward (revlib's autograd Function would otherwise recompute it in full precision)."""

    def __init__(self, sublayer: nn.Module, autocast: _AutocastState):
        super().__init__()
        self.sublayer, self.autocast = sublayer, autocast

    def forward(self, hidden, rotary, key_padding_mask):
        with self.autocast.context():
            return self.sublayer(hidden, rotary, key_padding_mask)


def _checkpoint(layer: nn.Module, hidden, rotary, key_padding_mask):
    """Keep only the layer input; recompute the layer in backward."""
    # The reentrant variant saves exactly its tensor inputs (one hidden state per layer) through
    # save_for_backward; it needs an input that requires grad, otherwise use the non-reentrant one.
    return torch.utils.checkpoint.checkpoint(
        layer, hidden, rotary, key_padding_mask, use_reentrant=hidden.requires_grad, preserve_rng_state=True
    )
