"""A long search in one driver process: its memory stays flat, its store grows with its metrics.

One Random search of ``--models`` models (default 2000) over a space of 4800 (30 MLP
architectures on the digits x 8 learning rates x 20 weight decays) runs in phases on one store,
each a new ``Experiment`` resuming the last, in one driver process:

- the bulk on the :class:`~retiarii.engine.executors.simulated.SimulatedExecutor` (virtual
  time, learning curves instead of training, but the real strategy, runner, scheduler, plans
  and store);
- ``--real`` models in the middle on real local worker processes training on the digits (the
  engine's default ``optimize="auto"``: grouped, measured jobs, checkpoint files and GC).

A sampling thread records, every ``--every`` seconds, the driver's resident memory (RSS, from
``/proc/self/statm``), the store's size on disk (the database and its WAL) and the metric
rows, trials and models it holds. Printed as a table, written to
``benchmarks/out/long_run.csv`` (and ``long_run.png`` with matplotlib). Nothing is timed:
what matters is that RSS does not grow with the models done and the store's bytes per
metric row do not grow either (tests/test_long_run.py asserts both on a shorter run).

    .venv/bin/python benchmarks/long_run.py [--models 2000] [--real 24] [--every 0.5]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import sqlite3
import sys
import tempfile
import threading
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import retiarii as rt  # noqa: E402
from retiarii.engine import LocalExecutor  # noqa: E402
from retiarii.engine.executors.simulated import SimulatedExecutor  # noqa: E402


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        hidden = rt.ValueChoice([8, 12, 16, 20, 24, 28, 32, 40, 48, 64], label="hidden")
        self.flatten = nn.Flatten()
        self.fc1 = rt.nn.Linear(64, hidden)
        self.act = rt.LayerChoice({"relu": nn.ReLU(), "tanh": nn.Tanh(), "sigmoid": nn.Sigmoid()},
                                  label="act")
        self.fc2 = rt.nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.flatten(x))))  # (B, 1, 8, 8) -> (B, 10)


# Module level: the real workers import this script by reference.
space = rt.ModelSpace(MLP(), example_input=torch.zeros(2, 1, 8, 8))
trainer = rt.Trainer(dataset="digits", epochs=2, batch_size=128,
                     lr=rt.ValueChoice([0.005, 0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15],
                                       label="lr"),
                     weight_decay=rt.ValueChoice([0.0] + [10.0 ** (-k / 4) for k in range(8, 27)],
                                                 label="weight_decay"))


def curve(spec: dict, step: int) -> dict:
    """The simulator's learning curves: the metrics a real epoch reports, per model and step."""
    c = spec["choices"]
    noise = random.Random(f"{sorted(c.items())}/{step}").uniform(-0.01, 0.01)
    acc = 0.6 + 0.3 * (1 - 0.5 ** step) * min(1.0, c["hidden"] / 32) + noise
    return {"train_loss": 1.0 / step + noise, "val_loss": 1.2 / step - noise, "val_acc": acc}


def rss_bytes() -> int:
    """This process's resident memory (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def store_bytes(path: str) -> int:
    return sum(os.path.getsize(p) for p in (path, path + "-wal") if os.path.exists(p))


def counts(path: str) -> tuple[int, int, int, int]:
    """(metric rows, trials, models, bytes) the store holds, read by a connection of its own:
    its size is the database's pages as its last commit left them (WAL included), which the
    files on disk show only after a checkpoint of the WAL."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True,
                                                timeout=5)) as con:
            with con:  # one read transaction: counts and size of one snapshot
                rows = [con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                        for t in ("metrics", "trials", "models")]
                pages = con.execute("PRAGMA page_count").fetchone()[0]
                size = con.execute("PRAGMA page_size").fetchone()[0]
            return (*rows, pages * size)
    except sqlite3.Error:  # not created yet
        return (0, 0, 0, 0)


class Sampler:
    """Samples RSS, store size and row counts every ``every`` seconds in a thread."""

    def __init__(self, path: str, every: float):
        self.path, self.every, self.rows = path, every, []
        self.phase = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="long-run-sampler", daemon=True)

    def sample(self) -> dict:
        metrics, trials, models, size = counts(self.path)
        row = {"t_s": round(time.monotonic() - self._t0, 2), "phase": self.phase,
               "models": models, "trials": trials, "metrics": metrics,
               "rss_mb": round(rss_bytes() / 2 ** 20, 2), "store_mb": round(size / 2 ** 20, 3),
               "disk_mb": round(store_bytes(self.path) / 2 ** 20, 3)}
        self.rows.append(row)
        return row

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def __enter__(self):
        self._t0 = time.monotonic()
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()


def experiment(path: str, executor) -> rt.Experiment:
    return rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=path,
                         executor=executor, seed=0)


def long_run(path: str, models: int, real: int, every: float = 0.5,
             workers: int = 2) -> list[dict]:
    """Run the phased search into the store ``path``; the sampled rows."""
    before = (models - real) // 2  # simulated, then real, then simulated to the end
    phases = [("simulated", before), ("real", before + real), ("simulated", models)]
    if not real:
        phases = [("simulated", models)]
    with Sampler(path, every) as sampler:
        for i, (kind, upto) in enumerate(phases):
            sampler.phase = kind
            if kind == "real":
                with LocalExecutor(workers, [], threads_per_worker=1) as executor:
                    exp = experiment(path, executor)
                    exp.resume(max_models=upto)
            else:
                exp = experiment(path, SimulatedExecutor(8, curve))
                exp.run(max_models=upto) if i == 0 else exp.resume(max_models=upto)
            del exp
            sampler.sample()
    return sampler.rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=2000)
    parser.add_argument("--real", type=int, default=24, help="models trained by real workers")
    parser.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from _out import pyplot, write_csv

    with tempfile.TemporaryDirectory() as tmp:
        rows = long_run(os.path.join(tmp, "long.db"), args.models, args.real, args.every)
    print(f"{'t_s':>8} {'phase':>9} {'models':>7} {'trials':>7} {'metrics':>8} {'rss_mb':>8} "
          f"{'store_mb':>9} {'B/metric':>9}")
    for r in rows[:: max(1, len(rows) // 40)] + rows[-1:]:
        per = r["store_mb"] * 2 ** 20 / r["metrics"] if r["metrics"] else float("nan")
        print(f"{r['t_s']:8.1f} {r['phase']:>9} {r['models']:7d} {r['trials']:7d} "
              f"{r['metrics']:8d} {r['rss_mb']:8.1f} {r['store_mb']:9.3f} {per:9.0f}")
    print("wrote", write_csv(rows, "long_run"))
    plt = pyplot()
    if plt is not None:
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        a.plot([r["models"] for r in rows], [r["rss_mb"] for r in rows])
        a.set_xlabel("models done"), a.set_ylabel("driver RSS (MiB)")
        b.plot([r["metrics"] for r in rows], [r["store_mb"] for r in rows])
        b.set_xlabel("metric rows"), b.set_ylabel("store on disk (MiB)")
        fig.tight_layout()
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "long_run.png")
        fig.savefig(path)
        print("wrote", path)


if __name__ == "__main__":
    main()
