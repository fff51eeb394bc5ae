"""Token-level cross-entropy over a (tied) output embedding, computed in chunks of tokens.

``ChunkedLMLossFunction`` never materialises (tokens x vocab) logits for the whole batch: forward
keeps only the per-chunk loss sum, backward recomputes each chunk's logits, turns them into the
softmax gradient in place and folds it into the hidden and weight gradients before the next chunk.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from model.ops.sublayer import no_autocast

IGNORE_INDEX = -100


def _logits_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # softmax in at least fp32


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype


def lm_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
            chunk_size: int) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T + bias`` over labels != -100.

    hidden: [tokens, dim], weight: [vocab, dim], labels: [tokens]. chunk_size=0 computes full logits
    with plain autograd (the reference). The mean is over at least one token (0 when all are ignored).
    """
    if chunk_size == 0:
        return _lm_loss_plain(hidden, weight, bias, labels)
    return ChunkedLMLossFunction.apply(hidden, weight, bias, labels, chunk_size, _compute_dtype(hidden, weight))


def _lm_loss_plain(hidden, weight, bias, labels):
    dtype = _compute_dtype(hidden, weight)
    logits = F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    total = F.cross_entropy(logits.to(_logits_dtype(logits.dtype)), labels, ignore_index=IGNORE_INDEX,
                            reduction="sum")
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


def _chunk_logits(hidden_chunk, weight, bias, dtype):
    logits = F.linear(hidden_chunk.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    return logits.to(_logits_dtype(dtype))


class ChunkedLMLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size: int, dtype: torch.dtype):
        valid = labels != IGNORE_INDEX
        count = valid.sum().clamp(min=1)
        total = torch.zeros((), dtype=_logits_dtype(dtype), device=hidden.device)
        with no_autocast(hidden.device.type):
            for start in range(0, hidden.shape[0], chunk_size):
                end = start + chunk_size
                logits = _chunk_logits(hidden[start:end], weight, bias, dtype)
                chunk_labels = labels[start:end].clamp(min=0)
                token_loss = torch.logsumexp(logits, dim=-1) - logits.gather(1, chunk_labels[:, None])[:, 0]
                total += token_loss.masked_fill_(~valid[start:end], 0.0).sum()
                del logits
        ctx.chunk_size, ctx.dtype, ctx.bias = chunk_size, dtype, bias
        ctx.weight = weight  # a parameter: kept by reference, not an activation
        ctx.save_for_backward(hidden, labels)
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, labels = ctx.saved_tensors
        weight, bias, dtype = ctx.weight, ctx.bias, ctx.dtype
        valid = labels != IGNORE_INDEX
        scale = grad_loss.to(_logits_dtype(dtype)) / valid.sum().clamp(min=1)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=_logits_dtype(dtype)) if ctx.needs_input_grad[1] else None
        grad_bias = (torch.zeros_like(bias, dtype=_logits_dtype(dtype))
                     if bias is not None and ctx.needs_input_grad[2] else None)
        with no_autocast(hidden.device.type):
            for start in range(0, hidden.shape[0], ctx.chunk_size):
                end = start + ctx.chunk_size
                hidden_chunk = hidden[start:end].to(dtype)
                logits = _chunk_logits(hidden_chunk, weight, bias, dtype)
                grad_logits = logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True)).exp_()  # softmax in place
                del logits
                rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
                grad_logits[rows, labels[start:end].clamp(min=0)] -= 1.0
                grad_logits.mul_((valid[start:end, None] * scale).to(grad_logits.dtype))
                if grad_bias is not None:
                    grad_bias += grad_logits.sum(0)
                grad_logits = grad_logits.to(dtype)
                if grad_hidden is not None:
                    grad_hidden[start:end] = grad_logits @ weight.to(dtype)
                if grad_weight is not None:
                    grad_weight.addmm_(grad_logits.t().to(grad_weight.dtype), hidden_chunk.to(grad_weight.dtype))
                del grad_logits
        return (grad_hidden,
                None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype),
                None, None, None)
