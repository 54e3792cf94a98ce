"""Benchmark: the engine's overhead per model, with a trainer that does almost nothing.

Issue #4 asks for a median engine overhead per model (sample, store, dispatch, result recorded)
of at most 20 ms with a trivial trainer. This script runs a real :class:`retiarii.Experiment`
(random search, FIFO scheduler, the SQLite store on disk, checkpoints written) over a small
space, :data:`SPACE`, with :class:`TinyTrainer` (one epoch of one 8-example batch), and times
every model from the moment the engine asks the strategy for it to the moment its result is
recorded (model status in the store, strategy told, strategy state saved). The **overhead** of
a model is that latency minus the time spent inside the trainer's own code, which the trainer
measures itself (from its ``train_dataloader`` call to the end of its ``validation_step``) and
reports as the metric ``trainer_s``.

Two executors, side by side in one process:

- ``inline``: :class:`InlineExecutor` below, which runs :func:`retiarii.engine.worker_side.worker.run_job`
  in this process when the runner asks for the next event: the engine alone, no IPC;
- ``local``: the real :class:`~retiarii.engine.executors.local.LocalExecutor`, 2 worker
  processes (started and warm before the clock starts).

The inline run is broken down by where the time goes, in exclusive times (nothing counted
twice): ``ask`` (the strategy), ``instantiate`` (the driver's replay and shape check, structural
hash, dedup), ``tell + strategy state_dict``, ``store`` (every
:class:`~retiarii.engine.storage.store.Store` call: journal, model rows, strategy and scheduler state),
``worker`` (``run_job`` outside the trainer's code: rebuilding the model from its sample,
optimizer, RNG streams, the checkpoint) and the rest (trial runner, event handling, experiment
bookkeeping). In the local run two models are in flight at once, so the driver's parts are
given as means per model and the rest (IPC, the workers' engine work, waiting for a core) as
one remainder. The first ``--warmup`` models of each run are left out (imports, first
optimizer). ``--clock cpu`` times the inline run in process CPU time instead of wall time.

Prints a table and writes ``benchmarks/out/engine.csv``. Metric rows written per second are
measured by ``benchmarks/store.py``.

Example::

    .venv/bin/python benchmarks/engine.py                     # 300 models per executor
    .venv/bin/python benchmarks/engine.py --only inline --profile   # cProfile the inline run
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import csv
import functools
import os
import pstats
import shutil
import statistics
import time

import torch
from torch import nn

import retiarii as rt
from retiarii.engine.worker_side import worker
from retiarii.engine.jobs.job import Executor, JobFailed
from retiarii.engine.storage.store import Store
from retiarii.engine.trainers.trainer import Trainer, TrialRun

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
TARGET_MS = 20.0  # issue #4: median engine overhead per model


# ---- the space and the trainer (module level: workers import them from this file) ------------


class Block(nn.Module):
    """One of 3 ops, then one of 3 activations: (B, W) -> (B, W)."""

    def __init__(self, width):
        super().__init__()
        self.op = rt.LayerChoice({
            "linear": rt.nn.Linear(width, width),
            "wide": nn.Sequential(rt.nn.Linear(width, 32), nn.ReLU(), rt.nn.Linear(32, width)),
            "identity": nn.Identity(),
        })
        self.act = rt.LayerChoice({"relu": nn.ReLU(), "tanh": nn.Tanh(), "gelu": nn.GELU()})

    def forward(self, x):
        return self.act(self.op(x))


class TinyMLP(nn.Module):
    """16 features -> width -> 3 blocks -> 4 classes: (B, 16) -> (B, 4)."""

    def __init__(self, width=rt.ValueChoice([8, 16, 24], label="width")):
        super().__init__()
        self.stem = rt.nn.Linear(16, width)
        self.blocks = nn.Sequential(Block(width), Block(width), Block(width))
        self.head = rt.nn.Linear(width, 4)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


# 3 widths x 9^3 block programs = 2187 models: random search rarely repeats within a run.
SPACE = rt.ModelSpace(TinyMLP(), example_input=torch.zeros(2, 16))


class TinyTrainer(Trainer):
    """One epoch of one batch of 8 random examples, validated on the same batch.

    Reports ``val_acc`` and ``trainer_s``: seconds from its ``train_dataloader`` call to the end
    of its ``validation_step``, i.e. the time spent in training and validation proper (forward,
    backward, optimizer step), which the benchmark subtracts from a model's latency (and
    ``trainer_cpu_s``, the same in process CPU time).
    """

    epochs = 1

    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(8, 16, generator=generator)  # (B, 16)
        self.y = torch.randint(0, 4, (8,), generator=generator)  # (B,)
        self._start = self._start_cpu = 0.0

    def train_dataloader(self, hparams, epoch):
        self._start, self._start_cpu = time.perf_counter(), time.process_time()
        return [(self.x, self.y)]

    def val_dataloader(self, hparams):
        return [(self.x, self.y)]

    def training_step(self, model, batch, hparams):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    def validation_step(self, model, batch):
        x, y = batch
        accuracy = (model(x).argmax(dim=1) == y).float().mean()
        return {"val_acc": accuracy, "trainer_s": time.perf_counter() - self._start,
                "trainer_cpu_s": time.process_time() - self._start_cpu}


TRAINER = TinyTrainer()


# ---- an executor that runs jobs in this process --------------------------------------------


class InlineExecutor(Executor):
    """One slot in the driver's own process: a job runs (``worker.run_job``) when the runner
    asks for an event and none is queued, so the runner's whole cycle is measured without
    processes or pipes. ``wrap`` is applied to ``run_job`` (the benchmark times it there)."""

    num_slots = 1

    def __init__(self, wrap=lambda run: run):
        self._jobs: collections.deque = collections.deque()
        self._events: collections.deque = collections.deque()
        self._context = worker.WorkerContext()
        self._run_job = wrap(worker.run_job)

    def submit(self, job):
        self._jobs.append(job)

    def next_event(self, timeout=None):
        if not self._events and self._jobs:
            job = self._jobs.popleft()
            self._run_job(job, self._events.append, worker="inline-0", context=self._context)
        return self._events.popleft() if self._events else None

    def cancel(self, job_id):
        queued = [job for job in self._jobs if job.job_id == job_id]
        ran = [event for event in self._events if event.job_id == job_id]
        if not queued and not ran:
            return  # unknown or ended: no-op
        for job in queued:
            self._jobs.remove(job)
        for event in ran:  # nothing of a cancelled job follows but its JobFailed
            self._events.remove(event)
        self._events.append(JobFailed(job_id, None, "cancelled"))


# ---- timing ------------------------------------------------------------------------------


class Buckets:
    """Exclusive time per named bucket on ``clock``: entering a bucket pauses the enclosing one,
    so nothing is counted twice."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.totals: dict[str, float] = collections.defaultdict(float)
        self._stack: list[list] = []  # [name, time entered or resumed]

    def wrap(self, fn, name):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            now = self.clock()
            if self._stack:
                self.totals[self._stack[-1][0]] += now - self._stack[-1][1]
            self._stack.append([name, now])
            try:
                return fn(*args, **kwargs)
            finally:
                now = self.clock()
                done = self._stack.pop()
                self.totals[done[0]] += now - done[1]
                if self._stack:
                    self._stack[-1][1] = now
        return timed


