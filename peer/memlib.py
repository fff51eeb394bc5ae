"""Deterministic memory accounting for one training step, on any device.

Two counters, both independent of the allocator, so they give the same number on every run:

* :class:`SavedTensorCounter` -- bytes of tensors autograd saves for backward, through
  ``torch.autograd.graph.saved_tensors_hooks``; each storage is counted once and model state
  (parameters, buffers) is excluded.
* :class:`LiveTensorPeak` -- peak of live tensor bytes, through a ``TorchDispatchMode`` that sees
  every op output: a storage is added on first sight and removed when it is freed. Storages that
  existed before the step (parameters, gradients, buffers, inputs) are excluded by the caller.

On CUDA, :func:`cuda_peak_bytes` adds the caching allocator's own view.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

StorageKey = tuple[str, int]


def storage_key(tensor: torch.Tensor) -> StorageKey | None:
    """(device, data pointer) of the tensor's storage; None for empty or data-less tensors."""
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0 or storage.data_ptr() == 0:
        return None
    return str(storage.device), storage.data_ptr()


def storage_keys(tensors: Iterable[torch.Tensor]) -> set[StorageKey]:
    keys = (storage_key(t) for t in tensors if t is not None)
    return {key for key in keys if key is not None}


def model_state_keys(model: torch.nn.Module) -> set[StorageKey]:
    """Storages of the model's parameters and buffers (tied weights share one storage)."""
    return storage_keys([*model.parameters(), *model.buffers()])


class SavedTensorCounter(contextlib.AbstractContextManager):
    """Sum of distinct storages saved for backward inside the context, model state excluded.

    The pack hook returns the tensor itself, so lifetimes are unchanged. Storages saved by several
    ops (a layer-norm output kept by the norm and the next matmul, or views of one buffer) are
    counted once. Anything a custom autograd Function stashes on ``ctx`` outside
    ``save_for_backward`` is invisible here (the live-tensor peak still sees it).
    """

    def __init__(self, exclude: set[StorageKey]):
        self.exclude = exclude
        self.saved: dict[StorageKey, int] = {}
        # "shape dtype" of the first tensor seen on each saved storage, for breakdowns
        self.described: dict[StorageKey, str] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    @property
    def total_bytes(self) -> int:
        return sum(self.saved.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key is not None and key not in self.exclude and key not in self.saved:
            self.saved[key] = tensor.untyped_storage().nbytes()
            self.described[key] = f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
        return tensor

    def breakdown(self) -> list[tuple[str, int, int]]:
        """(shape and dtype, number of storages, total bytes), largest total first."""
        groups: dict[str, list[int]] = {}
        for key, nbytes in self.saved.items():
            groups.setdefault(self.described[key], []).append(nbytes)
        return sorted(((name, len(sizes), sum(sizes)) for name, sizes in groups.items()), key=lambda g: -g[2])

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


class LiveTensorPeak(TorchDispatchMode):
    """Running and peak bytes of live tensor storages created by ops inside the mode.

    A storage is counted from the op that first returns it until it is freed (a
    ``weakref.finalize`` on the storage object, which torch keeps alive as long as the storage
    itself). In-place ops and views return storages already seen, so they add nothing. Storages in
    ``exclude`` (parameters, pre-allocated gradients, inputs) are never counted.

    Every allocation and free is logged, so a peak can be recomputed afterwards without some
    storages: :meth:`mark_gradient` flags the incoming gradient of a parameter (the temporary that
    backward adds into the pre-allocated ``.grad``), and :attr:`activation_peak_bytes` leaves those
    out, while :attr:`peak_bytes` keeps everything.
    """

    def __init__(self, exclude: set[StorageKey]):
        super().__init__()
        self.exclude = exclude
        self.current_bytes = 0
        self.peak_bytes = 0
        self._live: dict[StorageKey, tuple[int, int]] = {}  # key -> (allocation id, bytes)
        self._events: list[tuple[int, int]] = []  # (allocation id, +bytes on alloc / -bytes on free)
        self._gradient_ids: set[int] = set()
        # finalizers run from whichever thread drops the last reference (autograd workers on GPU)
        self._lock = threading.RLock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._track(item)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        key = storage_key(tensor)
        if key is None or key in self.exclude:
            return
        storage = tensor.untyped_storage()
        with self._lock:
            if key in self._live:
                return
            nbytes = storage.nbytes()
            alloc_id = len(self._events)
            self._live[key] = (alloc_id, nbytes)
            self._events.append((alloc_id, nbytes))
            self.current_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: StorageKey) -> None:
        with self._lock:
            if key in self._live:
                alloc_id, nbytes = self._live.pop(key)
                self._events.append((alloc_id, -nbytes))
                self.current_bytes -= nbytes

    def mark_gradient(self, tensor: torch.Tensor) -> None:
        """Flag ``tensor``'s storage as gradient bytes (left out of :attr:`activation_peak_bytes`)."""
        key = storage_key(tensor)
        with self._lock:
            if key in self._live:
                self._gradient_ids.add(self._live[key][0])

    @property
    def activation_peak_bytes(self) -> int:
        """Peak of live bytes without the storages flagged by :meth:`mark_gradient`."""
        current = peak = 0
        with self._lock:
            for alloc_id, delta in self._events:
                if alloc_id not in self._gradient_ids:
                    current += delta
                    peak = max(peak, current)
        return peak


