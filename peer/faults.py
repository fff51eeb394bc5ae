"""Fault injection for tests, driven by environment variables (no CLI flag: users never need it).

- ``LEANHIVE_FAULT_NAN_GRAD_STEPS=3,4``: after backward at these local steps, one gradient becomes NaN.
- ``LEANHIVE_FAULT_NAN_PARAM_EPOCHS=2``: the first time the peer reaches these global epochs, one parameter
  becomes NaN.
"""
from __future__ import annotations

import logging
import os
from typing import FrozenSet

import torch

logger = logging.getLogger(__name__)

NAN_GRAD_STEPS_ENV = "LEANHIVE_FAULT_NAN_GRAD_STEPS"
NAN_PARAM_EPOCHS_ENV = "LEANHIVE_FAULT_NAN_PARAM_EPOCHS"


def _numbers(env_name: str) -> FrozenSet[int]:
    text = os.environ.get(env_name, "")
    return frozenset(int(part) for part in text.replace(",", " ").split())


def _first_tensor(model: torch.nn.Module, attribute: str):
    for param in model.parameters():
        tensor = param if attribute == "data" else param.grad
        if tensor is not None:
            return tensor
    return None


@torch.no_grad()
def maybe_corrupt_gradients(model: torch.nn.Module, local_step: int) -> None:
    if local_step in _numbers(NAN_GRAD_STEPS_ENV):
        grad = _first_tensor(model, "grad")
        if grad is not None:
            logger.warning("FAULT INJECTION: NaN gradient at local step %d", local_step)
            grad.view(-1)[0] = float("nan")


_corrupted_epochs = set()  # a recovered peer reaches the same epoch again: inject only once


@torch.no_grad()
def maybe_corrupt_parameters(model: torch.nn.Module, global_epoch: int) -> None:
    if global_epoch in _numbers(NAN_PARAM_EPOCHS_ENV) and global_epoch not in _corrupted_epochs:
        _corrupted_epochs.add(global_epoch)
        logger.warning("FAULT INJECTION: NaN parameter at global epoch %d", global_epoch)
        _first_tensor(model, "data").view(-1)[0] = float("nan")
