"""Benchmark: the cost of instantiating random models of the NASNet-like space.

For each of ``--models`` random samples of :func:`model_spaces.nasnet.nasnet_space` it times

* ``sample``    the sampler's decisions (time spent inside ``sampler.choose``),
* ``mutate``    the rest of ``space.sample``: copying the base graph and running the 20 mutators,
* ``lint``      ``graph.lint()`` (every invariant, every module spec constructible),
* ``to_module`` ``graph.to_module()``: a runnable ``nn.Module`` with fresh weights,

their sum ``total`` (the <= 20 ms target), and for reference ``shapes`` (the shape check of
``space.instantiate``: one forward pass on the example input, not in the total), ``direct``
(the same architecture built by hand-written Python, ``NASNet(genotype)``, for the same
sample) and ``fx_trace`` (``torch.fx.symbolic_trace`` of that module). Prints a table and
writes one row per stage (median, p90, mean in ms) to ``benchmarks/out/space.csv``.

Example::

    .venv/bin/python benchmarks/space.py --models 1000
"""
from __future__ import annotations

import argparse
import csv
import gc
import os
import random
import statistics
import time

import torch
import torch.fx as fx

from model_spaces.nasnet import NASNet, genotype_of, nasnet_space
from retiarii.shapes import propagate

STAGES = ("sample", "mutate", "lint", "to_module", "total", "shapes", "direct", "fx_trace")


class TimedSampler:
    """Uniform random choices; accumulates the seconds spent deciding."""

    def __init__(self, seed: int, clock):
        self.rng = random.Random(seed)
        self.clock = clock
        self.seconds = 0.0

    def choose(self, label, candidates, context) -> int:
        start = self.clock()
        index = self.rng.randrange(len(candidates))
        self.seconds += self.clock() - start
        return index


def time_one(space, seed: int, args) -> dict[str, float]:
    """Seconds per stage for the model of one seed."""
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    out: dict[str, float] = {}
    sampler = TimedSampler(seed, clock)
    start = clock()
    model = space.sample(sampler)
    out["sample"] = sampler.seconds
    out["mutate"] = clock() - start - sampler.seconds
    start = clock()
    model.graph.lint()
    out["lint"] = clock() - start
    start = clock()
    model.to_module()
    out["to_module"] = clock() - start
    out["total"] = out["sample"] + out["mutate"] + out["lint"] + out["to_module"]
    replayed = space.replay(model.sample)
    start = clock()
    propagate(replayed, space.example_input)  # what instantiate adds to replay
    out["shapes"] = clock() - start
    genotype = genotype_of(model.sample)
    start = clock()
    net = NASNet(genotype, args.channels, args.cells, 3, 10)
    out["direct"] = clock() - start
    start = clock()
    fx.symbolic_trace(net)
    out["fx_trace"] = clock() - start
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--cells", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: time.perf_counter; cpu: this process's CPU time "
                             "(steadier on a machine shared with other jobs)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out",
                                                      "space.csv"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one model at a time, as a worker builds it
    space = nasnet_space(channels=args.channels, num_cells=args.cells)
    for seed in range(args.warmup):  # imports, caches of module specs
        time_one(space, 10**6 + seed, args)
    times: dict[str, list[float]] = {s: [] for s in STAGES}
    gc.collect()
    for seed in range(args.models):
        for stage, seconds in time_one(space, seed, args).items():
            times[stage].append(seconds * 1e3)
    rows = [{"stage": s, "median_ms": round(statistics.median(times[s]), 3),
             "p90_ms": round(percentile(times[s], 0.9), 3),
             "mean_ms": round(statistics.fmean(times[s]), 3)} for s in STAGES]
    print(f"NASNet-like space, {args.cells} cells x 5 blocks, C={args.channels}, "
          f"{args.models} random models, {args.clock} clock, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs")
    print(f"{'stage':<10} {'median ms':>10} {'p90 ms':>10} {'mean ms':>10}")
    for row in rows:
        print(f"{row['stage']:<10} {row['median_ms']:>10.2f} {row['p90_ms']:>10.2f} "
              f"{row['mean_ms']:>10.2f}")
    median = rows[STAGES.index("total")]["median_ms"]
    print(f"target: median total <= 20 ms: {'holds' if median <= 20 else 'does not hold'} "
          f"({median:.2f} ms)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["stage", "median_ms", "p90_ms", "mean_ms"])
        writer.writeheader()
        writer.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
