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
  executor and workers started, the first job dispatched and its model built; split at
  ``worker ready`` (the first worker made its trainer from the job's spec: the workers'
  server had imported torch, retiarii and dynamo, and forked it) into waiting for the worker
  and the first job's own start (model built, layouts planned or measured, loader started);
- ``per job``: the gaps between one job's last batch and the next job's first batch
  (result recorded, checkpoint written, strategy asked, next job dispatched, model built);
  with ``workers=1`` and ``optimize=False`` each gap is one job's overhead (median and p90);
- ``tail``: from the last batch to the return of ``run()`` (workers stopped, store closed);
- ``later fixed``: the same process then runs a second search (a new store and executor),
  as a notebook or a script that searches several spaces does: its fixed cost, with the
  workers' server already started (workers are forked from it, nothing imported again).

It also times a fresh interpreter's ``import torch``: a first search's workers must import
torch before their first batch (forking the driver instead is unsafe once torch has run an
OpenMP-parallel operation), so that is the floor of a process's first search.

Targets (issue #26): median per-job overhead <= 50 ms; fixed cost of a search (``to first
batch`` + ``tail``) <= 1 s beyond the driver's own ``import retiarii``.

Prints a table (median over ``--repeats`` processes per configuration) and writes
``benchmarks/out/e2e_overhead.csv``. ``--profile`` runs one more search of the first
configuration under cProfile (the driver from ``Experiment()`` to the end of its first
``run()``, and its first worker from its first job to its last batch) and prints the top of
both.

Example::

    .venv/bin/python benchmarks/e2e_overhead.py                  # 3 repeats, 12 models
    .venv/bin/python benchmarks/e2e_overhead.py --repeats 5 --models 24
    .venv/bin/python benchmarks/e2e_overhead.py --configs apart-w1 --repeats 1 --profile
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

    def __init__(self, log: str, profile: str = ""):
        self.log, self.profile = log, profile
        if os.getpid() != int(os.environ.get("E2E_DRIVER_PID", "0")):  # made in a worker
            with open(log, "a") as f:
                f.write(f"ready {os.getpid()} {time.monotonic()}\n")
            if profile:  # this worker's jobs, dumped after every epoch (it ends with _exit)
                import cProfile

                self._profiler = cProfile.Profile()
                self._profiler.enable()
        generator = torch.Generator().manual_seed(0)
        self.batches = [(torch.randn(32, 16, generator=generator),  # (B, 16)
                         torch.randint(0, 4, (32,), generator=generator)) for _ in range(4)]
        self._start = 0.0

    def to_spec(self) -> dict:
        return {"class": f"{os.path.abspath(__file__)}:TimingTrainer",
                "config": {"log": self.log, "profile": self.profile}}

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
            f.write(f"epoch {os.getpid()} {self._start} {time.monotonic()}\n")
        if getattr(self, "_profiler", None) is not None:
            self._profiler.dump_stats(f"{self.profile}.worker-{os.getpid()}")
            self._profiler.enable()  # dumping disabled it
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
    """Two searches in this fresh process: the first pays what a script's one search pays,
    the second what each later search of a process pays (a notebook, a script that searches
    several spaces, ``nas_rows.py``): the workers' server is already started then."""
    first = one_search(args, "first")
    later = one_search(args, "later")
    first["later"] = {k: later[k] for k in ("experiment_s", "to_first_batch_s",
                                            "worker_ready_s", "tail_s", "run_s")}
    print(json.dumps(first))


def one_search(args, tag: str) -> dict:
    """One search of ``args.child``'s configuration; where its time went (see the module
    docstring)."""
    folder = os.path.join(OUT, f"e2e-overhead-{os.getpid()}-{tag}")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    log = os.path.join(folder, "batches.log")
    workers, optimize = CONFIGS[args.child]
    os.environ["E2E_DRIVER_PID"] = str(os.getpid())  # the trainer logs only in workers
    profile = os.path.join(OUT, "e2e_overhead.prof") if args.profile and tag == "first" else ""
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t_made = time.monotonic()
    exp = rt.Experiment(SPACE, rt.strategies.Random(seed=args.seed),
                        TimingTrainer(log, profile), store=os.path.join(folder, "search.db"),
                        workers=workers, max_models=args.models, seed=args.seed,
                        optimize=optimize)
    t_run = time.monotonic()
    exp.run()
    t_end = time.monotonic()
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(f"{profile}.driver")
    with open(log) as f:
        lines = [line.split() for line in f]
    spans = [(float(a), float(b)) for kind, _, a, b in (x for x in lines if x[0] == "epoch")]
    ready = min(float(x[2]) for x in lines if x[0] == "ready")
    busy = busy_union(spans)
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:])]
    shutil.rmtree(folder, ignore_errors=True)
    return {"import_s": T_IMPORTED - T_START, "experiment_s": t_run - t_made,
            "to_first_batch_s": busy[0][0] - t_run, "worker_ready_s": ready - t_run,
            "tail_s": t_end - busy[-1][1],
            "gaps_s": gaps, "in_batches_s": sum(b - a for a, b in busy),
            "run_s": t_end - t_run, "epochs": len(spans)}


