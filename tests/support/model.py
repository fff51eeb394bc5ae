"""Shared helpers for the model tests (no tests in here): small float64 models, plain references,
loss/gradient comparison and a saved-tensor recorder."""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Tuple

import torch

from model import LeanTransformerConfig, use_plain_reference

VOCAB = 64


def small_config(**overrides) -> LeanTransformerConfig:
    """hidden 32, 4 heads, 2 layers: big enough for every option, small enough for float64 on 2 cores."""
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        loss_chunk_size=7,
    )
    fields.update(overrides)
    return LeanTransformerConfig(**fields)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Non-trivial weights everywhere (zero-initialised adapters and biases included)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float64).to(param.dtype)
        is_norm_weight = "norm" in name and name.endswith("weight")
        param.copy_(1.0 + 0.2 * noise if is_norm_weight else 0.3 * noise)
    return model


def with_plain_reference(model: torch.nn.Module) -> Tuple[torch.nn.Module, torch.nn.Module]:
    """(model, deep copy with the same weights and every custom path off)."""
    return model, use_plain_reference(copy.deepcopy(model))


def loss_and_grads(model: torch.nn.Module, seed: int = 0, **batch) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    torch.manual_seed(seed)  # same dropout seeds for both models
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-300)).item()


def assert_same_loss_and_grads(
    model: torch.nn.Module, reference: torch.nn.Module, tolerance: float = 1e-6, **batch
) -> None:
    loss, grads = loss_and_grads(model, **batch)
    ref_loss, ref_grads = loss_and_grads(reference, **batch)
    assert relative_error(loss, ref_loss) <= tolerance, (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    assert len(grads) == len(list(model.parameters()))  # every parameter got a gradient
    errors = {name: relative_error(grads[name], ref_grads[name]) for name in grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance, f"{worst}: relative error {errors[worst]:.3g}"


class SavedTensors:
    """Records tensors saved for backward (saved_tensors_hooks), skipping the given parameters."""

    def __init__(self, exclude: Optional[List[torch.Tensor]] = None):
        self._excluded = {p.untyped_storage().data_ptr() for p in (exclude or [])}
        self.tensors: List[torch.Tensor] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in self._excluded:
            self.tensors.append(tensor)
        return tensor

    def __enter__(self) -> "SavedTensors":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def storage_bytes(self) -> int:
        """Bytes of distinct storages (a storage saved twice counts once)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.tensors}
        return sum(storages.values())

    @property
    def shapes(self) -> List[Tuple[int, ...]]:
        return [tuple(t.shape) for t in self.tensors]


def save_tiny_checkpoint(directory, epoch: int, seed: int = 0, facts: Optional[dict] = None):
    """An aux checkpoint (written by the real CheckpointManager) of a ``tiny`` preset model, whose vocabulary is
    the shipped tokenizer's; returns its CheckpointInfo."""
    import time

    from aux_monitor.checkpoints import CheckpointManager, TrainingState
    from model import LeanGPTForCausalLM, load_config

    torch.manual_seed(seed)
    model = LeanGPTForCausalLM(load_config("tiny"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(directory, keep=5, model_class=LeanGPTForCausalLM)
    state = TrainingState(model, optimizer.state_dict(), None, epoch, 7.25, time.time(), facts=dict(facts or {}))
    return manager.save(state)
