"""Costs the engine measures on each architecture, kept as metrics under fixed names.

``params`` (parameters), ``flops`` (one forward pass at batch 1, torch's
:class:`~torch.utils.flop_counter.FlopCounterMode`), ``peak_mem_mb`` (parameters, buffers and
the peak of live activations of one forward pass at batch 1, in MiB), ``latency_ms`` (one
forward pass at batch 1), ``latency_batch_ms`` (at the trainer's batch size) and
``predicted_latency_ms`` (the sum of its operators' latencies in the store's per-operator
table, engine/op_latency.py: each distinct operator timed once, not the model). A latency is
the median of ``runs`` timed passes after ``warmup`` untimed ones, with its spread (the
interquartile range) kept beside it; on a CPU with one torch thread (measurements of a
multi-threaded pass depend on what else runs), on a GPU with CUDA events. Users add their own
costs: ``Experiment(costs={"my_cost": fn})``, ``fn`` a function of the built module.

Costs are measured by the driver when a model is proposed, only those the objectives and
constraints read, and once per architecture: they are cached in the store (``costs``, by
structural hash and device), so a structure seen again (another seed, other
hyper-parameters, a resumed run) is not measured again.

Example::

    meter = CostMeter(store, example_input=torch.zeros(1, 1, 8, 8), batch_size=64,
                      names=["params", "latency_ms"])
    meter.measure(model, model.structural_hash())   # {"params": 1234.0, "latency_ms": 0.21}
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ...threads import one_thread
from ..jobs.measure_lock import machine_lock
from .op_latency import CostConfig, OpLatencyTable, time_call
from ..storage.pareto import FrontTable

__all__ = ["COSTS", "CostConfig", "CostMeter", "needed_costs"]

COSTS = ("params", "flops", "peak_mem_mb", "latency_ms", "latency_batch_ms",
         "predicted_latency_ms")


def needed_costs(needed: Iterable[str], user: dict | None = None) -> list[str]:
    """The costs among the metrics ``needed`` (fixed names and the user's own)."""
    names = set(COSTS) | set(user or {})
    return [m for m in needed if m in names]


class _PeakMemory(TorchDispatchMode):
    """Tracks the bytes of live tensors produced by the ops it sees (each storage once, freed
    when the last Python tensor on it goes), and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, int] = {}  # storage pointer -> live tensors on it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._refs:
            self._refs[key] = 0
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        weakref.finalize(t, self._release, key, storage.nbytes())

    def _release(self, key: int, nbytes: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= nbytes


class CostMeter:
    """Measures (and caches in the store) the costs of built models.

    Args:
        store: the run's :class:`~.store.Store` (its ``costs`` table is the cache).
        example_input: the space's example input; its first example is batch 1.
        batch_size: the batch of ``latency_batch_ms`` (the trainer's).
        names: the costs to measure (fixed names of :data:`COSTS` and the ``user`` names).
        user: name -> a function of the built module (in eval mode) returning a number.
        device: ``"cpu"`` or a CUDA device (``"cuda:0"``).
        config: the timing settings.
    """

    def __init__(self, store, example_input: Any, batch_size: int, names: Iterable[str],
                 user: dict[str, Callable[[torch.nn.Module], float]] | None = None,
                 device: str = "cpu", config: CostConfig = CostConfig()):
        self.store, self.batch_size, self.device = store, int(batch_size), torch.device(device)
        self.names, self.user, self.config = list(names), dict(user or {}), config
        example = example_input[0] if isinstance(example_input, (tuple, list)) else example_input
        if not isinstance(example, torch.Tensor):
            raise ValueError("measuring costs needs the space's example_input (a tensor): "
                             "give ModelSpace(..., example_input=...)")
        self.one = example[:1].to(self.device)  # (1, ...)
        shape = (self.batch_size, *example.shape[1:])
        self.batch = example[:1].expand(shape).contiguous().to(self.device)  # (B, ...)

    @property
    def device_name(self) -> str:
        """Where the costs were measured (the cache's key): the device, and for a CPU its one
        thread; a GPU by its name."""
        if self.device.type == "cuda":
            return f"cuda:{torch.cuda.get_device_name(self.device)}"
        return "cpu:1-thread"

    def _key(self, name: str) -> str:
        # latency_batch_ms depends on the batch: cached per batch size
        return f"{name}@{self.batch_size}" if name == "latency_batch_ms" else name

    def measure(self, model, structure: str) -> dict[str, float]:
        """The costs of ``model`` (a :class:`~retiarii.space.Model`), from the cache when this
        structure was measured here before; ``{name: value}``."""
        table = FrontTable(self.store)
        cached = table.costs(structure, self.device_name)
        missing = [n for n in self.names if self._key(n) not in cached]
        if missing:
            fresh = self.measure_module(model.to_module(), missing)
            table.add_costs(structure, self.device_name,
                            {self._key(n): v for n, v in fresh.items()})
            cached.update({self._key(n): v for n, v in fresh.items()})
        return {n: cached[self._key(n)][0] for n in self.names}

    def measure_module(self, module: torch.nn.Module,
                       names: Iterable[str]) -> dict[str, tuple[float, float | None]]:
        """``{name: (value, spread)}`` of ``names`` for a built module (spread: None where
        the value is exact)."""
        module, names = module.to(self.device).eval(), list(names)
        out: dict[str, tuple[float, float | None]] = {}
        # a latency timed while this machine's workers train measures their load: they pause
        timed = any(n in ("latency_ms", "latency_batch_ms", "predicted_latency_ms")
                    for n in names)
        pause = machine_lock().measuring() if timed else contextlib.nullcontext()
        with one_thread(), torch.inference_mode(), pause:
            for name in names:
                if name == "params":
                    out[name] = (float(sum(p.numel() for p in module.parameters())), None)
                elif name == "flops":
                    from torch.utils.flop_counter import FlopCounterMode

                    counter = FlopCounterMode(display=False)
                    with counter:
                        module(self.one)
                    out[name] = (float(counter.get_total_flops()), None)
                elif name == "peak_mem_mb":
                    out[name] = (self._peak_memory(module) / 2 ** 20, None)
                elif name == "latency_ms":
                    out[name] = self._latency(module, self.one)
                elif name == "latency_batch_ms":
                    out[name] = self._latency(module, self.batch)
                elif name == "predicted_latency_ms":  # the operators' table (op_latency.py)
                    table = OpLatencyTable(self.store, str(self.device), self.config)
                    out[name] = (table.predict(module, self.one), None)
                elif name in self.user:
                    out[name] = (float(self.user[name](module)), None)
                else:
                    raise ValueError(f"unknown cost {name!r}: the engine measures "
                                     f"{', '.join(COSTS)}; add your own with costs={{...}}")
        return out

    def _peak_memory(self, module: torch.nn.Module) -> float:
        held = sum(t.numel() * t.element_size()
                   for t in [*module.parameters(), *module.buffers()])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            module(self.one)
            torch.cuda.synchronize(self.device)
            return held + torch.cuda.max_memory_allocated(self.device) - before
        tracker = _PeakMemory()
        with tracker:
            result = module(self.one)
        del result
        return held + tracker.peak

    def _latency(self, module: torch.nn.Module, x: torch.Tensor) -> tuple[float, float]:
        """(median, interquartile range) in milliseconds of ``runs`` timed passes."""
        return time_call(lambda: module(x), self.device, self.config)
