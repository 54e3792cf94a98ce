"""Benchmark: operator batching of a frozen backbone's layers past the adapters (issue #13
item 1, paper §5.1 Fig. 8).

A frozen CNN backbone (a stride-2 stem and ``--depth`` 3x3 conv + ReLU blocks, no
BatchNorm: its running statistics would make every block a model's own; randomly initialised
under a fixed seed and frozen: nothing can be downloaded here) with an adapter slot after
each block. Model i inserts a small trainable adapter (a 1x1 convolution) after block
``i % depth`` and trains it and its own head (pooling + linear). Past model i's adapter every
frozen block sees other values in each model: CSE cannot share it, batching runs it once on
the models' inputs concatenated along the batch.

Three ways, one after the other in this process, on the same batches (synthetic 32x32 RGB):

- **separate**: each model alone (forward, backward, SGD step), model after model;
- **cse**: one ``GroupModule`` planned with ``cse`` only: the prefix before the first adapter
  once, every later block once per model;
- **cse+batching**: planned with ``cse`` then ``batching`` (what grouped jobs run).

Every step's loss of every model is checked against separate training (exact on this CPU;
the largest difference is printed). Prints each way's CPU and wall seconds (the least of
``--repeats`` runs; one torch thread, so CPU time is this process's work whatever else shares
the cores), the ratios over separate training, ``plan.executions()`` of each way, and writes
``benchmarks/out/batching-bBATCH.csv`` and ``.png``.

Example::

    .venv/bin/python benchmarks/batching.py                       # N = 1, 2, 4, 8, 16
    .venv/bin/python benchmarks/batching.py --models 8 --steps 20 --threads 2
"""
from __future__ import annotations

import argparse
import copy
import os
import time

import torch
from torch import nn
from torch.nn import functional as F

import retiarii as rt
from retiarii.optim import batching, build_group, build_plan, cse
from retiarii.optim.plan import PlanModel

HERE = os.path.dirname(os.path.abspath(__file__))


class Backbone(nn.Module):
    """A frozen stem and ``depth`` frozen conv blocks, an adapter slot after each block."""

    def __init__(self, depth: int, width: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, stride=2, padding=1), nn.ReLU())
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.ReLU())
                                    for _ in range(depth))
        self.slots = nn.ModuleList(nn.Identity() for _ in range(depth))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(width, 10)
        self.stem.requires_grad_(False)
        self.blocks.requires_grad_(False)

    def forward(self, x):  # (B, 3, 32, 32) -> (B, W, 16, 16) -> (B, 10)
        x = self.stem(x)
        for block, slot in zip(self.blocks, self.slots):
            x = slot(block(x))
        return self.head(torch.flatten(self.pool(x), 1))


def make_space(depth: int, width: int) -> rt.ModelSpace:
    torch.manual_seed(0)  # the frozen values
    mutators = [rt.apply_mutator(f"slots.{d}", rt.mutators.OperatorMutator(
        {"id": nn.Identity(), "ad": nn.Conv2d(width, width, 1)}, label=f"s{d}"))
        for d in range(depth)]
    return rt.ModelSpace(Backbone(depth, width), mutators, example_input=torch.randn(2, 3, 32, 32))


def _samples(n: int, depth: int) -> list[dict]:
    return [{f"s{d}/slots.{d}": "ad" if d == i % depth else "id" for d in range(depth)}
            for i in range(n)]


def _batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(steps)]


def _models(space, samples) -> dict[str, nn.Module]:
    out = {}
    for i, s in enumerate(samples):
        torch.manual_seed(100 + i)  # each model's own initial adapter and head
        out[f"m{i}"] = space.build(s, check=False)
    return out


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> tuple[float, float]:
    """(wall, CPU) seconds since ``start``: with one torch thread CPU time is this process's
    work alone, whatever else the shared cores run."""
    return time.perf_counter() - start[0], time.process_time() - start[1]


def _separate(models, data, lr) -> tuple[tuple[float, float], list[dict]]:
    opts = {t: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for t, m in models.items()}
    losses, start = [], _clock()
    for x, y in data:
        step = {}
        for t, m in models.items():
            loss = F.cross_entropy(m(x), y)
            opts[t].zero_grad()
            loss.backward()
            opts[t].step()
            step[t] = loss.item()
        losses.append(step)
    return _since(start), losses