# ---- the orchestrator -------------------------------------------------------------------------


def launch(config: str, args, profile: bool = False) -> dict:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", config,
                           "--models", str(args.models), "--seed", str(args.seed),
                           *(["--profile"] if profile else [])],
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
    parser.add_argument("--profile", action="store_true",
                        help="then one search of the first config under cProfile (driver and "
                             "a worker), its top printed")
    parser.add_argument("--child", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    print(f"{args.models} models per search, {args.repeats} processes per configuration, "
          f"load {load()} before")
    floor = torch_import_s()
    results: dict[str, list[dict]] = {c: [] for c in args.configs}
    for _ in range(args.repeats):  # interleaved: a busy neighbour hits every config alike
        for config in args.configs:
            results[config].append(launch(config, args))
    rows = []
    print(f"{'config':<12}{'import s':>9}{'ready s':>8}{'1st batch s':>12}{'tail s':>8}"
          f"{'fixed s':>8}{'job ms med':>11}{'p90':>7}{'jobs':>6}{'outside s':>10}{'run s':>8}"
          f"{'later fixed s':>14}{'process s':>10}")
    for config, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs)
               for k in ("import_s", "to_first_batch_s", "worker_ready_s", "tail_s", "run_s",
                         "process_s", "in_batches_s", "experiment_s")}
        gaps = [g for r in runs for g in r["gaps_s"]]
        job_ms = statistics.median(gaps) * 1000 if gaps else float("nan")
        p90_ms = percentile(gaps, 0.9) * 1000 if gaps else float("nan")
        fixed = med["to_first_batch_s"] + med["tail_s"] + med["experiment_s"]
        later = statistics.median(fixed_s(r["later"]) for r in runs)
        outside = med["run_s"] - med["in_batches_s"]
        print(f"{config:<12}{med['import_s']:>9.2f}{med['worker_ready_s']:>8.2f}"
              f"{med['to_first_batch_s']:>12.2f}{med['tail_s']:>8.2f}{fixed:>8.2f}"
              f"{job_ms:>11.1f}{p90_ms:>7.1f}{len(gaps) // max(1, len(runs)):>6}"
              f"{outside:>10.2f}{med['run_s']:>8.2f}{later:>14.2f}{med['process_s']:>10.2f}")
        for i, r in enumerate(runs):
            rows.append({"config": config, "repeat": i, "models": args.models,
                         "import_s": r["import_s"], "experiment_s": r["experiment_s"],
                         "worker_ready_s": r["worker_ready_s"],
                         "to_first_batch_s": r["to_first_batch_s"], "tail_s": r["tail_s"],
                         "median_job_ms": statistics.median(r["gaps_s"]) * 1000
                         if r["gaps_s"] else "",
                         "p90_job_ms": percentile(r["gaps_s"], 0.9) * 1000 if r["gaps_s"] else "",
                         "jobs_gaps": len(r["gaps_s"]),
                         "in_batches_s": r["in_batches_s"], "run_s": r["run_s"],
                         "later_fixed_s": fixed_s(r["later"]),
                         "later_worker_ready_s": r["later"]["worker_ready_s"],
                         "torch_import_s": floor, "process_s": r["process_s"]})
    print(f"targets: median per-job <= {TARGET_JOB_MS:.0f} ms, fixed (Experiment() + to first "
          f"batch + tail) <= {TARGET_FIXED_S:.0f} s; load {load()} after")
    print(f"a fresh interpreter's `import torch` (the floor of a first search's workers, which "
          f"must import it before their first batch): {floor:.2f} s (median of 3)")
    print("wrote", write_csv(rows, "e2e_overhead"))
    if args.profile:
        show_profile(args.configs[0], args)


def fixed_s(r: dict) -> float:
    """A search's fixed cost: ``Experiment()``, ``run()`` to its first batch, and its tail."""
    return r["experiment_s"] + r["to_first_batch_s"] + r["tail_s"]


def torch_import_s(repeats: int = 3) -> float:
    """Median wall seconds of ``import torch`` in a fresh interpreter."""
    times = []
    for _ in range(repeats):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        times.append(time.monotonic() - t0)
    return statistics.median(times)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank: one of the values)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def show_profile(config: str, args) -> None:
    """One more search of ``config`` under cProfile; the top of the driver's and a worker's."""
    import glob
    import pstats

    base = os.path.join(OUT, "e2e_overhead.prof")
    for old in glob.glob(base + ".*"):
        os.remove(old)
    launch(config, args, profile=True)
    for path in [base + ".driver", *sorted(glob.glob(base + ".worker-*"))[:1]]:
        print(f"---- {os.path.basename(path)} (cumulative, top 25) ----")
        pstats.Stats(path).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
