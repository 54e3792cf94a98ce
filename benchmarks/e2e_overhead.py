"""Benchmark: where a small search's time goes outside its jobs' batches (issue #26 item 4).

Every search runs in a fresh Python process, as a user's script does (``python search.py``),
so that everything a search pays once is on the clock: the interpreter, the driver's own
``import retiarii``, the store, the executor's worker processes. The trainer,
:class:`TimingTrainer`, writes one line per epoch it trains (its process, when it asked for
the epoch's batches, when its last validation batch ended) to a log; the union of those
intervals is the time *in batches* (forward, backward, optimizer steps, validation), and
everything else between ``Experiment.run()`` and its return is *outside*:

- ``import``: the driver's ``import retiarii`` (torch included), not counted in the targets;
- ``to first batch``: from ``run()`` to the first batch of the first job: store, strategy,
  executor and workers started, the first job dispatched and its model built;
- ``per job``: the gaps between one job's last batch and the next job's first batch
  (result recorded, checkpoint written, strategy asked, next job dispatched, model built);
  with ``workers=1`` and ``optimize=False`` each gap is one job's overhead;
- ``tail``: from the last batch to the return of ``run()`` (workers stopped, store closed).

Targets (issue #26): median per-job overhead <= 50 ms; fixed cost of a search (``to first
batch`` + ``tail``) <= 1 s beyond the driver's own ``import retiarii``.

Prints a table (median over ``--repeats`` processes per configuration) and writes
``benchmarks/out/e2e_overhead.csv``.

Example::

    .venv/bin/python benchmarks/e2e_overhead.py                  # 3 repeats, 12 models
    .venv/bin/python benchmarks/e2e_overhead.py --repeats 5 --models 24
"""
from __future__ import annotations

import time

T_START = time.monotonic()  # before torch and retiarii: the driver's own import is measured

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import retiarii as rt  # noqa: E402 (after the path: runs from a checkout without installing)

T_IMPORTED = time.monotonic()

from _out import write_csv  # noqa: E402

OUT = os.path.join(HERE, "out")
TARGET_JOB_MS = 50.0
TARGET_FIXED_S = 1.0
CONFIGS = {  # name: (workers, optimize)
    "apart-w1": (1, False),
    "default-w1": (1, "auto"),
    "default-w2": (2, "auto"),
}


# ---- the space and the trainer (module level: workers import them from this file) ------------


class Net(nn.Module):
    """16 features -> 32 -> one of 3 activations -> width -> 4 classes: (B, 16) -> (B, 4)."""

    def __init__(self):
        super().__init__()
        self.stem = rt.nn.Linear(16, 32)
        self.act = rt.LayerChoice({"relu": nn.ReLU(), "tanh": nn.Tanh(), "gelu": nn.GELU()})
        width = rt.ValueChoice([16, 32, 48, 64], label="width")
        self.mid = rt.nn.Linear(32, width)
        self.head = rt.nn.Linear(width, 4)

    def forward(self, x):
        return self.head(torch.relu(self.mid(self.act(self.stem(x)))))


SPACE = rt.ModelSpace(Net(), example_input=torch.zeros(2, 16))


class TimingTrainer(rt.engine.trainer.Trainer):
    """One epoch of 4 batches of 32 generated examples; logs each epoch's span in batches.

    Args:
        log: the file each epoch appends ``pid start end`` to (monotonic seconds, which
            every process of this machine reads from the same clock).
    """

    epochs = 1

    def __init__(self, log: str):
        self.log = log
        generator = torch.Generator().manual_seed(0)
        self.batches = [(torch.randn(32, 16, generator=generator),  # (B, 16)
                         torch.randint(0, 4, (32,), generator=generator)) for _ in range(4)]
        self._start = 0.0

    def to_spec(self) -> dict:
        return {"class": f"{os.path.abspath(__file__)}:TimingTrainer", "config": {"log": self.log}}

    def data_key(self, hparams: dict) -> str:
        return "generated-0"  # the batches depend on nothing: models may share them

    def train_dataloader(self, hparams, epoch):
        self._start = time.monotonic()
        return self.batches

    def val_dataloader(self, hparams):
        return self.batches[:1]

    def training_step(self, model, batch, hparams):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    def validation_step(self, model, batch):
        x, y = batch
        accuracy = (model(x).argmax(dim=1) == y).float().mean()
        with open(self.log, "a") as f:  # one short line: an atomic append
            f.write(f"{os.getpid()} {self._start} {time.monotonic()}\n")
        return {"val_acc": accuracy}


