"""Scaled dot-product attention cores that never keep (seq x seq) probabilities for backward.

All cores take q, k, v as [batch, heads, seq, head_dim] (any strides) and share one mask semantics:
``causal`` hides future keys, ``key_padding_mask`` ([batch, seq] bool, True = real token) hides padded
keys, and a query row with no visible key outputs zeros (only padded queries can hit that case).

* ``flash`` (CPU, no probability dropout): PyTorch's fused CPU flash kernel and its backward op;
  saves nothing but out and logsumexp.
* ``chunked`` (any device, supports dropout): processes query chunks, recomputes probabilities in
  backward from the saved logsumexp, and regenerates each chunk's dropout mask from a seed.
* ``attention_reference``: plain autograd over materialised probabilities (the reference).
* ``attention_over_cache`` (inference): the newest queries over cached keys plus their own, causal.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from model.ops.dropout import keep_mask

# elements of one [batch, heads, chunk, keys] score block in the chunked core (~16 MiB in fp32)
_CHUNK_ELEMENTS = 2**22


def query_chunks(batch: int, heads: int, q_len: int, k_len: int) -> List[Tuple[int, int]]:
    """Query ranges processed together; also defines which seed each dropout-mask block uses."""
    size = max(1, min(q_len, _CHUNK_ELEMENTS // max(1, batch * heads * k_len)))
    return [(start, min(start + size, q_len)) for start in range(0, q_len, size)]


def additive_padding_mask(key_padding_mask: Optional[torch.Tensor], dtype) -> Optional[torch.Tensor]:
    """[batch, 1, 1, keys] with 0 for real keys and -inf for padding (built on the fly, never saved)."""
    if key_padding_mask is None:
        return None
    mask = torch.zeros(key_padding_mask.shape, dtype=dtype, device=key_padding_mask.device)
    return mask.masked_fill_(~key_padding_mask, float("-inf"))[:, None, None, :]


def use_flash(q: torch.Tensor, dropout_seed: Optional[int]) -> bool:
    return q.device.type == "cpu" and dropout_seed is None


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # scores, softmax and accumulators in >= fp32


def _masked_scores(q_chunk, k, start: int, causal: bool, padding: Optional[torch.Tensor], scale: float):
    scores = torch.matmul(q_chunk, k.transpose(-1, -2)).to(_softmax_dtype(q_chunk.dtype)).mul_(scale)
    if causal:
        rows = torch.arange(start, start + q_chunk.shape[-2], device=q_chunk.device)
        future = torch.arange(k.shape[-2], device=q_chunk.device)[None, :] > rows[:, None]
        scores.masked_fill_(future, float("-inf"))
    if padding is not None:
        scores.add_(padding)
    return scores


def _chunk_keep_mask(shape, dropout_p: float, seed: int, chunk_index: int, device, dtype) -> torch.Tensor:
    return keep_mask(shape, dropout_p, seed + chunk_index, device, dtype)


def attention_forward(
    q,
    k,
    v,
    causal: bool,
    key_padding_mask: Optional[torch.Tensor],
    dropout_p: float,
    dropout_seed: Optional[int],
    scale: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp); out is [batch, heads, seq, head_dim] laid out in memory as [batch, seq, heads, dim]."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if use_flash(q, dropout_seed):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=additive_padding_mask(key_padding_mask, q.dtype), scale=scale
        )
    padding = additive_padding_mask(key_padding_mask, _softmax_dtype(q.dtype))
    b, h, s, d = q.shape
    out = torch.empty(b, s, h, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty(b, h, s, dtype=_softmax_dtype(q.dtype), device=q.device)
    for index, (start, end) in enumerate(query_chunks(b, h, s, k.shape[-2])):
        scores = _masked_scores(q[:, :, start:end], k, start, causal, padding, scale)
        chunk_lse = torch.logsumexp(scores, dim=-1)
        chunk_lse.masked_fill_(torch.isinf(chunk_lse), 0.0)  # rows with no visible key -> zero output
        probs = scores.sub_(chunk_lse[..., None]).exp_()
        if dropout_seed is not None:
            probs.mul_(_chunk_keep_mask(probs.shape, dropout_p, dropout_seed, index, q.device, q.dtype))
        out[:, :, start:end] = torch.matmul(probs.to(v.dtype), v)
        lse[:, :, start:end] = chunk_lse
    return out, lse


def attention_backward(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    causal: bool,
    key_padding_mask: Optional[torch.Tensor],
    dropout_p: float,
    dropout_seed: Optional[int],
    scale: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_q, grad_k, grad_v) with probabilities recomputed chunk by chunk."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if use_flash(q, dropout_seed):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out,
            q,
            k,
            v,
            out,
            lse,
            0.0,
            causal,
            attn_mask=additive_padding_mask(key_padding_mask, q.dtype),
            scale=scale,
        )
    accumulate = _softmax_dtype(q.dtype)
    padding = additive_padding_mask(key_padding_mask, accumulate)
    b, h, s, d = q.shape
    grad_q = torch.empty(b, s, h, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    grad_k = torch.zeros_like(k, dtype=accumulate)
    grad_v = torch.zeros_like(v, dtype=accumulate)
    # rowsum(dP * P) equals rowsum(dO * O) with or without dropout on P
    delta = (grad_out.to(accumulate) * out.to(accumulate)).sum(-1, keepdim=True)
    for index, (start, end) in enumerate(query_chunks(b, h, s, k.shape[-2])):
        q_chunk, grad_out_chunk = q[:, :, start:end], grad_out[:, :, start:end]
        scores = _masked_scores(q_chunk, k, start, causal, padding, scale)
        probs = scores.sub_(lse[:, :, start:end, None]).exp_()
        grad_probs = torch.matmul(grad_out_chunk, v.transpose(-1, -2)).to(accumulate)
        if dropout_seed is not None:
            mask = _chunk_keep_mask(probs.shape, dropout_p, dropout_seed, index, q.device, q.dtype)
            dropped = probs * mask
            grad_probs.mul_(mask)
            del mask
        else:
            dropped = probs
        grad_v.add_(torch.matmul(dropped.transpose(-1, -2).to(v.dtype), grad_out_chunk))
        del dropped
        grad_scores = grad_probs.sub_(delta[:, :, start:end]).mul_(probs).mul_(scale).to(q.dtype)
        del probs
        grad_q[:, :, start:end] = torch.matmul(grad_scores, k)
        grad_k.add_(torch.matmul(grad_scores.transpose(-1, -2), q_chunk))
    return grad_q, grad_k.to(k.dtype), grad_v.to(v.dtype)


def attention_reference(
    q,
    k,
    v,
    causal: bool,
    key_padding_mask: Optional[torch.Tensor],
    dropout_p: float,
    dropout_seed: Optional[int],
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Plain autograd attention over full probabilities, with the same masks and dropout masks."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    b, h, s, d = q.shape
    visible = torch.ones(s, k.shape[-2], dtype=torch.bool, device=q.device)
    if causal:
        visible = visible.tril()
    visible = visible.expand(b, 1, s, k.shape[-2])
    if key_padding_mask is not None:
        visible = visible & key_padding_mask[:, None, None, :]
    empty_rows = ~visible.any(-1, keepdim=True)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(empty_rows, 0.0)
    probs = scores.softmax(-1).masked_fill(empty_rows, 0.0)
    if dropout_seed is not None:
        masks = [
            _chunk_keep_mask((b, h, end - start, k.shape[-2]), dropout_p, dropout_seed, index, q.device, q.dtype)
            for index, (start, end) in enumerate(query_chunks(b, h, s, k.shape[-2]))
        ]
        probs = probs * torch.cat(masks, dim=2)
    return torch.matmul(probs, v)


def attention_over_cache(q, k, v, key_padding_mask: Optional[torch.Tensor], scale: Optional[float] = None):
    """Inference with a KV cache: q holds the last q.shape[-2] positions, k and v every position so far.

    Query i (absolute position past + i) sees keys 0..past + i; key_padding_mask covers all keys. Chunked
    like the training core, so a long prompt never materialises (seq x seq) scores at once.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    past = k.shape[-2] - q.shape[-2]
    padding = additive_padding_mask(key_padding_mask, _softmax_dtype(q.dtype))
    b, h, s, d = q.shape
    out = torch.empty(b, h, s, d, dtype=q.dtype, device=q.device)
    for start, end in query_chunks(b, h, s, k.shape[-2]):
        scores = _masked_scores(q[:, :, start:end], k, past + start, True, padding, scale)
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        lse.masked_fill_(torch.isinf(lse), 0.0)  # rows with no visible key -> zero output, as in training
        out[:, :, start:end] = torch.matmul(scores.sub_(lse).exp_().to(v.dtype), v)
    return out