@contextlib.contextmanager
def timed_store(buckets: Buckets):
    """Every public method of :class:`Store` counts into the ``store`` bucket."""
    names = [n for n, v in vars(Store).items() if callable(v) and not n.startswith("_")]
    saved = {n: getattr(Store, n) for n in names}
    for name, fn in saved.items():
        setattr(Store, name, buckets.wrap(fn, "store"))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(Store, name, fn)


class TimedExperiment(rt.Experiment):
    """An Experiment that notes when each model's life in the engine begins (the runner asks
    for a new trial) and ends (its result recorded), with the buckets at both moments.

    It wraps the two hooks of its proposals (engine/driver/proposals.py) the runner calls,
    because they are exactly those boundaries; it changes nothing they do."""

    def __init__(self, *args, buckets: Buckets, trainer_metric: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.buckets, self.trainer_metric = buckets, trainer_metric
        self.begun: dict[int, tuple[float, dict]] = {}  # model id -> (time, buckets)
        self.rows: list[dict] = []  # one per finished model, in finishing order
        proposals = self.proposals
        next_trial, on_trial_end = proposals.next_trial, proposals.on_trial_end

        def timed_next_trial(*args, **kwargs):
            begin, snapshot = self.buckets.clock(), dict(self.buckets.totals)
            # Its own time (ask, store and strategy state excluded): instantiating the sample
            # (replay, shape check), its structural hash and graph data, the dedup check.
            config = self.buckets.wrap(next_trial, "instantiate")(*args, **kwargs)
            if config is not None:
                self.begun[config["model_id"]] = (begin, snapshot)
            return config

        def timed_on_trial_end(trial, *args, **kwargs):
            on_trial_end(trial, *args, **kwargs)
            end, totals = self.buckets.clock(), dict(self.buckets.totals)
            begin, before = self.begun.pop(trial.config["model_id"])
            result = trial.last_result or {}
            self.rows.append({"latency": end - begin,
                              "trainer": result.get(self.trainer_metric, 0.0),
                              "ok": self.trainer_metric in result, "before": before,
                              "totals": totals})

        proposals.next_trial, proposals.on_trial_end = timed_next_trial, timed_on_trial_end


def run_one(kind: str, args, profile: cProfile.Profile | None = None) -> tuple[list[dict], float]:
    """Run an experiment of ``--warmup + --models`` models; (a row per model, wall seconds)."""
    folder = os.path.join(OUT, "engine-db")
    path = os.path.join(folder, f"{kind}.db")
    shutil.rmtree(folder, ignore_errors=True)
    cpu = kind == "inline" and args.clock == "cpu"  # worker processes' CPU is not ours to read
    buckets = Buckets(time.process_time if cpu else time.perf_counter)
    if kind == "inline":
        executor = InlineExecutor(wrap=lambda run: buckets.wrap(run, "worker"))
    else:
        from retiarii.engine.executors.local import LocalExecutor

        executor = LocalExecutor(args.workers, devices=[])
        executor.wait_ready()  # worker start-up (importing torch) is not per-model overhead
    strategy = rt.strategies.Random(seed=args.seed)
    exp = TimedExperiment(SPACE, strategy, TRAINER, store=path, executor=executor,
                          buckets=buckets, trainer_metric="trainer_cpu_s" if cpu else "trainer_s")
    strategy.ask = buckets.wrap(strategy.ask, "ask")
    strategy.tell = buckets.wrap(strategy.tell, "strategy")
    strategy.state_dict = buckets.wrap(strategy.state_dict, "strategy")
    train_epoch = TrialRun.train_epoch
    if kind == "inline":  # the epoch, trainer included, inside the worker bucket
        TrialRun.train_epoch = buckets.wrap(train_epoch, "train_epoch")
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # import torch._dynamo now
    try:
        with timed_store(buckets):
            if profile is not None:
                profile.enable()
            start = time.perf_counter()
            exp.run(max_models=args.warmup + args.models)
            wall = time.perf_counter() - start
            if profile is not None:
                profile.disable()
    finally:
        TrialRun.train_epoch = train_epoch
        if exp.store is not None:
            exp.store.close()
        executor.close()
    failed = sum(not r["ok"] for r in exp.rows)
    if failed:
        raise RuntimeError(f"{failed} models failed in the {kind} run; see {path}")
    shutil.rmtree(folder, ignore_errors=True)
    return exp.rows, wall


# ---- report -----------------------------------------------------------------------------

DRIVER = {"ask": "ask (strategy)", "instantiate": "instantiate, hash, dedup (driver)",
          "strategy": "tell + strategy state_dict", "store": "store (every Store call)"}


def stats(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values)
    return {"median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))],
            "mean_ms": statistics.fmean(ms)}


def measures(kind: str, rows: list[dict], warmup: int) -> list[tuple[str, dict]]:
    """(name, {median_ms, p90_ms, mean_ms}) of each measure of one run, warm-up left out."""
    timed = rows[warmup:]
    overhead = [r["latency"] - r["trainer"] for r in timed]
    out = [("latency (ask -> result recorded)", stats([r["latency"] for r in timed])),
           ("trainer's own code (subtracted)", stats([r["trainer"] for r in timed])),
           ("OVERHEAD = latency - trainer", stats(overhead))]
    if kind == "inline":
        # One model at a time: what the buckets gained during a model's life is that model's.
        def part(r, name):
            return r["totals"].get(name, 0.0) - r["before"].get(name, 0.0)

        for name, label in DRIVER.items():
            out.append((f"  {label}", stats([part(r, name) for r in timed])))
        # run_job outside the epoch, plus the epoch's own share beyond the trainer's code (RNG
        # swaps, the batch loop): the worker's engine work.
        worker = [part(r, "worker") + part(r, "train_epoch") - r["trainer"] for r in timed]
        out.append(("  worker (rebuild model, optimizer, ckpt)", stats(worker)))
        named = [sum(part(r, n) for n in DRIVER) + w for r, w in zip(timed, worker)]
        out.append(("  runner, events, experiment (the rest)",
                    stats([o - n for o, n in zip(overhead, named)])))
    else:
        # Two models in flight: the driver's buckets are shared out evenly (mean only).
        first, last = rows[warmup - 1]["totals"] if warmup else {}, rows[-1]["totals"]
        driver = 0.0
        for name, label in DRIVER.items():
            mean = (last.get(name, 0.0) - first.get(name, 0.0)) / len(timed)
            driver += mean
            out.append((f"  {label}", {"median_ms": None, "p90_ms": None, "mean_ms": mean * 1e3}))
        out.append(("  rest: IPC, worker's engine work, waiting",
                    {"median_ms": None, "p90_ms": None,
                     "mean_ms": statistics.fmean(overhead) * 1e3 - driver * 1e3}))
    return out


def cell(value: float | None) -> str:
    return f"{value:>8.2f}" if value is not None else f"{'-':>8}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=300, help="timed models per executor")
    parser.add_argument("--warmup", type=int, default=20, help="models left out at the start")
    parser.add_argument("--workers", type=int, default=2, help="LocalExecutor processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: time the inline run in this process's CPU time (what an "
                             "idle machine would show); the local run is always wall clock")
    parser.add_argument("--only", choices=["inline", "local"], help="run one executor only")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the inline run and print the top functions")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each of 2 LocalExecutor workers on 2 cores
    os.makedirs(OUT, exist_ok=True)

    results, table = {}, []
    for kind in ("inline", "local"):
        if args.only and kind != args.only:
            continue
        profile = cProfile.Profile() if args.profile and kind == "inline" else None
        rows, wall = run_one(kind, args, profile)
        results[kind] = measures(kind, rows, args.warmup)
        clock = args.clock if kind == "inline" else "wall"
        overhead = [r["latency"] - r["trainer"] for r in rows[args.warmup:]]
        median = stats(overhead)["median_ms"]
        # The strategy's saved state grows with every model (it is rewritten twice per model),
        # so the overhead drifts up over a run: the median of each quarter shows it.
        quarters = [stats(overhead[i * len(overhead) // 4:(i + 1) * len(overhead) // 4])
                    ["median_ms"] for i in range(4)] if len(overhead) >= 4 else []
        print(f"{kind}: {len(overhead)} models timed ({clock} clock) after {args.warmup} warm-up; "
              f"{len(rows) / wall:.1f} models/s over the run; overhead median {median:.2f} ms "
              f"= {median / TARGET_MS:.2f}x the {TARGET_MS:.0f} ms target "
              f"({'holds' if median <= TARGET_MS else 'missed'}); by quarter of the run: "
              + " / ".join(f"{q:.2f}" for q in quarters) + " ms")
        for name, s in results[kind]:
            table.append({"executor": kind, "clock": clock, "models": len(overhead),
                          "measure": name.strip(),
                          **{k: "" if v is None else round(v, 3) for k, v in s.items()}})
        table.append({"executor": kind, "clock": clock, "models": len(overhead),
                      "measure": "models per second (whole run, wall)",
                      "median_ms": "", "p90_ms": "", "mean_ms": round(len(rows) / wall, 2)})
        table.append({"executor": kind, "clock": clock, "models": len(overhead),
                      "measure": "overhead median / 20 ms target",
                      "median_ms": round(median / TARGET_MS, 3), "p90_ms": "", "mean_ms": ""})
        if profile is not None:
            profile.dump_stats(os.path.join(OUT, "engine.prof"))
            for order in ("cumulative", "tottime"):
                print(f"\ncProfile of the inline run, top 30 by {order}:")
                pstats.Stats(profile).sort_stats(order).print_stats(30)

    names = list(dict.fromkeys(n for kind in results for n, _ in results[kind]))
    print(f"\n{'ms per model':<44}" + "".join(f"{k + ' median':>16}{'p90':>9}{'mean':>9}"
                                             for k in results))
    for name in names:
        line = f"{name:<44}"
        for kind in results:
            s = dict(results[kind]).get(name)
            line += (f"{cell(s['median_ms']):>16}{cell(s['p90_ms']):>9}{cell(s['mean_ms']):>9}"
                     if s else " " * 34)
        print(line)
    path = os.path.join(OUT, "engine.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
