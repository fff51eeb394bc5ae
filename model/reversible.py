"""Reversible stack with chunked backward: the FFN backward a few tokens at a time, attention a few heads at a time.

The coupling is revlib's (the reference, ``model.stack``): each sub-layer f maps the streams (a, b) to
(b, a + f(b)); both streams start from the input and the output is a + b - input. Forward keeps only the
last two streams. Backward walks the sub-layers in reverse, rebuilding each input from the outputs
(a = (a + f(b)) - f(b)) while it computes the vector-Jacobian product of f, in place in four
hidden-size buffers (two streams, two stream gradients):

* FFN: every token is independent, so f and its backward run on ``chunk_tokens`` tokens at a time
  (``grad(concat(f(x1), f(x2))) = concat(grad(f(x1)), grad(f(x2)))``); the hidden-dropout mask is drawn
  for the whole output, as in forward, and applied to each chunk.
* Attention (dense projections, no attention-probability dropout): the output projection sums the
  heads' contributions, so q/k/v, the attention core and its backward run ``chunk_heads`` heads at a
  time; layer norm statistics and the (sandwich norm, dropout) tail are shared by all chunks. Other
  attention sub-layers (PixelFly or shared matrices, probability dropout, whose mask depends on the
  number of heads) run their whole backward at once.

Parameter gradients are accumulated into ``.grad`` directly, as revlib does. The tests compare every
path with the plain-autograd reversible reference in float64.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from model.layers import LeanFFN, LeanSelfAttention
from model.ops.attention import _heads_first, _split_heads, _unflatten_heads
from model.ops.attention_core import attention_backward, attention_forward
from model.ops.dropout import keep_mask
from model.ops.norm import layer_norm_with_stats
from model.ops.projection import is_dense
from model.ops.rotary import RotaryTables, rotate_, rotate_inverse_into
from model.ops.sublayer import no_autocast, norm_input_backward, tail_backward, tail_forward


@dataclasses.dataclass(frozen=True)
class ReversibleChunks:
    """Chunk sizes of the reversible backward; 0 = the whole sequence / all heads at once."""

    tokens: int = 0
    heads: int = 0


@dataclasses.dataclass(frozen=True, eq=False)
class _StackCall:
    """The non-differentiable part of one stack call."""

    sublayers: Sequence[torch.nn.Module]
    rotary: Optional[RotaryTables]
    key_padding_mask: Optional[torch.Tensor]
    chunks: ReversibleChunks
    autocast: object  # model.stack._AutocastState


def reversible_stack(sublayers, hidden, rotary, key_padding_mask, chunks: ReversibleChunks, autocast) -> torch.Tensor:
    """x + f1 + g1 + ... computed reversibly (see the module docstring); backward is chunked."""
    call = _StackCall(list(sublayers), rotary, key_padding_mask, chunks, autocast)
    return _ChunkedReversibleFunction.apply(hidden, call)


class _ChunkedReversibleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, call: _StackCall):
        stream0, stream1 = hidden, hidden
        rng_states = []
        for sublayer in call.sublayers:
            rng_states.append(torch.get_rng_state())  # dropout seeds are drawn from the CPU generator
            # a + f(b) in place in a, once a is a buffer of this forward (the first a is the input)
            target = hidden.clone() if stream0 is hidden else stream0
            with call.autocast.context():
                _add_update(sublayer, stream1, target, call)
            stream0, stream1 = stream1, target
        ctx.call, ctx.rng_states = call, rng_states
        ctx.save_for_backward(stream0, stream1)
        return stream0 + stream1 - hidden

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        call: _StackCall = ctx.call
        # the saved streams become the working buffers (rebuilt in place, layer by layer): no second backward
        out0, out1 = ctx.saved_tensors
        grad0, grad1 = grad.contiguous().clone(), grad.contiguous().clone()
        for sublayer, rng_state in zip(reversed(call.sublayers), reversed(ctx.rng_states)):
            # out0 = b (the sub-layer input), out1 = a + f(b): out1 becomes a, grad0 becomes grad(b)
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(rng_state)
                with call.autocast.context():
                    _sublayer_backward(sublayer, out0, out1, grad0, grad1, call)
            out0, out1 = out1, out0
            grad0, grad1 = grad1, grad0
        return grad0.add_(grad1).sub_(grad), None


def _add_update(sublayer, x, target, call: _StackCall) -> None:
    """``target += f(x)`` without grad; the FFN runs ``chunks.tokens`` tokens at a time, as in backward."""
    if not (isinstance(sublayer, LeanFFN) and call.chunks.tokens):
        target.add_(sublayer(x, call.rotary, call.key_padding_mask))
        return
    spec = sublayer.spec(x)
    mask = _output_mask(spec, x)
    chunk_spec = dataclasses.replace(spec, dropout_seed=None)
    x, target = x.view(1, -1, x.shape[-1]), target.view(1, -1, target.shape[-1])
    for rows in _token_ranges(x.shape[1], call.chunks.tokens):
        update = sublayer.run(x[:, rows], chunk_spec)
        target[:, rows].add_(update if mask is None else update.mul_(mask.view_as(x)[:, rows]))


def _output_mask(spec, x) -> Optional[torch.Tensor]:
    """The sub-layer's hidden-dropout mask for the whole output (forward draws one of the output's shape)."""
    if spec.dropout_seed is None:
        return None
    return keep_mask(x.shape, spec.dropout_p, spec.dropout_seed, x.device, spec.compute.dtype).to(x.dtype)


def _sublayer_backward(sublayer, x, out, grad_x, grad_out, call: _StackCall) -> None:
    """In place: ``out -= f(x)`` and ``grad_x += J_f(x)^T grad_out``; parameter gradients go to ``.grad``."""
    if isinstance(sublayer, LeanFFN):
        spec = sublayer.spec(x)
        _generic_backward(
            lambda chunk, chunk_spec: sublayer.run(chunk, chunk_spec),
            spec,
            x,
            out,
            grad_x,
            grad_out,
            call.chunks.tokens,
        )
        return
    if not isinstance(sublayer, LeanSelfAttention):
        raise TypeError(f"reversible chunked backward supports LeanFFN and LeanSelfAttention, got {type(sublayer)}")
    spec = sublayer.spec(x)
    if call.chunks.heads and spec.attn_dropout_seed is None and is_dense(spec.qkv) and is_dense(spec.out):
        _attention_backward_by_heads(sublayer, spec, x, out, grad_x, grad_out, call)
        return
    # queries see every earlier key: the token axis cannot be split, so the whole sub-layer at once
    _generic_backward(
        lambda chunk, chunk_spec: sublayer.run(chunk, chunk_spec, call.rotary, call.key_padding_mask),
        spec,
        x,
        out,
        grad_x,
        grad_out,
        0,
    )


def _token_ranges(tokens: int, chunk: int) -> List[slice]:
    chunk = chunk or tokens
    return [slice(start, min(start + chunk, tokens)) for start in range(0, tokens, chunk)]


def _generic_backward(run, spec, x, out, grad_x, grad_out, chunk_tokens: int) -> None:
    """Recompute f on token chunks with autograd; the hidden-dropout mask is drawn once for the whole output."""
    mask = _output_mask(spec, x)
    chunk_spec = dataclasses.replace(spec, dropout_seed=None)
    if chunk_tokens:  # [batch, seq, hidden] -> [1, tokens, hidden] views: sub-layers only see their last dim
        x, out, grad_x, grad_out = (t.view(1, -1, t.shape[-1]) for t in (x, out, grad_x, grad_out))
        mask = None if mask is None else mask.view(1, -1, mask.shape[-1])
    for rows in _token_ranges(x.shape[1], chunk_tokens):
        with torch.enable_grad():
            leaf = x[:, rows].detach().requires_grad_()
            update = run(leaf, chunk_spec)
        upstream = grad_out[:, rows] if mask is None else grad_out[:, rows] * mask[:, rows]
        torch.autograd.backward(update, upstream)
        with torch.no_grad():
            update = update.detach()
            out[:, rows].sub_(update if mask is None else update.mul_(mask[:, rows]))
            grad_x[:, rows].add_(leaf.grad)
        del leaf, update, upstream


def _add_grad(param: torch.Tensor, grad: torch.Tensor, index=None) -> None:
    """Accumulate into ``param.grad`` (rows or columns of it when ``index`` is given), as autograd would."""
    if not param.requires_grad:
        return
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    grad = grad.to(param.dtype)
    if index is None:
        param.grad.add_(grad)
    elif isinstance(index, torch.Tensor):  # rows (advanced indexing would copy)
        param.grad.index_add_(0, index, grad)
    else:
        param.grad[index].add_(grad)


def _attention_backward_by_heads(sublayer: LeanSelfAttention, spec, x, out, grad_x, grad_out, call) -> None:
    compute = spec.compute
    dtype = compute.dtype
    heads, hidden = spec.num_heads, x.shape[-1]
    head_dim = hidden // heads
    cos, sin = call.rotary if call.rotary is not None else (None, None)
    sandwich = sublayer.sandwich_norm
    sandwich_w, sandwich_b = (None, None) if sandwich is None else (sandwich.weight, sandwich.bias)
    qkv_weight, qkv_bias = spec.qkv.weight, spec.qkv.bias
    out_weight, out_bias = spec.out.weight, spec.out.bias
    norm_w, norm_b = sublayer.norm.weight, sublayer.norm.bias
    with no_autocast(compute.device_type), torch.no_grad():
        normed, mean, rstd = layer_norm_with_stats(x, norm_w, norm_b, spec.eps)
        normed = normed.to(dtype)
        normed_2d = normed.reshape(-1, hidden)
        groups = _head_groups(heads, call.chunks.heads, hidden, head_dim, x.device)

        def group_forward(group):
            rows, _ = group
            weight = qkv_weight.index_select(0, rows).to(dtype)
            bias = None if qkv_bias is None else qkv_bias.index_select(0, rows).to(dtype)
            qkv = F.linear(normed, weight, bias)
            split = _split_heads(qkv, rows.numel() // (3 * head_dim))
            if cos is not None:
                rotate_(split[:, :, 0], cos, sin)
                rotate_(split[:, :, 1], cos, sin)
            q, k, v = _heads_first(split)
            attn, lse = attention_forward(q, k, v, spec.causal, call.key_padding_mask, 0.0, None)
            return weight, qkv, (q, k, v), attn, lse

        def project_out(attn, columns):
            return torch.matmul(attn.transpose(1, 2).flatten(2), out_weight[:, columns].to(dtype).t())

        def total_y(contributions):
            return contributions if out_bias is None else contributions.add_(out_bias.to(dtype))

        # the tail (sandwich norm, dropout) needs y before its backward: with a sandwich norm, one more pass
        pre_sandwich = None
        if sandwich is not None:
            pre_sandwich = torch.zeros(x.shape, dtype=dtype, device=x.device)
            for group in groups:
                _, _, _, attn, _ = group_forward(group)
                pre_sandwich.add_(project_out(attn, group[1]))
                del attn
            pre_sandwich = total_y(pre_sandwich)
        grad_y, grad_sw, grad_sb = tail_backward(
            grad_out, pre_sandwich, sandwich_w, sandwich_b, spec.eps, spec.dropout_p, spec.dropout_seed, dtype
        )
        grad_y_2d = grad_y.reshape(-1, hidden)
        # without a tail (no sandwich norm, no dropout) f(x) = y: each group's share comes off ``out`` directly
        direct = sandwich is None and spec.dropout_seed is None
        y = torch.zeros(x.shape, dtype=dtype, device=x.device) if sandwich is None and not direct else None
        grad_normed = torch.zeros_like(normed)
        for group in groups:
            rows, columns = group
            weight, qkv, (q, k, v), attn, lse = group_forward(group)
            attn_flat = attn.transpose(1, 2).flatten(2)
            if direct:
                out.sub_(project_out(attn, columns))
            elif y is not None:
                y.add_(project_out(attn, columns))
            out_w = out_weight[:, columns].to(dtype)
            grad_attn = torch.matmul(grad_y, out_w)
            _add_grad(
                out_weight,
                torch.matmul(grad_y_2d.t(), attn_flat.reshape(-1, attn_flat.shape[-1])),
                (slice(None), columns),
            )
            n = rows.numel() // (3 * head_dim)
            grads = attention_backward(
                _unflatten_heads(grad_attn, n), q, k, v, attn, lse, spec.causal, call.key_padding_mask, 0.0, None
            )
            del grad_attn, attn, attn_flat
            grad_qkv = torch.empty_like(qkv)
            grad_heads = _split_heads(grad_qkv, n)
            for index, grad in enumerate(grads):  # back to [batch, seq, heads, dim], un-rotating q and k
                if cos is not None and index < 2:
                    rotate_inverse_into(grad.transpose(1, 2), cos, sin, out=grad_heads[:, :, index])
                else:
                    grad_heads[:, :, index].copy_(grad.transpose(1, 2))
            del grads, q, k, v, qkv
            grad_qkv_2d = grad_qkv.reshape(-1, grad_qkv.shape[-1])
            _add_grad(qkv_weight, torch.matmul(grad_qkv_2d.t(), normed_2d), rows)
            if qkv_bias is not None:
                _add_grad(qkv_bias, grad_qkv_2d.sum(0), rows)
            grad_normed.add_(torch.matmul(grad_qkv, weight))
            del grad_qkv, grad_qkv_2d, weight
        if out_bias is not None:
            _add_grad(out_bias, grad_y_2d.sum(0))
        del grad_y, grad_y_2d
        if direct:
            if out_bias is not None:
                out.sub_(out_bias.to(dtype))
        else:
            if y is not None:
                pre_sandwich = total_y(y)
            update, _ = tail_forward(
                pre_sandwich, x, sandwich_w, sandwich_b, spec.eps, spec.dropout_p, spec.dropout_seed, residual=False
            )
            out.sub_(update)
            del update, pre_sandwich
        grad_input, grad_nw, grad_nb = norm_input_backward(
            grad_normed, x, mean, rstd, norm_w, norm_b, grad_out, residual=False
        )
        grad_x.add_(grad_input)
        for param, grad in ((norm_w, grad_nw), (norm_b, grad_nb), (sandwich_w, grad_sw), (sandwich_b, grad_sb)):
            if param is not None and grad is not None:
                _add_grad(param, grad)


def _head_groups(heads: int, chunk: int, hidden: int, head_dim: int, device):
    """(rows of the qkv weight, columns of the out weight) per group of ``chunk`` consecutive heads."""
    groups = []
    for first in range(0, heads, chunk):
        last = min(first + chunk, heads)
        span = torch.arange(first * head_dim, last * head_dim, device=device)
        rows = torch.cat([span + part * hidden for part in range(3)])
        groups.append((rows, slice(first * head_dim, last * head_dim)))
    return groups
