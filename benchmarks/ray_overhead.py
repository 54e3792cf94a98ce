"""Benchmark: the engine's overhead per model on Ray against LocalExecutor, and throughput.

Issue #16 asks for the engine overhead per model on :class:`~retiarii.engine.executors.ray.
RayExecutor` next to :class:`~retiarii.engine.executors.local.LocalExecutor`, with the trivial
trainer of ``benchmarks/engine.py``, and for throughput with 2 and 4 actors. This script reuses
that benchmark's pieces by import (its space, :class:`TinyTrainer`, :class:`TimedExperiment`,
:class:`Buckets`, :func:`stats`), so a model's **overhead** means the same here: its latency
from the moment the engine asks the strategy for it to the moment its result is recorded, minus
the time spent in the trainer's own code (which the trainer reports as ``trainer_s``).

One run, side by side: for each worker count (2 and 4 by default), a real
:class:`retiarii.Experiment` (random search, FIFO, the SQLite store, checkpoints written) of
``--warmup + --models`` models on LocalExecutor and on RayExecutor (one private local Ray
instance for the whole script, started first; every executor's workers are up before the clock
starts). Each worker uses one torch thread; a Ray actor holds one logical CPU (the instance
offers as many as the largest run needs). With several workers the overhead of one model
includes waiting for a core, so on a 2-core machine the throughput (models per second over the
run) is the figure to compare at 4 workers.

Prints a table and the Ray/Local ratios; writes ``benchmarks/out/ray_overhead.csv``.

``--demo`` (issue #27) measures the demo's workload instead (``retiarii run demo``'s space
and trainer, random search, ``--optimize off`` so that a segment is one trial's epoch): the
same search on LocalExecutor and on RayExecutor, each wrapped in :class:`TimedExecutor`, which
times every segment at the driver. A segment's **overhead** is what the executor adds around the
training: *dispatch* (``submit`` to its ``JobStarted`` received) plus *return* (the worker's end
of its last step, ``TrialResult.time``, to its ``JobFinished`` received: the last epoch's result
and checkpoint coming back). The worker's clock is ``time.monotonic``, the system-wide clock the
driver reads too, so on one machine the two subtract. A trial's overhead is the sum over its
segments. Writes ``benchmarks/out/ray_overhead_demo.csv``.

Example::

    .venv/bin/python benchmarks/ray_overhead.py                   # 200 models per run
    .venv/bin/python benchmarks/ray_overhead.py --models 50 --workers 2
    .venv/bin/python benchmarks/ray_overhead.py --demo --models 12    # the demo, 12 models
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import engine as bench  # noqa: E402  benchmarks/engine.py: the space, trainer and timing
import retiarii as rt  # noqa: E402
from retiarii.engine.jobs.job import (Executor, JobFailed, JobFinished,  # noqa: E402
                                            JobStarted, TrialResult)
from retiarii.engine.executors.local import LocalExecutor  # noqa: E402

OUT = bench.OUT


def run_one(kind: str, workers: int, args) -> dict:
    """One experiment of ``--warmup + --models`` models; its figures."""
    folder = os.path.join(OUT, "ray-overhead-db")
    shutil.rmtree(folder, ignore_errors=True)
    if kind == "local":
        executor = LocalExecutor(workers, devices=[], threads_per_worker=1)
    else:
        from retiarii.engine.executors.ray import RayExecutor

        executor = RayExecutor(workers, num_cpus=1, threads_per_worker=1)
    try:
        executor.wait_ready()  # starting workers (importing torch) is not per-model overhead
        buckets = bench.Buckets()
        exp = bench.TimedExperiment(bench.SPACE, rt.strategies.Random(seed=args.seed),
                                    bench.TRAINER, store=os.path.join(folder, f"{kind}.db"),
                                    executor=executor, buckets=buckets, trainer_metric="trainer_s")
        start = time.perf_counter()
        exp.run(max_models=args.warmup + args.models)
        wall = time.perf_counter() - start
        exp.store.close()
    finally:
        executor.close()
    failed = sum(not r["ok"] for r in exp.rows)
    if failed:
        raise RuntimeError(f"{failed} models failed in the {kind} run with {workers} workers")
    shutil.rmtree(folder, ignore_errors=True)
    timed = exp.rows[args.warmup:]
    overhead = bench.stats([r["latency"] - r["trainer"] for r in timed])
    return {"executor": kind, "workers": workers, "models": len(timed),
            "overhead_median_ms": overhead["median_ms"], "overhead_p90_ms": overhead["p90_ms"],
            "overhead_mean_ms": overhead["mean_ms"],
            "latency_median_ms": bench.stats([r["latency"] for r in timed])["median_ms"],
            "trainer_median_ms": bench.stats([r["trainer"] for r in timed])["median_ms"],
            "models_per_s": len(exp.rows) / wall}


# ---- the demo's workload (--demo) -------------------------------------------------------------


class TimedExecutor(Executor):
    """Delegates to ``inner`` and times every job at the driver (``time.monotonic``)."""

    def __init__(self, inner: Executor):
        self.inner, self.num_slots = inner, inner.num_slots
        self.jobs: dict[str, dict] = {}  # job id -> {"trials", "submit", "started", "last_step", "end"}

    def submit(self, job) -> None:
        self.jobs[job.job_id] = {"trials": [t.trial_id for t in job.tasks],
                                 "submit": time.monotonic()}
        self.inner.submit(job)

    def next_event(self, timeout=None):
        event = self.inner.next_event(timeout)
        now, row = time.monotonic(), self.jobs.get(getattr(event, "job_id", None))
        if row is not None:
            if isinstance(event, JobStarted):
                row["started"] = now
            elif isinstance(event, TrialResult):
                row["last_step"] = event.time  # the worker's clock when the step ended
            elif isinstance(event, (JobFinished, JobFailed)):
                row["end"], row["ok"] = now, isinstance(event, JobFinished)
        return event

    def cancel(self, job_id: str) -> None:
        self.inner.cancel(job_id)

    def slot_memory(self) -> float:
        return self.inner.slot_memory()

    def close(self) -> None:
        self.inner.close()


def run_demo(kind: str, workers: int, args) -> dict:
    """The demo's search of ``--models`` models on ``kind``; its per-segment and per-trial figures."""
    import retiarii.demo as demo
    from retiarii.engine.trainers.trainer import ClassifierTrainer

    folder = os.path.join(OUT, "ray-overhead-demo-db")
    shutil.rmtree(folder, ignore_errors=True)
    if kind == "local":
        inner = LocalExecutor(workers, devices=[], threads_per_worker=1)
    else:
        from retiarii.engine.executors.ray import RayExecutor

        inner = RayExecutor(workers, num_cpus=1, threads_per_worker=1)
    executor = TimedExecutor(inner)
    try:
        inner.wait_ready()  # starting workers (importing torch) is not per-segment overhead
        exp = rt.Experiment(demo.space, rt.strategies.Random(seed=args.seed),
                            ClassifierTrainer(dataset="digits", epochs=args.epochs),
                            store=os.path.join(folder, f"{kind}.db"), workers=workers,
                            seed=args.seed, executor=executor, optimize=False)
        start = time.perf_counter()
        exp.run(max_models=args.models)
        wall = time.perf_counter() - start
    finally:
        executor.close()
    shutil.rmtree(folder, ignore_errors=True)
    jobs = list(executor.jobs.values())
    if not all(j.get("ok") for j in jobs):
        raise RuntimeError(f"a segment failed in the demo run on {kind}")
    for j in jobs:
        j["dispatch"], j["return"] = j["started"] - j["submit"], j["end"] - j["last_step"]
        j["overhead"] = j["dispatch"] + j["return"]
    trials: dict[str, list[dict]] = {}
    for j in jobs:
        trials.setdefault(j["trials"][0], []).append(j)
    per_trial = [sum(j["overhead"] for j in js) for js in trials.values()]
    latency = [max(j["end"] for j in js) - min(j["submit"] for j in js) for js in trials.values()]
    return {"executor": kind, "workers": workers, "trials": len(trials), "segments": len(jobs),
            "segment_overhead_median_ms": bench.stats([j["overhead"] for j in jobs])["median_ms"],
            "segment_overhead_p90_ms": bench.stats([j["overhead"] for j in jobs])["p90_ms"],
            "dispatch_median_ms": bench.stats([j["dispatch"] for j in jobs])["median_ms"],
            "return_median_ms": bench.stats([j["return"] for j in jobs])["median_ms"],
            "segment_latency_median_ms": bench.stats(
                [j["end"] - j["submit"] for j in jobs])["median_ms"],
            "trial_overhead_median_ms": bench.stats(per_trial)["median_ms"],
            "trial_latency_median_ms": bench.stats(latency)["median_ms"],
            "wall_s": wall}


