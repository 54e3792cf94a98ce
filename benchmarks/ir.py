"""Benchmark: the Graph IR's round trip for every zoo model and a ResNet-50-sized model.

For each model it times (median of ``--repeats`` runs, after one untimed warm-up run)

* ``trace``     ``retiarii.trace(model)``: torch.fx tracing plus conversion to our IR,
* ``json``      ``Graph.from_json(graph.to_json())``: the JSON round trip,
* ``to_module`` ``graph.to_module()``: a runnable ``nn.Module``, fresh weights included,

their sum ``total`` (the target: <= 0.5 s for ResNet-50), and side by side the torch.fx
baseline for the same model: ``fx_trace`` (``torch.fx.symbolic_trace``) and ``fx_recompile``
(``fx.GraphModule(traced, traced.graph)``: copying the modules and regenerating the code),
``fx_total`` and the ratio ``total / fx_total``. For reference, ``cold_trace`` is the first
trace of the model in this process (module specs not yet verified; ``trace`` hits that cache),
``lint`` is ``graph.lint()`` (not in the total) and ``build`` is the model's own constructor:
fx shares the original's weights, ``to_module`` must create fresh ones, as ``build`` does.

Prints a table and writes one row per model (milliseconds) to ``benchmarks/out/ir.csv``.

Example::

    .venv/bin/python benchmarks/ir.py --repeats 7
"""
from __future__ import annotations

import argparse
import csv
import gc
import os
import statistics
import sys
import time

import torch
import torch.fx as fx
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import retiarii  # noqa: E402
import zoo  # noqa: E402
from retiarii import Graph  # noqa: E402

COLUMNS = ("cold_trace", "trace", "json", "to_module", "total", "fx_trace", "fx_recompile",
           "fx_total", "ratio", "lint", "build", "nodes")
TARGET_S = 0.5  # ResNet-50: trace + JSON round trip + to_module


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds of ``repeats`` calls (after one untimed warm-up call) and a result.

    The garbage collector is paused while timing: a collection costs ~0.2 s here (torch
    holds many objects) and would land on whichever call happened to trigger it.
    """
    result = fn()
    times = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            result = None  # free the last result first (a ResNet-50 holds 100 MB of weights)
            start = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return statistics.median(times), result


def measure(factory, trace_kwargs: dict, repeats: int) -> dict[str, float]:
    """Seconds per stage for one model (see the module docstring)."""
    row: dict[str, float] = {}
    row["build"], model = timed(factory, repeats)
    start = time.perf_counter()
    graph = retiarii.trace(model, **trace_kwargs)
    row["cold_trace"] = time.perf_counter() - start
    row["trace"], graph = timed(lambda: retiarii.trace(model, **trace_kwargs), repeats)
    row["json"], graph = timed(lambda: Graph.from_json(graph.to_json()), repeats)
    row["to_module"], _ = timed(graph.to_module, repeats)
    row["lint"], _ = timed(graph.lint, repeats)
    row["total"] = row["trace"] + row["json"] + row["to_module"]
    tracer_kwargs = {"concrete_args": trace_kwargs["concrete_args"]} \
        if "concrete_args" in trace_kwargs else {}
    leaves = tuple(t for t in trace_kwargs.get("leaf_modules", ()) if isinstance(t, type))
    if leaves or any(retiarii.modspec.is_marked_leaf(m) for m in model.modules()):
        tracer = _LeafTracer(leaves)  # the same leaves as ours, or fx traces into them
        row["fx_trace"], traced = timed(
            lambda: fx.GraphModule(model, tracer.trace(model, **tracer_kwargs)), repeats)
    else:
        row["fx_trace"], traced = timed(lambda: fx.symbolic_trace(model, **tracer_kwargs),
                                        repeats)
    row["fx_recompile"], _ = timed(lambda: fx.GraphModule(traced, traced.graph), repeats)
    row["fx_total"] = row["fx_trace"] + row["fx_recompile"]
    row["ratio"] = row["total"] / row["fx_total"]
    row["nodes"] = len(graph)
    return row


class _LeafTracer(fx.Tracer):
    def __init__(self, leaves: tuple):
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, self.leaves) or retiarii.modspec.is_marked_leaf(m) \
            or super().is_leaf_module(m, qualname)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per stage (median)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: torch's default, one per core)")
    parser.add_argument("--only", nargs="*", help="model names to run (default: all)")
    parser.add_argument("--out", default=os.path.join(HERE, "out", "ir.csv"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    retiarii.trace(nn.Sequential(nn.Linear(2, 2)))  # one-off import and fx set-up costs
    # ResNet-50 first, so its cold trace does not profit from specs verified for other models
    models = [("resnet50", zoo.resnet50, {})]
    models += [(c.name, c.factory, c.trace_kwargs) for c in zoo.cases()]
    if args.only:
        models = [m for m in models if m[0] in args.only]
    rows = []
    header = f"{'model':<18}" + "".join(f"{c:>13}" for c in COLUMNS)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs; milliseconds, median of {args.repeats}")
    print(header)
    for name, factory, trace_kwargs in models:
        torch.manual_seed(0)
        row = measure(factory, trace_kwargs, args.repeats)
        rows.append({"model": name, **{c: row[c] if c in ("ratio", "nodes") else row[c] * 1e3
                                       for c in COLUMNS}})
        print(f"{name:<18}" + "".join(
            f"{row[c]:>13.2f}" if c == "ratio" else f"{row[c]:>13d}" if c == "nodes"
            else f"{row[c] * 1e3:>13.1f}" for c in COLUMNS), flush=True)
    zoo_rows = [r for r in rows if r["model"] != "resnet50"]
    if zoo_rows:
        print(f"zoo ({len(zoo_rows)} models): total {sum(r['total'] for r in zoo_rows):.1f} ms, "
              f"fx_total {sum(r['fx_total'] for r in zoo_rows):.1f} ms")
    r50 = next((r for r in rows if r["model"] == "resnet50"), None)
    if r50:
        verdict = "meets" if r50["total"] <= TARGET_S * 1e3 else "MISSES"
        print(f"resnet50: trace + json + to_module = {r50['total']:.0f} ms ({verdict} the "
              f"<= {TARGET_S * 1e3:.0f} ms target); {r50['ratio']:.1f}x fx's trace + recompile")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["model", *COLUMNS])
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
