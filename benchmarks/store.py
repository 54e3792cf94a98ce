"""Metric rows per second into the store: a naive writer vs ``Store.result``.

The issue asks for >= 5000 metric rows/s. Run side by side in one process, on files in
benchmarks/out/ (a real disk, not memory):

- naive:       one sqlite-utils ``insert`` per row, each its own transaction, default journal
               (rollback journal, synchronous=FULL): what a first implementation does;
- naive + WAL: the same per-row transactions in WAL mode with synchronous=NORMAL (our pragmas),
               to separate the effect of batching from the effect of the journal mode;
- insert_all:  our pragmas, rows batched through sqlite-utils ``insert_all``;
- Store:       ``Store.result`` alone (4 metrics per result, buffered, written with
               ``executemany`` in one transaction per batch), including the final flush;
- Store, runner pattern: what the TrialRunner does per step: ``result`` then ``scheduler_state``
               (a ~2 KB state), which flushes the buffer first: one small transaction per step.

Also journaled state transitions per second (each one transaction: an event row + the trial row).

    .venv/bin/python benchmarks/store.py [--rows 200000] [--naive-rows 2000]
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import sys
import time
from types import SimpleNamespace

import sqlite_utils

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from retiarii.engine.storage.store import Store  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
METRICS = ("train_loss", "val_loss", "val_acc", "lr")


def rows(n: int):
    """``n`` metric rows: trials of 100 steps, 4 metrics per step."""
    for i in range(n):
        step, name = divmod(i, len(METRICS))
        trial, step = divmod(step, 100)
        yield {"trial_id": f"t{trial}", "step": step + 1, "name": METRICS[name],
               "value": 1.0 / (i + 1), "time": float(i)}


def fresh(name: str) -> str:
    path = os.path.join(OUT, "bench-db", name)
    for suffix in ("", "-wal", "-shm", "-journal"):
        if os.path.exists(path + suffix):
            os.remove(path + suffix)
    return path


def metrics_table(name: str, wal: bool):
    """A fresh database with the store's metrics table; WAL + synchronous=NORMAL as the Store."""
    db = sqlite_utils.Database(fresh(name))
    if wal:
        db.enable_wal()
        db.execute("PRAGMA synchronous=NORMAL")
    table = db["metrics"]
    table.create({"trial_id": str, "step": int, "name": str, "value": float, "time": float},
                 pk=("trial_id", "name", "step"))
    return db, table


def naive(n: int, wal: bool) -> float:
    db, table = metrics_table(f"naive{'-wal' if wal else ''}.db", wal)
    start = time.perf_counter()
    for row in rows(n):
        table.insert(row)  # its own transaction and commit
    elapsed = time.perf_counter() - start
    db.close()
    return elapsed


def insert_all(n: int) -> float:
    db, table = metrics_table("insert-all.db", wal=True)
    start = time.perf_counter()
    with db.atomic():
        table.insert_all(rows(n), batch_size=2000)
    elapsed = time.perf_counter() - start
    db.close()
    return elapsed


def ours(n: int) -> float:
    store = Store(fresh("store.db"))
    calls = [(r["trial_id"], r["step"]) for r in rows(n) if r["name"] == METRICS[0]]
    for trial_id in dict.fromkeys(t for t, _ in calls):
        store.trial_added(SimpleNamespace(trial_id=trial_id, config={}, parent=None,
                                          state="RUNNING"))
    start = time.perf_counter()
    for i, (trial_id, step) in enumerate(calls):
        store.result(trial_id, step, {"train_loss": 1.0 / (i + 1), "val_loss": 0.5,
                                      "val_acc": 0.9, "lr": 1e-3}, time=float(i))
    store.close()  # the last flush counts
    elapsed = time.perf_counter() - start
    check = sqlite_utils.Database(store.path)
    assert check["metrics"].count == len(calls) * len(METRICS)
    check.close()
    return elapsed


def runner_pattern(n: int) -> float:
    store = Store(fresh("runner.db"))
    for t in range(n // (len(METRICS) * 100) + 1):
        store.trial_added(SimpleNamespace(trial_id=f"t{t}", config={}, parent=None,
                                          state="RUNNING"))
    state = {"rungs": [[f"t{i}", 0.5 + i / 1000] for i in range(60)], "fed": {}}  # ~2 KB
    start = time.perf_counter()
    for i in range(n // len(METRICS)):
        trial, step = divmod(i, 100)
        store.result(f"t{trial}", step + 1, {"train_loss": 1.0 / (i + 1), "val_loss": 0.5,
                                             "val_acc": 0.9, "lr": 1e-3}, time=float(i))
        store.scheduler_state(state)
    store.close()
    return time.perf_counter() - start


def transitions(n: int) -> float:
    store = Store(fresh("journal.db"))
    for i in range(n):
        store.trial_added(SimpleNamespace(trial_id=f"t{i}", config={}, parent=None,
                                          state="PENDING"))
    start = time.perf_counter()
    for i in range(n):
        store.transition(f"t{i}", "PENDING", "RUNNING", "scheduled", worker="local-0")
    elapsed = time.perf_counter() - start
    store.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--naive-rows", type=int, default=2_000)
    parser.add_argument("--transitions", type=int, default=2_000)
    args = parser.parse_args()
    os.makedirs(os.path.join(OUT, "bench-db"), exist_ok=True)

    results = [
        ("naive: insert per row, default journal", "metric rows", args.naive_rows,
         naive(args.naive_rows, wal=False)),
        ("naive + WAL: insert per row", "metric rows", args.naive_rows,
         naive(args.naive_rows, wal=True)),
        ("sqlite-utils insert_all, batched, WAL", "metric rows", args.rows, insert_all(args.rows)),
        ("Store.result (ours)", "metric rows", args.rows, ours(args.rows)),
        ("Store, runner pattern (ours)", "metric rows", args.rows // 4,
         runner_pattern(args.rows // 4)),
        ("Store.transition (ours)", "transitions", args.transitions, transitions(args.transitions)),
    ]
    baseline = results[0][2] / results[0][3]
    print(f"{'method':<42} {'unit':<12} {'n':>8} {'seconds':>8} {'per s':>10} {'x naive':>8}")
    table = []
    for method, unit, n, seconds in results:
        rate = n / seconds
        ratio = rate / baseline if unit == "metric rows" else float("nan")
        print(f"{method:<42} {unit:<12} {n:>8} {seconds:>8.3f} {rate:>10.0f} {ratio:>8.1f}")
        table.append({"method": method, "unit": unit, "n": n, "seconds": round(seconds, 4),
                      "per_second": round(rate), "x_naive": round(ratio, 1)})
    with open(os.path.join(OUT, "store.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    shutil.rmtree(os.path.join(OUT, "bench-db"))
    print(f"wrote {os.path.join(OUT, 'store.csv')}")


if __name__ == "__main__":
    main()
