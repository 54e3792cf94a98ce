"""Benchmark: a frozen trunk computed once for N models (issue #12, paper Fig. 13).

N models share a frozen convolutional trunk (randomly initialised under a fixed seed and
frozen: no weights can be downloaded here) and differ in their trainable heads. Both ways run
in this process, one after the other, on the same tasks:

- **alone**: each model trains in a job of its own (``worker.run_job``, as the engine does
  today: the trunk runs once per model per batch);
- **grouped**: one job of the N tasks with ``meta["group"] = True``: one loader pass feeds every
  model, the trunk runs once per batch (the CSE pass), each head in its own RNG streams.

It checks that both give every trial the same metrics, then prints the throughput ratio
(alone time / grouped time; issue target on CPU: >= 0.8 N up to N = 16) and writes
``benchmarks/out/frozen_prefix.csv`` and ``.png``.

Example::

    .venv/bin/python benchmarks/frozen_prefix.py              # N = 1, 2, 4, 8, 16
    .venv/bin/python benchmarks/frozen_prefix.py --models 1 4 --epochs 1
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import torch
from torch import nn

import retiarii as rt
from retiarii.engine.executors.base import Job, JobFailed, TrialResult, TrialTask
from retiarii.engine.worker import WorkerContext, run_job

HERE = os.path.dirname(os.path.abspath(__file__))


class Trunk(nn.Module):
    """A frozen CNN trunk (3 conv layers, 32x32 RGB in, 128 features out) and a head."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 64, 3, padding=1)
        self.r1 = nn.ReLU()
        self.c2 = nn.Conv2d(64, 64, 3, padding=1, stride=2)
        self.r2 = nn.ReLU()
        self.c3 = nn.Conv2d(64, 128, 3, padding=1, stride=2)
        self.r3 = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(128, 10)
        for layer in (self.c1, self.c2, self.c3):
            layer.requires_grad_(False)

    def forward(self, x):  # (B, 3, 32, 32) -> (B, 10)
        x = self.r3(self.c3(self.r2(self.c2(self.r1(self.c1(x))))))
        return self.head(torch.flatten(self.pool(x), 1))


HEADS = {f"mlp{w}": nn.Sequential(nn.Linear(128, w), nn.ReLU(), nn.Linear(w, 10))
         for w in (16, 32, 64, 128)}
HEADS["linear"] = nn.Linear(128, 10)

torch.manual_seed(0)  # frozen values must be the same in every process that imports this
SPACE = rt.ModelSpace(Trunk(), [rt.apply_mutator("head", rt.mutators.OperatorMutator(
    HEADS, label="head"))], example_input=torch.randn(2, 3, 32, 32))
# The data set's size comes from the environment of the process that imports this module
# (the benchmark sets it before importing; a worker would read the same).
_IMAGES = int(os.environ.get("FROZEN_PREFIX_IMAGES", "1024"))
_g = torch.Generator().manual_seed(1)
DATA = (torch.randn(_IMAGES, 3, 32, 32, generator=_g),
        torch.randint(0, 10, (_IMAGES,), generator=_g))
TRAINER = rt.Trainer(dataset=DATA, batch_size=128, epochs=1, val_fraction=0.05, lr=3e-3)


def _tasks(n: int, epochs: int) -> list[TrialTask]:
    names = sorted(HEADS)
    return [TrialTask(f"m{i}", {"space": f"{os.path.abspath(__file__)}:SPACE",
                                "trainer": f"{os.path.abspath(__file__)}:TRAINER",
                                "sample": {"head/head": names[i % len(names)]},
                                "hparams": {"epochs": epochs}, "seed": i,
                                # as the engine sends them: the driver checked the shapes
                                "checked": True}, 0, epochs)
            for i in range(n)]


def _run(jobs: list[Job], context: WorkerContext) -> tuple[float, dict]:
    events: list = []
    start = time.perf_counter()
    for job in jobs:
        run_job(job, events.append, context=context)
    seconds = time.perf_counter() - start
    failed = [e for e in events if isinstance(e, JobFailed)]
    if failed:
        raise SystemExit(f"a benchmark job failed: {failed[0].error}")
    metrics = {(e.trial_id, e.step): e.metrics for e in events if isinstance(e, TrialResult)}
    return seconds, metrics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--images", type=int, default=1024,
                   help="synthetic 32x32 images (128 per batch; 5%% held out for validation)")
    args = p.parse_args()
    if args.images != len(DATA[0]):  # the space and trainer are read from this file anew
        os.environ["FROZEN_PREFIX_IMAGES"] = str(args.images)
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]])
    torch.set_num_threads(1)  # one worker's share of the 2 cores; same for both ways
    context = WorkerContext()
    _run([Job("warm", _tasks(1, 1))], context)  # imports, first optimizer, caches
    rows = []
    for n in args.models:
        tasks = _tasks(n, args.epochs)
        alone_s, alone = _run([Job(f"alone-{t.trial_id}", [t]) for t in tasks], context)
        grouped_s, grouped = _run([Job("grouped", tasks, meta={"group": True})], context)
        assert grouped == alone, "grouped training must equal training each model alone"
        images = n * args.epochs * len(DATA[0]) * (1 - 0.05)
        ratio = alone_s / grouped_s
        rows.append({"models": n, "alone_s": round(alone_s, 3), "grouped_s": round(grouped_s, 3),
                     "alone_img_per_s": round(images / alone_s), "grouped_img_per_s":
                     round(images / grouped_s), "speedup": round(ratio, 2),
                     "target": round(0.8 * n, 2), "holds": ratio >= 0.8 * n})
        print(f"N={n:2d}  alone {alone_s:7.2f} s  grouped {grouped_s:7.2f} s  "
              f"speed-up {ratio:5.2f}x  (target >= {0.8 * n:.1f}x: "
              f"{'holds' if ratio >= 0.8 * n else 'missed'})", flush=True)
    out = os.path.join(HERE, "out")
    os.makedirs(out, exist_ok=True)
    suffix = "" if args.images == 1024 else f"-{args.images}"
    with open(os.path.join(out, f"frozen_prefix{suffix}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    ns = [r["models"] for r in rows]
    ax.plot(ns, [r["speedup"] for r in rows], marker="o", label="grouped / alone")
    ax.plot(ns, [0.8 * n for n in ns], ls="--", label="target 0.8 N")
    ax.set(xlabel="models sharing the frozen trunk", ylabel="throughput ratio",
           title="Frozen trunk computed once (CPU, 1 thread)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"frozen_prefix{suffix}.png"), dpi=100)
    print(f"wrote {out}/frozen_prefix{suffix}.csv and .png")


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
