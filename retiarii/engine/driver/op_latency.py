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

The sum of operators timed alone misses what a whole pass adds on every call (the
generated forward's Python between calls, caches the other operators have evicted), so a
device's table carries a linear calibration ``measured = scale * sum + per_call_ms * calls``
fitted once by :meth:`OpLatencyTable.calibrate` on whole passes of a few models (kept under
the hash ``op-calibration``, names ``scale`` and ``per_call_ms``); :meth:`~OpLatencyTable.predict`
applies the calibration of the device it predicts for, where there is one.

Example::

    table = OpLatencyTable(store)                          # this machine's CPU, one thread
    table.predict(module, torch.zeros(1, 1, 8, 8))         # ms; measures the missing calls
    table.predict(module, x, device="cuda:NVIDIA H100 80GB HBM3")  # a table measured there
    table.calibrate([space.instantiate(s).to_module() for s in samples], x)  # once a device
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx

from ...threads import one_thread
from ..jobs.measure_lock import machine_lock
from ..storage.pareto import FrontTable

__all__ = ["CALIBRATION", "CostConfig", "OpLatencyTable", "choice_latencies", "describe",
           "fit_calibration", "operator_calls", "time_call"]

CALIBRATION = "op-calibration"  # the costs rows' hash of a device's calibration


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


def fit_calibration(sums: list[float], calls: list[int],
                    measured: list[float]) -> tuple[float, float]:
    """``(scale, per_call_ms)``, both >= 0, minimising ``sum_i ((m_i - scale * s_i - per_call
    * c_i) / m_i) ** 2``: least squares on relative errors (the error reported is relative,
    and a large model must not outweigh the small ones), solved by its 2x2 normal equations.
    Where that optimum has a negative term (the sums and call counts of one space's models
    grow together, so noise can trade one for the other) or cannot tell the two apart (sums
    proportional to calls), the term is dropped and the other fitted alone.

    Raises:
        ValueError: no model, lists of different lengths, or a latency that is not positive.
    """
    if not (len(sums) == len(calls) == len(measured)) or not sums:
        raise ValueError(f"calibrating needs at least one model with a sum, a call count "
                         f"and a measured latency each (got {len(sums)}, {len(calls)}, "
                         f"{len(measured)})")
    if any(m <= 0 for m in measured) or any(s < 0 for s in sums):
        raise ValueError(f"measured latencies must be positive and sums not negative (got "
                         f"{min(measured)} and {min(sums)})")
    # relative residuals: divide each row by its measured latency, target 1
    xs = [(s / m, c / m) for s, c, m in zip(sums, calls, measured)]
    ss = sum(x * x for x, _ in xs)
    sc = sum(x * y for x, y in xs)
    cc = sum(y * y for _, y in xs)
    s1, c1 = sum(x for x, _ in xs), sum(y for _, y in xs)
    det = ss * cc - sc * sc
    if det > 1e-9 * ss * cc:
        scale, per_call = (s1 * cc - c1 * sc) / det, (c1 * ss - s1 * sc) / det
        if scale >= 0 and per_call >= 0:
            return scale, per_call
    # one term alone: the scale unless the models have no operator time at all
    if ss > 0:
        return s1 / ss, 0.0
    if cc > 0:
        return 0.0, c1 / cc
    raise ValueError("the calibration models have neither operator time nor calls: "
                     "calibrate on models that run operators")


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
        self._calibration: dict[str, tuple[float, float] | None] = {}  # device -> (a, b)

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

    def calibration(self, device: str | None = None) -> tuple[float, float] | None:
        """``(scale, per_call_ms)`` of ``device`` (default: this machine's) as stored, or
        None where it was never calibrated."""
        device = device or self.device_name
        if device not in self._calibration:
            rows = ({} if self.store is None
                    else FrontTable(self.store).costs(CALIBRATION, device))
            self._calibration[device] = ((rows["scale"][0], rows["per_call_ms"][0])
                                         if "scale" in rows and "per_call_ms" in rows
                                         else None)
        return self._calibration[device]

    def calibrate(self, modules: list[torch.nn.Module], example: torch.Tensor,
                  rounds: int = 5, measured: list[float] | None = None) -> tuple[float, float]:
        """Fit and keep this machine's calibration (:func:`fit_calibration`) from whole
        passes of ``modules`` on ``example`` (batch 1), timed as engine/costs.py times a
        model, against their uncalibrated sums. Calibrate on models other than those the
        prediction is judged on; a handful of several sizes is enough. Each model's latency
        is the median of ``rounds`` medians taken in rounds over all the models: a burst
        of load while one model is timed would otherwise stay in the device's calibration
        for good, and their smallest would sit below the one median the engine reports
        (on this 2-core machine by ~25%: whole passes vary that much from round to round).

        ``measured`` gives the models' latencies (ms, batch 1, this device) instead: the
        engine's own ``latency_ms`` of models a search already measured, say, which then
        need no timing here.

        Raises:
            ValueError: ``rounds`` below 1, or ``measured`` not one positive latency per module.
        """
        if rounds < 1:
            raise ValueError(f"rounds must be at least 1 (got {rounds})")
        if measured is not None and len(measured) != len(modules):
            raise ValueError(f"measured needs one latency per module ({len(measured)} "
                             f"latencies for {len(modules)} modules)")
        x = example.to(self.device)
        modules = [m.to(self.device).eval() for m in modules]
        sums, calls = [], []
        for module in modules:
            total, n = self._sum(module, x, self.device_name)
            sums.append(total)
            calls.append(n)
        if measured is None:
            timed: list[list[float]] = [[] for _ in modules]
            # this machine's workers pause, as for the engine's own latencies (costs.py)
            with one_thread(), torch.inference_mode(), machine_lock().measuring():
                for _ in range(rounds):
                    for i, module in enumerate(modules):
                        timed[i].append(time_call(lambda: module(x), self.device,
                                                  self.config)[0])
            measured = [statistics.median(t) for t in timed]
        scale, per_call = fit_calibration(sums, calls, measured)
        self._calibration[self.device_name] = (scale, per_call)
        if self.store is not None:
            FrontTable(self.store).add_costs(CALIBRATION, self.device_name,
                                             {"scale": (scale, None),
                                              "per_call_ms": (per_call, None),
                                              "models": (float(len(modules)), None)})
        return scale, per_call

    def predict(self, module: torch.nn.Module, example: torch.Tensor,
                device: str | None = None, calibrated: bool = True) -> float:
        """The predicted latency (ms) of one forward pass of ``module`` on ``example`` (batch
        1): the sum over its operator calls of the table's latency on ``device`` (default:
        this machine's, measuring the calls it lacks and keeping them), corrected by that
        device's calibration where it has one (``calibrated=False``: the plain sum). For
        another device the table must hold every call already.

        Raises:
            KeyError: ``device`` is not this machine's and its table lacks calls (named).
        """
        device = device or self.device_name
        total, calls = self._sum(module.to(self.device).eval(), example.to(self.device), device)
        fit = self.calibration(device) if calibrated else None
        return total if fit is None else fit[0] * total + fit[1] * calls

    def _sum(self, module: torch.nn.Module, example: torch.Tensor,
             device: str) -> tuple[float, int]:
        """(the sum of the operator latencies on ``device``, the number of calls)."""
        total, missing, fresh, calls = 0.0, [], {}, 0
        with one_thread(), torch.inference_mode():
            for key, repeat in operator_calls(module, example):
                calls += 1
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
        return total, calls


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