def main_demo(args) -> None:
    from retiarii.engine.executors.ray import start_local_ray

    import ray

    temp_dir = start_local_ray(num_cpus=max(args.workers))
    rows = []
    try:
        for workers in args.workers:
            for kind in ("local", "ray"):
                rows.append(run_demo(kind, workers, args))
                print(f"{kind:>5} x{workers}: {rows[-1]}", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    print(f"\n{'executor':<8}{'workers':>8}{'segments':>9}{'seg. overhead':>14}{'p90':>8}"
          f"{'dispatch':>9}{'return':>8}{'trial overhead':>15}{'trial latency':>14}{'wall s':>8}")
    for r in rows:
        print(f"{r['executor']:<8}{r['workers']:>8}{r['segments']:>9}"
              f"{r['segment_overhead_median_ms']:>11.1f} ms{r['segment_overhead_p90_ms']:>8.1f}"
              f"{r['dispatch_median_ms']:>9.1f}{r['return_median_ms']:>8.1f}"
              f"{r['trial_overhead_median_ms']:>12.1f} ms{r['trial_latency_median_ms']:>11.0f} ms"
              f"{r['wall_s']:>8.1f}")
    for workers in args.workers:
        local, on_ray = (next(r for r in rows if r["executor"] == k and r["workers"] == workers)
                         for k in ("local", "ray"))
        print(f"{workers} workers: Ray / Local overhead per segment "
              f"{on_ray['segment_overhead_median_ms'] / local['segment_overhead_median_ms']:.2f}x "
              f"({on_ray['segment_overhead_median_ms'] - local['segment_overhead_median_ms']:+.1f}"
              f" ms), per trial {on_ray['trial_overhead_median_ms'] / local['trial_overhead_median_ms']:.2f}x"
              f", search wall time {on_ray['wall_s'] / local['wall_s']:.2f}x")
    path = os.path.join(OUT, "ray_overhead_demo.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
                         for r in rows)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=200,
                        help="timed models per run (--demo: models of the search)")
    parser.add_argument("--warmup", type=int, default=10, help="models left out at the start")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4],
                        help="worker counts (processes / actors) to run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--demo", action="store_true",
                        help="the demo's workload: per-segment and per-trial overhead")
    parser.add_argument("--epochs", type=int, default=2, help="--demo: epochs per model")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.makedirs(OUT, exist_ok=True)
    if args.demo:
        main_demo(args)
        return
    from retiarii.engine.executors.ray import start_local_ray

    import ray

    temp_dir = start_local_ray(num_cpus=max(args.workers))
    rows = []
    try:
        for workers in args.workers:
            for kind in ("local", "ray"):
                row = run_one(kind, workers, args)
                rows.append(row)
                print(f"{kind:>5} x{workers}: overhead median {row['overhead_median_ms']:.2f} ms "
                      f"(p90 {row['overhead_p90_ms']:.2f}), {row['models_per_s']:.1f} models/s",
                      flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)

    print(f"\n{'executor':<8}{'workers':>8}{'overhead median':>17}{'p90':>9}{'mean':>9}"
          f"{'latency':>9}{'trainer':>9}{'models/s':>10}")
    for r in rows:
        print(f"{r['executor']:<8}{r['workers']:>8}{r['overhead_median_ms']:>14.2f} ms"
              f"{r['overhead_p90_ms']:>9.2f}{r['overhead_mean_ms']:>9.2f}"
              f"{r['latency_median_ms']:>9.2f}{r['trainer_median_ms']:>9.2f}"
              f"{r['models_per_s']:>10.1f}")
    print()
    for workers in args.workers:
        local, on_ray = (next(r for r in rows if r["executor"] == k and r["workers"] == workers)
                         for k in ("local", "ray"))
        print(f"{workers} workers: Ray / Local overhead median "
              f"{on_ray['overhead_median_ms'] / local['overhead_median_ms']:.2f}x, throughput "
              f"{on_ray['models_per_s'] / local['models_per_s']:.2f}x")
    path = os.path.join(OUT, "ray_overhead.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
                         for r in rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
