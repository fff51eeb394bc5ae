"""Validation loss and perplexity of a state of the swarm's model (causal LM, token-weighted mean)."""

from __future__ import annotations

import logging
import math
import time
from typing import Sequence

import torch

from aux_monitor.state import EvalResult

logger = logging.getLogger(__name__)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, blocks: Sequence[dict], *, epoch: int, batch_size: int, max_batches: int
) -> EvalResult:
    """Mean next-token loss over (at most ``max_batches`` batches of) the validation blocks."""
    if not blocks:
        raise ValueError("the validation set is empty; check --dataset and --validation_split")
    was_training = model.training
    model.eval()
    total_loss, total_tokens = 0.0, 0
    try:
        for start in range(0, min(len(blocks), batch_size * max_batches), batch_size):
            input_ids = torch.stack([b["input_ids"] for b in blocks[start : start + batch_size]])
            loss = model(input_ids=input_ids, labels=input_ids).loss
            tokens = input_ids.shape[0] * (input_ids.shape[1] - 1)  # the LM loss predicts every token but the first
            total_loss += loss.item() * tokens
            total_tokens += tokens
    finally:
        model.train(was_training)
    mean = total_loss / total_tokens
    perplexity = math.exp(mean) if mean < 700 else math.inf
    logger.info("Validation at epoch %d: loss %.4f, perplexity %.2f (%d tokens)", epoch, mean, perplexity, total_tokens)
    return EvalResult(epoch=epoch, loss=mean, perplexity=perplexity, time=time.time())
