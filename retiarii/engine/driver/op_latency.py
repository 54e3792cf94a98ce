"""A per-device, per-operator latency table: each distinct operator call of a model (the op,
its settings and its input shapes) is timed alone once per device and kept in the store; a
model's predicted latency is the sum over the calls of its forward pass, so it needs no run
of the model, and a table measured on one device predicts for that device from any other.

The calls are found by an analysis that is an interpreter (:class:`_Calls`, a
:class:`torch.fx.Interpreter` over the built module at batch 1): every ``call_module``,
``call_function`` and ``call_method`` node is one call, keyed as
``Conv2d(8, 16, kernel_size=(3, 3), ...)(f32[1, 8, 8, 8])``. Timing is the engine's
(engine/costs.py): warm-up, then the median of timed calls, one CPU thread or CUDA events.
Rows live in the store's ``costs`` table under the hash ``op:KEY`` and the name
``latency_ms``, beside the per-architecture costs, for the device that measured them.

Example::

    table = OpLatencyTable(store)                          # this machine's CPU, one thread
    table.predict(module, torch.zeros(1, 1, 8, 8))         # ms; measures the missing calls
    table.predict(module, x, device="cuda:NVIDIA H100 80GB HBM3")  # a table measured there
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx

from ...threads import one_thread
from ..storage.pareto import FrontTable

__all__ = ["CostConfig", "OpLatencyTable", "choice_latencies", "describe", "operator_calls",
           "time_call"]


@dataclass(frozen=True)
class CostConfig:
    """How latencies are measured (a model's in engine/costs.py, an operator's here)."""

    # untimed passes first: the allocator, caches and lazy initialisation settle
    warmup: int = 3
    # the median of 15 passes is stable to a few percent for millisecond models on a CPU
    runs: int = 15


def time_call(repeat: Callable[[], Any], device: torch.device,
              config: CostConfig = CostConfig()) -> tuple[float, float]:
    """(median, interquartile range) in ms of ``config.runs`` timed calls of ``repeat`` after
    ``config.warmup`` untimed ones; CUDA events on a GPU, the wall clock on a CPU."""
    for _ in range(config.warmup):
        repeat()
    times = []
    for _ in range(config.runs):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            start.record()
            repeat()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            repeat()
            times.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(times, n=4)
    return statistics.median(times), q[2] - q[0]


def describe(value: Any) -> str:
    """A call argument as it enters a key: a tensor by dtype and shape, a container by its
    items, anything else by its repr (``f32[1, 8, 8, 8]``, ``(f32[1, 8], 0.0)``)."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.float", "f").replace("torch.", "")
        return f"{dtype}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in value.items()) + "}"
    return repr(value)


class _Calls(fx.Interpreter):
    """Runs the graph once and records, for every operator node, its key and a function
    that repeats the call on the very arguments it got."""

    def __init__(self, module: fx.GraphModule):
        super().__init__(module)
        self.calls: list[tuple[str, Callable[[], Any]]] = []

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in ("call_module", "call_function", "call_method"):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if n.op == "call_module":
            mod = self.fetch_attr(n.target)
            # repr, not type and extra_repr: a leaf block (an MBConv kept whole) prints its
            # children there, so two blocks of one class but other kernels differ
            name, call = " ".join(repr(mod).split()), mod
        elif n.op == "call_function":
            name, call = getattr(n.target, "__name__", str(n.target)), n.target
        else:  # a method of its first argument
            name = f".{n.target}"

            def call(self_arg, *rest, _method=n.target, **kw):
                return getattr(self_arg, _method)(*rest, **kw)
        inner = [describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in kwargs.items()]
        key = f"{name}({', '.join(inner)})"
        self.calls.append((key, lambda: call(*args, **kwargs)))
        return super().run_node(n)


def operator_calls(module: torch.nn.Module, example: torch.Tensor) -> list[tuple[str, Callable]]:
    """``(key, repeat)`` of every operator call of one forward pass on ``example``, in order
    (a GraphModule as the engine builds it; another module is traced with torch.fx)."""
    graph_module = module if isinstance(module, fx.GraphModule) else fx.symbolic_trace(module)
    calls = _Calls(graph_module)
    with torch.inference_mode():
        calls.run(example)
    return calls.calls


