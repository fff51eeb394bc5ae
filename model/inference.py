"""KV-cached inference through a ``LayerStack`` (generation); training never takes this path.

Every stack the config can build caches exactly, the reversible one included: in inference a reversible
stack is the plain RevNet recurrence (x0, x1) -> (x1, x0 + f(x1)) that revlib runs without memory savings,
and each attention sub-layer's keys and values depend only on its own input at past positions, which never
change. Memory options (custom backward, checkpointing, chunked loss) only matter for backward and are
irrelevant here. Parameter sharing is too: the cache is indexed by layer, not by parameter group.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache

from model.ops.attention import CacheUpdate
from model.ops.rotary import RotaryTables
from model.stack import LayerStack


def _update_for(cache: Cache, layer_index: int) -> CacheUpdate:
    return lambda keys, values: cache.update(keys, values, layer_index)


def stack_forward_cached(
    stack: LayerStack,
    hidden: torch.Tensor,
    rotary: Optional[RotaryTables],
    key_padding_mask: Optional[torch.Tensor],
    cache: Cache,
) -> torch.Tensor:
    """The stack on the new tokens ``hidden`` only, reading and extending ``cache`` (one entry per layer)."""
    if not stack.reversible:
        for index in range(stack.num_layers):
            layer = stack.layer(index)
            hidden = layer.attention.forward_cached(hidden, rotary, key_padding_mask, _update_for(cache, index))
            hidden = layer.ffn(hidden, rotary, key_padding_mask)
        return hidden
    # the coupling revlib applies (see LayerStack._forward_reversible): both streams start from the input
    x0 = x1 = hidden
    for index in range(stack.num_layers):
        layer = stack.layer(index)
        x0, x1 = x1, x0 + layer.attention.forward_cached(x1, rotary, key_padding_mask, _update_for(cache, index))
        x0, x1 = x1, x0 + layer.ffn(x1, rotary, key_padding_mask)
    return x0 + x1 - hidden
