"""Profiles of models for packing (:mod:`retiarii.optim.packing`): time per iteration, memory.

Two ways, for two places:

- :func:`profile_model` **measures** a built module: a few training iterations (forward,
  backward, optimizer step) on a real batch. Memory on a GPU is
  ``torch.cuda.max_memory_allocated`` over those iterations (less what was allocated before);
  on a CPU, where no allocator keeps a peak, it is the sum of what training holds at its
  peak: parameters, their gradients, the optimizer's state (measured after a step), and the
  activations autograd saves for backward (every tensor packed by the forward, counted once
  per storage, caught with ``torch.autograd.graph.saved_tensors_hooks``).
- :func:`estimate_profile` **estimates** from the IR, without building or running the model:
  the driver proposes hundreds of models and must place them before any has trained. Every
  node's output shape is known from the space's shape check (``node.meta["shape"]``, at the
  example input's batch, scaled to the trainer's). Memory is parameters (read from the module
  specs) times (weights, gradient, ``optimizer_slots`` states) plus every node's output kept
  for backward; time is in *units*, not seconds: one per operation (a CPU pays a fixed
  dispatch cost per call) plus one per :data:`ELEMENTS_PER_UNIT` output elements (the work).
  Units only rank and balance models; the engine scales them to seconds with the ratio
  measured on models already profiled by their workers (:mod:`retiarii.engine.runner.packer`).

Example::

    model = space.instantiate(sample)                 # shapes checked: meta["shape"] set
    units, memory = estimate_profile(model.graph, batch_size=64)
    iter_s, memory = profile_model(module, batch, trainer.training_step, optimizer)
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["ELEMENTS_PER_UNIT", "estimate_profile", "profile_model"]

# Output elements that cost about one operation's fixed overhead: ~5 microseconds of dispatch
# against ~1 ns per element of simple arithmetic on one CPU core. Only the ranking matters.
ELEMENTS_PER_UNIT = 4096


def _numel(shape: Any) -> int:
    """Elements of a recorded shape (a list of ints, or nested lists for tuple outputs)."""
    if not shape:
        return 0
    if all(isinstance(s, int) for s in shape):
        return math.prod(shape)
    return sum(_numel(s) for s in shape if isinstance(s, list))


def estimate_profile(graph, batch_size: int, example_batch: int = 1, dtype_bytes: int = 4,
                     optimizer_slots: int = 2) -> tuple[float, int]:
    """(time units, bytes) of training the model of ``graph`` (see the module docstring).

    Args:
        graph: a Graph IR whose nodes carry ``meta["shape"]`` (``space.check_shapes``).
        batch_size: examples per training batch.
        example_batch: the batch size of the space's example input the shapes come from.
        dtype_bytes: bytes per element (float32: 4).
        optimizer_slots: state tensors per parameter (Adam: 2, SGD with momentum: 1).
    """
    from ..shapes import shared_module_of  # layers by spec, shared with the shape check

    scale = batch_size / max(1, example_batch)
    trained = frozen = ops = elements = 0
    for node in graph.nodes:
        if node.kind in ("input", "output"):
            continue
        ops += 1
        elements += _numel(node.meta.get("shape")) * scale
        if node.kind == "module" and node.op.spec is not None:
            module = shared_module_of(node.op.spec)
            trained += sum(p.numel() for p in module.parameters() if p.requires_grad)
            frozen += sum(p.numel() for p in module.parameters() if not p.requires_grad)
    # a trained weight also has a gradient and the optimizer's states; a frozen one neither
    memory = dtype_bytes * (trained * (2 + optimizer_slots) + frozen + elements)
    return ops + elements / ELEMENTS_PER_UNIT, int(memory)


def _bytes(tensors, exclude: frozenset = frozenset()) -> int:
    """Bytes of the storages of ``tensors``, each counted once, except ``exclude``'s."""
    seen, total = set(exclude), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_model(module: nn.Module, batch: Any,
                  step: Callable[[nn.Module, Any], torch.Tensor],
                  optimizer: torch.optim.Optimizer, iterations: int = 3) -> tuple[float, int]:
    """(seconds per iteration, peak bytes) of training ``module`` on ``batch``, measured.

    The module, its optimizer and the batch must be on the device to profile; they are
    trained ``iterations + 1`` steps (the first warms caches and allocators up and is not
    timed): profile a copy (``copy.deepcopy((module, optimizer))``) to keep the original.

    Example::

        model, opt = copy.deepcopy((run.model, run.optimizer))
        iter_s, memory = profile_model(model, batch, lambda m, b: trainer.training_step(
            m, b, hparams), opt)

    Args:
        module: the model.
        batch: what ``step`` takes.
        step: ``(module, batch) -> scalar loss``.
        optimizer: over ``module``'s parameters.
        iterations: timed iterations (their mean is returned).
    """
    if iterations < 1:
        raise ValueError(f"iterations={iterations}: give at least 1")
    params = list(module.parameters())
    device = params[0].device if params else torch.device("cpu")
    cuda = device.type == "cuda"
    if cuda:
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    saved: list[torch.Tensor] = []
    times = []
    for i in range(iterations + 1):
        _sync(device)
        start = time.perf_counter()
        if i == 0 and not cuda:
            def keep(t):  # noqa: ANN001 (autograd's hook)
                saved.append(t)
                return t

            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                loss = step(module, batch)
            # the weights autograd saves are counted with the parameters
            activations = _bytes(saved, frozenset(
                (p.untyped_storage().data_ptr(), p.device) for p in params))
            saved.clear()
        else:
            loss = step(module, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    iter_s = sum(times[1:]) / iterations
    if cuda:
        return iter_s, int(torch.cuda.max_memory_allocated(device) - base)
    state = [t for s in optimizer.state.values() for t in s.values()]
    grads = [p.grad for p in params if p.grad is not None]
    return iter_s, _bytes(params) + _bytes(grads) + _bytes(state) + activations
