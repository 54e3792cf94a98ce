"""Benchmark: what hosting a one-shot search in the engine costs per segment.

The engine never trains a one-shot strategy in the driver: every segment is a job whose worker
rebuilds the strategy (``setup``), loads the last unit, runs the segment, writes the next unit
and reports; the driver records the segment and its models in one transaction
(docs/weight_sharing.md). This script runs the same SPOS search (on :data:`space`, digits)
three ways, side by side in one process, and prints the ratio to the first:

- ``by hand``: the strategy driven in this process (``setup`` once, then ``run_segment`` for
  each segment): no engine at all, no unit, nothing survives a crash;
- ``inline``: ``rt.Experiment`` with an executor that runs the worker's job function in this
  process: the engine's own work per segment (rebuild, unit save/load, store), no IPC;
- ``local``: ``rt.Experiment`` on the real ``LocalExecutor`` (one worker, started and warm
  before the clock starts).

All three give the same search (the tests check it bit for bit); the overhead per segment is
(engine - by hand) / segments. The first two are also timed in this process's CPU time
(``*_cpu_s``), which a busy machine disturbs far less than wall time; the local worker's work
happens in another process, so it has wall time only. Prints one line per configuration, writes
``benchmarks/out/one_shot_engine[-cuda].csv`` and a PNG beside it.

Example::

    .venv/bin/python benchmarks/one_shot_engine.py             # 2 and 6 training segments
    .venv/bin/python benchmarks/one_shot_engine.py --quick     # seconds: a smoke test
    .venv/bin/python benchmarks/one_shot_engine.py --device cuda
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
from torch import nn

import retiarii as rt
from retiarii.engine.storage import checkpoint
from retiarii.engine.jobs.job import Executor, JobFailed
from retiarii.engine.executors.local import LocalExecutor
from retiarii.engine.worker_side.worker import WorkerContext, run_job
from retiarii.strategies.one_shot.base import SegmentContext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _out import pyplot, write_csv  # noqa: E402


def _block(i: int) -> nn.Module:
    return rt.LayerChoice({"relu": nn.Sequential(nn.Linear(64, 64), nn.ReLU()),
                           "tanh": nn.Sequential(nn.Linear(64, 64), nn.Tanh()),
                           "skip": nn.Identity()}, label=f"block{i}")


class Net(nn.Module):
    """64 digits pixels -> 3 blocks of 3 choices each (27 models) -> 10 classes."""

    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.stem = nn.Linear(64, 64)
        self.blocks = nn.Sequential(*[_block(i) for i in range(3)])
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.blocks(torch.relu(self.stem(self.flatten(x)))))  # (B, 10)


space = rt.ModelSpace(Net(), example_input=torch.zeros(2, 1, 8, 8))
trainer = rt.Trainer(dataset="digits", batch_size=64)


def strategy(train_segments: int) -> rt.strategies.SPOS:
    return rt.strategies.SPOS(train_segments=train_segments, search_population=8,
                              search_generations=2, eval_batches=2, seed=0)


class Inline(Executor):
    """One slot: the worker's job function, run in this process when an event is asked for."""

    num_slots = 1

    def __init__(self):
        self.jobs, self.events, self.context = [], [], WorkerContext()

    def submit(self, job):
        self.jobs.append(job)

    def next_event(self, timeout=None):
        if not self.events and self.jobs:
            run_job(self.jobs.pop(0), self.events.append, context=self.context)
        return self.events.pop(0) if self.events else None

    def cancel(self, job_id):
        self.events.append(JobFailed(job_id, None, "cancelled"))


def by_hand(train_segments: int, device: torch.device) -> tuple[float, float]:
    """(wall, CPU) seconds of the search without an engine."""
    start, cpu = time.perf_counter(), time.process_time()
    s = strategy(train_segments)
    checkpoint.seed_rng(0)
    s.setup(space, trainer, {}, device)
    for segment in range(s.num_segments()):
        s.run_segment(SegmentContext(segment, trainer, {}, device))
    return time.perf_counter() - start, time.process_time() - cpu


def engine(train_segments: int, executor, folder: str) -> tuple[float, float]:
    """(wall, this process's CPU) seconds of the search through ``rt.Experiment``."""
    path = os.path.join(folder, f"run-{time.monotonic_ns()}.db")
    exp = rt.Experiment(space, strategy(train_segments), trainer, store=path, seed=0,
                        executor=executor)
    start, cpu = time.perf_counter(), time.process_time()
    exp.run()
    return time.perf_counter() - start, time.process_time() - cpu


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one small configuration (seconds)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--segments", type=int, nargs="+", default=[2, 6],
                   help="training segments of each configuration (SPOS adds its search)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads here and in the worker (default 1: spinning thread "
                        "pools inflate CPU time on a busy machine)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    device = torch.device(args.device)
    configs = [1] if args.quick else args.segments
    folder = tempfile.mkdtemp(prefix="one-shot-bench-")
    rows = []
    # the worker sees the GPUs on cuda, none on cpu; as many threads as this process
    local = LocalExecutor(1, None if args.device == "cuda" else [],
                          threads_per_worker=torch.get_num_threads())
    try:
        local.wait_ready()
        by_hand(1, device)  # warm: imports, the data set, the first optimizer
        for train_segments in configs:
            segments = strategy(train_segments).num_segments()
            hand, hand_cpu = by_hand(train_segments, device)
            inline, inline_cpu = engine(train_segments, Inline(), folder)
            remote, _ = engine(train_segments, local, folder)
            row = {"device": args.device, "segments": segments, "by_hand_s": round(hand, 3),
                   "inline_s": round(inline, 3), "local_s": round(remote, 3),
                   "by_hand_cpu_s": round(hand_cpu, 3), "inline_cpu_s": round(inline_cpu, 3),
                   "inline_cpu_ratio": round(inline_cpu / hand_cpu, 3),
                   "local_ratio": round(remote / hand, 3),
                   "inline_cpu_overhead_per_segment_s": round((inline_cpu - hand_cpu) / segments, 3),
                   "local_overhead_per_segment_s": round((remote - hand) / segments, 3)}
            rows.append(row)
            print(f"{args.device} {segments} segments: by hand {hand:.2f} s wall / "
                  f"{hand_cpu:.2f} s CPU; engine inline {inline:.2f} s / {inline_cpu:.2f} s CPU "
                  f"({row['inline_cpu_ratio']}x CPU, "
                  f"{row['inline_cpu_overhead_per_segment_s']:.3f} s CPU per segment); "
                  f"engine on a local worker {remote:.2f} s wall ({row['local_ratio']}x)",
                  flush=True)
    finally:
        local.close()
        shutil.rmtree(folder, ignore_errors=True)
    name = "one_shot_engine" + ("-cuda" if args.device == "cuda" else "") + \
        ("-quick" if args.quick else "")  # a smoke test keeps the real figures
    print("wrote", write_csv(rows, name))
    plt = pyplot()
    if plt is not None and not args.quick:
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in (("by_hand_s", "by hand"), ("inline_s", "engine, inline"),
                           ("local_s", "engine, local worker")):
            ax.plot([r["segments"] for r in rows], [r[key] for r in rows], marker="o",
                    label=label)
        ax.set(xlabel="segments", ylabel="seconds", title=f"SPOS search ({args.device})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(os.path.dirname(os.path.abspath(__file__)), "out",
                                 name + ".png"), dpi=100)
    return rows


if __name__ == "__main__":
    main()