def preallocate_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """Give every trainable parameter a zero ``.grad`` so backward accumulates in place.

    Gradients then live in storages that exist before the step and are excluded from the
    activation figures, as the task defines them (parameter and gradient bytes are not activations).
    """
    grads = []
    for param in model.parameters():
        if param.requires_grad:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
    return grads


def zero_grads(model: torch.nn.Module) -> None:
    """Zero gradients in place (like ``zero_grad(set_to_none=False)``), keeping their storages."""
    for param in model.parameters():
        if param.grad is not None:
            param.grad.zero_()


def resolve_autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Autocast context for ``dtype`` on ``device``; a no-op context for full precision."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def train_step(model: torch.nn.Module, input_ids: torch.Tensor, autocast_dtype: torch.dtype | None = None) -> float:
    """Forward + causal-LM loss (labels = inputs) + backward; returns the loss value.

    The model output is dropped before backward, as a training loop does, so the logits live only
    as long as the loss computation keeps them.
    """
    with resolve_autocast(input_ids.device, autocast_dtype):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach().item()


def forward_saved_bytes(
    model: torch.nn.Module, input_ids: torch.Tensor, autocast_dtype: torch.dtype | None = None
) -> int:
    """Bytes saved for backward by forward + loss (the graph is then dropped without backward)."""
    exclude = model_state_keys(model) | storage_keys([input_ids])
    with SavedTensorCounter(exclude) as counter, resolve_autocast(input_ids.device, autocast_dtype):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    del loss
    return counter.total_bytes


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class StepMemory:
    """Memory figures of one instrumented training step."""

    # distinct storages saved for backward by forward + loss (model state excluded)
    saved_bytes: int
    # peak live tensor bytes, parameters, gradients and incoming parameter gradients excluded
    activation_peak_bytes: int
    # same peak with the incoming parameter gradients counted (they are added into .grad in place)
    live_peak_bytes: int
    # saved storages grouped by shape: (shape and dtype, count, bytes), largest first
    saved_breakdown: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)


def hook_parameter_gradients(
    loss: torch.Tensor, params: list[torch.Tensor], mark: Callable[[torch.Tensor], None]
) -> list:
    """Call ``mark`` on every gradient headed for a parameter; returns the hook handles.

    Two kinds of hook: a tensor hook on each parameter sees the (summed) gradient that is added
    into ``.grad``; a post-hook on each graph node feeding a parameter's accumulator sees each
    contribution before the sum (a tied embedding gets two, one of which waits through backward).
    """
    handles = [p.register_hook(mark) for p in params]
    feeds: dict[torch.autograd.graph.Node, list[int]] = {}
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for index, (next_node, _) in enumerate(node.next_functions):
            if next_node is not None and type(next_node).__name__ == "AccumulateGrad":
                feeds.setdefault(node, []).append(index)
            stack.append(next_node)

    def mark_inputs(indices):
        def hook(grad_inputs, grad_outputs):
            for index in indices:
                if grad_inputs[index] is not None:
                    mark(grad_inputs[index])

        return hook

    handles += [node.register_hook(mark_inputs(indices)) for node, indices in feeds.items()]
    return handles


def measured_step(
    model: torch.nn.Module, input_ids: torch.Tensor, autocast_dtype: torch.dtype | None = None
) -> StepMemory:
    """One instrumented step (forward + loss + backward) with both counters on.

    Gradients are pre-allocated first so that neither they nor the parameters count, and the
    gradients autograd computes for parameters (added into ``.grad`` in place) are flagged as
    gradient bytes.
    """
    preallocate_grads(model)
    params = [p for p in model.parameters() if p.requires_grad]
    exclude = model_state_keys(model) | storage_keys(p.grad for p in params) | storage_keys([input_ids])
    with LiveTensorPeak(exclude) as live:
        with SavedTensorCounter(exclude) as saved, resolve_autocast(input_ids.device, autocast_dtype):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        handles = hook_parameter_gradients(loss, params, live.mark_gradient)
        try:
            loss.backward()
        finally:
            for handle in handles:
                handle.remove()
        del loss
    zero_grads(model)
    return StepMemory(
        saved_bytes=saved.total_bytes,
        activation_peak_bytes=live.activation_peak_bytes,
        live_peak_bytes=live.peak_bytes,
        saved_breakdown=saved.breakdown(),
    )


def timed_steps(step: Callable[[], object], device: torch.device, *, warmup: int, steps: int) -> list[float]:
    """Wall-clock seconds of ``steps`` calls of ``step`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def cuda_peak_bytes(step: Callable[[], object], device: torch.device) -> int:
    """``torch.cuda.max_memory_allocated`` during one step, minus what was allocated before it."""
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