class OpLatencyTable:
    """The operator latencies of one store, per device.

    Args:
        store: a :class:`~.store.Store` (its ``costs`` table keeps the rows); None keeps them
            in memory only.
        device: where this machine measures (``"cpu"`` or ``"cuda:0"``).
        config: the timing settings (the engine's).
    """

    def __init__(self, store=None, device: str = "cpu", config: CostConfig = CostConfig()):
        self.store, self.device, self.config = store, torch.device(device), config
        self._memory: dict[tuple[str, str], float] = {}  # (device name, key) -> ms

    @property
    def device_name(self) -> str:
        """This machine's device as the rows name it (as engine/costs.py names it)."""
        if self.device.type == "cuda":
            return f"cuda:{torch.cuda.get_device_name(self.device)}"
        return "cpu:1-thread"

    def _lookup(self, device: str, key: str) -> float | None:
        if (device, key) not in self._memory and self.store is not None:
            row = FrontTable(self.store).costs(f"op:{key}", device).get("latency_ms")
            if row is not None:
                self._memory[(device, key)] = row[0]
        return self._memory.get((device, key))

    def predict(self, module: torch.nn.Module, example: torch.Tensor,
                device: str | None = None) -> float:
        """The predicted latency (ms) of one forward pass of ``module`` on ``example`` (batch
        1): the sum over its operator calls of the table's latency on ``device`` (default:
        this machine's, measuring the calls it lacks and keeping them). For another device
        the table must hold every call already.

        Raises:
            KeyError: ``device`` is not this machine's and its table lacks calls (named).
        """
        device = device or self.device_name
        module = module.to(self.device).eval()
        total, missing, fresh = 0.0, [], {}
        with one_thread(), torch.inference_mode():
            for key, repeat in operator_calls(module, example.to(self.device)):
                value = self._lookup(device, key)
                if value is None and key in fresh:
                    value = fresh[key][0]
                if value is None and device == self.device_name:
                    fresh[key] = time_call(repeat, self.device, self.config)
                    value = fresh[key][0]
                if value is None:
                    missing.append(key)
                    continue
                total += value
        if missing:
            raise KeyError(f"the latency table of {device} lacks {len(missing)} operator "
                           f"calls of this model (first: {missing[0]}); measure them on that "
                           f"device with OpLatencyTable(store, device=...).predict(module, "
                           f"example) and copy its store's costs rows here")
        for key, (value, spread) in fresh.items():
            self._memory[(device, key)] = value
            if self.store is not None:
                FrontTable(self.store).add_costs(f"op:{key}", device,
                                                 {"latency_ms": (value, spread)})
        return total


class _First:
    """Every choice at its first candidate, recording the choices met (the base model)."""

    def __init__(self):
        self.trace: list[tuple[str, list]] = []

    def choose(self, label: str, candidates: list, context: dict) -> int:
        self.trace.append((label, list(candidates)))
        return 0


def choice_latencies(space, table: OpLatencyTable, device: str | None = None) -> dict:
    """ProxylessNAS's and FBNet's latency lookup table from the operator table:
    ``{label: {candidate key: ms}}``, each candidate's predicted latency over the base model's
    (every choice at its first candidate) when only that choice changes. The expected latency
    ``sum_label sum_c p_c * table[label][c]`` then differs from the predicted latency of the
    expected architecture by a constant, which moves no gradient. A candidate whose model
    cannot be built alone (a choice another one conditions) is left out.

    Example::

        latency = choice_latencies(space, OpLatencyTable(store))
        rt.strategies.ProxylessNAS(epochs=10, latency=latency, latency_weight=0.1)
    """
    first = _First()
    base = space.sample(first).sample
    example = space.example_input
    example = (example[0] if isinstance(example, (tuple, list)) else example)[:1]
    reference = table.predict(space.instantiate(base).to_module(), example, device)
    out: dict = {}
    for label, candidates in first.trace:
        out[label] = {}
        for key in candidates:
            try:
                module = space.instantiate({**base, label: key}).to_module()
            except Exception:  # noqa: BLE001 (not buildable alone: no entry, said above)
                continue
            out[label][key] = table.predict(module, example, device) - reference
    return out
