"""Benchmark: what a busy neighbour does to a layout's measurement (issue #26 item 5).

A worker judges a grouped segment by comparing its step times with each model's step alone,
measured at another moment. This times the same training steps (16 small MLPs: alone, then
merged by CSE as a grouped job's step does) on one torch thread, quiet and then with
``--busy`` processes spinning on the machine's cores (a synthetic load: the other worker, a
user's job), with the two clocks a worker could use: wall time (``time.perf_counter``) and
the process's CPU time (``time.process_time``, what ``engine/clock.py`` uses on a one-thread
CPU worker). It prints, for each clock, the loaded/quiet ratio of the step times and the
speed-up "merged over alone" it would conclude when the alone steps were timed quiet and the
merged ones under load (the case that reverted layouts), and writes
``benchmarks/out/noisy_neighbour.csv``.

Example::

    .venv/bin/python benchmarks/noisy_neighbour.py --busy 2
"""
from __future__ import annotations

import argparse
import csv
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _spin(stop):
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def _models(n):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 10)) for _ in range(n)]


def _steps(models, x, y, merged: bool, clock, repeats: int) -> float:
    """Median seconds of one step of every model (alone: one after the other)."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    times = []
    for _ in range(repeats):
        t0 = clock()
        if merged:  # one backward over the summed losses, as a grouped job steps
            sum(F.cross_entropy(m(x), y) for m in models).backward()
            for o in opts:
                o.step()
                o.zero_grad()
        else:
            for m, o in zip(models, opts):
                F.cross_entropy(m(x), y).backward()
                o.step()
                o.zero_grad()
        times.append(clock() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="spinning processes")
    p.add_argument("--models", type=int, default=16)
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--out", default=os.path.join(HERE, "out"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    models = _models(args.models)
    x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))
    clocks = {"wall": time.perf_counter, "cpu": time.process_time}
    rows = []
    quiet = {c: {m: _steps(models, x, y, m == "merged", fn, args.repeats) for m in ("alone", "merged")}
             for c, fn in clocks.items()}
    stop = mp.Event()
    procs = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for proc in procs:
        proc.start()
    try:
        time.sleep(0.5)
        loaded = {c: {m: _steps(models, x, y, m == "merged", fn, args.repeats)
                      for m in ("alone", "merged")} for c, fn in clocks.items()}
    finally:
        stop.set()
        for proc in procs:
            proc.join(5)
    print(f"{args.models} MLPs 64-64-64-10, batch 128, one thread; {args.busy} busy processes "
          f"on {os.cpu_count()} cores")
    for c in clocks:
        honest = quiet[c]["alone"] / quiet[c]["merged"]
        skewed = quiet[c]["alone"] / loaded[c]["merged"]
        inflation = loaded[c]["merged"] / quiet[c]["merged"]
        print(f"  {c:4s}: merged step quiet {quiet[c]['merged'] * 1e3:7.2f} ms, loaded "
              f"{loaded[c]['merged'] * 1e3:7.2f} ms ({inflation:.2f}x); merged over alone "
              f"{honest:.2f}x quiet, {skewed:.2f}x with the merged steps timed under load")
        rows.append({"clock": c, "busy": args.busy, "quiet_alone_s": quiet[c]["alone"],
                     "quiet_merged_s": quiet[c]["merged"], "loaded_alone_s": loaded[c]["alone"],
                     "loaded_merged_s": loaded[c]["merged"], "inflation": inflation,
                     "speedup_quiet": honest, "speedup_skewed": skewed})
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "noisy_neighbour.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