# ---- one search, in this (fresh) process ------------------------------------------------------


def busy_union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of the intervals ``spans``, as sorted disjoint intervals."""
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def child(args) -> None:
    folder = os.path.join(OUT, f"e2e-overhead-{os.getpid()}")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    log = os.path.join(folder, "batches.log")
    workers, optimize = CONFIGS[args.child]
    t_made = time.monotonic()
    exp = rt.Experiment(SPACE, rt.strategies.Random(seed=args.seed), TimingTrainer(log),
                        store=os.path.join(folder, "search.db"), workers=workers,
                        max_models=args.models, seed=args.seed, optimize=optimize)
    t_run = time.monotonic()
    exp.run()
    t_end = time.monotonic()
    with open(log) as f:
        spans = [(float(a), float(b)) for _, a, b in (line.split() for line in f)]
    busy = busy_union(spans)
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:])]
    shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps({
        "import_s": T_IMPORTED - T_START, "experiment_s": t_run - t_made,
        "to_first_batch_s": busy[0][0] - t_run, "tail_s": t_end - busy[-1][1],
        "gaps_s": gaps, "in_batches_s": sum(b - a for a, b in busy),
        "run_s": t_end - t_run, "epochs": len(spans)}))


# ---- the orchestrator -------------------------------------------------------------------------


def launch(config: str, args) -> dict:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", config,
                           "--models", str(args.models), "--seed", str(args.seed)],
                          capture_output=True, text=True, check=False)
    wall = time.monotonic() - t0
    if done.returncode != 0:
        raise RuntimeError(f"the {config} search failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = wall
    return result


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=12, help="models per search")
    parser.add_argument("--repeats", type=int, default=3, help="processes per configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--child", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    print(f"{args.models} models per search, {args.repeats} processes per configuration, "
          f"load {load()} before")
    results: dict[str, list[dict]] = {c: [] for c in args.configs}
    for _ in range(args.repeats):  # interleaved: a busy neighbour hits every config alike
        for config in args.configs:
            results[config].append(launch(config, args))
    rows = []
    print(f"{'config':<12}{'import s':>9}{'1st batch s':>12}{'tail s':>8}{'fixed s':>8}"
          f"{'job ms (median)':>16}{'jobs':>6}{'outside s':>10}{'run s':>8}{'process s':>10}")
    for config, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs)
               for k in ("import_s", "to_first_batch_s", "tail_s", "run_s", "process_s",
                         "in_batches_s", "experiment_s")}
        gaps = [g for r in runs for g in r["gaps_s"]]
        job_ms = statistics.median(gaps) * 1000 if gaps else float("nan")
        fixed = med["to_first_batch_s"] + med["tail_s"] + med["experiment_s"]
        outside = med["run_s"] - med["in_batches_s"]
        print(f"{config:<12}{med['import_s']:>9.2f}{med['to_first_batch_s']:>12.2f}"
              f"{med['tail_s']:>8.2f}{fixed:>8.2f}{job_ms:>16.1f}"
              f"{len(gaps) // max(1, len(runs)):>6}{outside:>10.2f}{med['run_s']:>8.2f}"
              f"{med['process_s']:>10.2f}")
        for i, r in enumerate(runs):
            rows.append({"config": config, "repeat": i, "models": args.models,
                         "import_s": r["import_s"], "experiment_s": r["experiment_s"],
                         "to_first_batch_s": r["to_first_batch_s"], "tail_s": r["tail_s"],
                         "median_job_ms": statistics.median(r["gaps_s"]) * 1000
                         if r["gaps_s"] else "", "jobs_gaps": len(r["gaps_s"]),
                         "in_batches_s": r["in_batches_s"], "run_s": r["run_s"],
                         "process_s": r["process_s"]})
    print(f"targets: median per-job <= {TARGET_JOB_MS:.0f} ms, fixed (Experiment() + to first "
          f"batch + tail) <= {TARGET_FIXED_S:.0f} s; load {load()} after")
    print("wrote", write_csv(rows, "e2e_overhead"))


if __name__ == "__main__":
    main()