def _grouped(plan, models, data, lr) -> tuple[tuple[float, float], list[dict]]:
    group = build_group(plan, models)
    opts = {t: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for t, m in models.items()}
    losses, start = [], _clock()
    for x, y in data:
        outs = group(x)
        step = {t: F.cross_entropy(outs[t], y) for t in models}
        for opt in opts.values():
            opt.zero_grad()
        sum(step.values()).backward()  # each model's weights get its own loss's gradient
        for opt in opts.values():
            opt.step()
        losses.append({t: v.item() for t, v in step.items()})
    return _since(start), losses


def measure(n: int, args) -> dict:
    space = make_space(args.depth, args.width)
    samples = _samples(n, args.depth)
    base = _models(space, samples)
    data = _batches(args.steps + 1, args.batch)
    plans = {"cse": cse(build_plan([PlanModel(t, space.replay(s), "d")
                                    for t, s in zip(base, samples)])).plan}
    plans["cse+batching"] = batching(plans["cse"]).plan
    warm = data[:1]  # one step outside the clock (allocator, oneDNN primitives)
    runs = {"separate": lambda m, d: _separate(m, d, args.lr)}
    for name, plan in plans.items():
        runs[name] = lambda m, d, p=plan: _grouped(p, m, d, args.lr)
    row = {"models": n, "depth": args.depth, "batch": args.batch, "steps": args.steps}
    times, losses = {}, {}
    for name, run in runs.items():
        run(copy.deepcopy(base), warm)
        best = None
        for _ in range(args.repeats):  # the least of a few runs: the others were disturbed
            took, losses[name] = run(copy.deepcopy(base), data[1:])
            best = took if best is None else (min(best[0], took[0]), min(best[1], took[1]))
        times[name] = best
        row[f"{name}_wall_s"], row[f"{name}_cpu_s"] = round(best[0], 3), round(best[1], 3)
    for name, plan in plans.items():
        row[f"{name}_wall_ratio"] = round(times["separate"][0] / times[name][0], 2)
        row[f"{name}_cpu_ratio"] = round(times["separate"][1] / times[name][1], 2)
        row[f"{name}_executions"] = plan.executions()
        row[f"{name}_max_loss_diff"] = max(abs(a[t] - b[t]) for a, b in
                                           zip(losses[name], losses["separate"]) for t in a)
    row["separate_executions"] = build_plan(
        [PlanModel(t, space.replay(s), "d") for t, s in zip(base, samples)]).executions()
    row["load"] = round(os.getloadavg()[0], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--depth", type=int, default=8, help="frozen blocks (adapter slots)")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: stable timing)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per way; the least")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for n in args.models:
        row = measure(n, args)
        rows.append(row)
        print(f"N={n:3d}  CPU s: separate {row['separate_cpu_s']:6.2f}  cse {row['cse_cpu_s']:6.2f} "
              f"({row['cse_cpu_ratio']:.2f}x)  cse+batching {row['cse+batching_cpu_s']:6.2f} "
              f"({row['cse+batching_cpu_ratio']:.2f}x)  wall ratios {row['cse_wall_ratio']:.2f}x / "
              f"{row['cse+batching_wall_ratio']:.2f}x  executions {row['separate_executions']} / "
              f"{row['cse_executions']} / {row['cse+batching_executions']}  max |loss diff| "
              f"{row['cse+batching_max_loss_diff']:.1e}  load {row['load']}", flush=True)
    _write(rows, f"batching-b{args.batch}")


def _write(rows: list[dict], name: str) -> None:
    from _out import OUT, pyplot, write_csv  # benchmarks/: this script's folder

    out = OUT

    write_csv(rows, name)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ns = [r["models"] for r in rows]
    for way in ("cse", "cse+batching"):
        ax.plot(ns, [r[f"{way}_cpu_ratio"] for r in rows], marker="o", label=way)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("models (adapters at different depths of one frozen CNN)")
    ax.set_ylabel("speed-up over separate training (CPU time)")
    ax.set_title(f"Operator batching past the adapters (CPU, {rows[0]['batch']} per model)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"{name}.png"), dpi=100)
    print(f"wrote {out}/{name}.csv and .png")


if __name__ == "__main__":
    main()
