"""Benchmark: the "all-stars" run: every implemented NAS solution searched on digits.

For each implemented row of :mod:`retiarii.nas` (``retiarii nas list``) it runs the row's
strategy over its small preset through :class:`retiarii.Experiment` with a handful of models
and one epoch each, in a fresh store under a temporary folder (nothing is written in the
repository unless ``--out`` says where), and prints a table: models built (proposed and
instantiated, including failed ones), trained (TERMINATED trials), best validation accuracy,
seconds. Rows not implemented yet are listed with their status.

Example::

    .venv/bin/python benchmarks/nas_allstar.py --models 4 --workers 2
    .venv/bin/python benchmarks/nas_allstar.py --rows nasbench201,darts --csv out.csv
"""
from __future__ import annotations

import argparse
import csv
import os
import tempfile
import time

from retiarii import nas


def run_row(name: str, models: int, epochs: int, workers: int, folder: str,
            seed: int) -> dict:
    """One row's search; its figures as a dict."""
    started = time.perf_counter()
    exp = nas.experiment(name, "small", max_models=models, epochs=epochs, workers=workers,
                         store=os.path.join(folder, f"{name}.db"), seed=seed)
    summary = exp.run()
    best = summary["best"][0]["value"] if summary["best"] else None
    return {"name": name, "built": summary["models"],
            "trained": summary["trials"].get("TERMINATED", 0),
            "best_val_acc": best, "seconds": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=int, default=4, help="models per row (default 4)")
    p.add_argument("--epochs", type=int, default=1, help="epochs per model (default 1)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", default=None, help="comma-separated row names (default: all)")
    p.add_argument("--out", default=None, help="folder for the stores (default: a temp dir)")
    p.add_argument("--csv", default=None, help="also write the table to this CSV file")
    args = p.parse_args(argv)

    names = args.rows.split(",") if args.rows else [row.name for row in nas.implemented()]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.out or tmp
        os.makedirs(folder, exist_ok=True)
        for name in names:
            results.append(run_row(name, args.models, args.epochs, args.workers, folder,
                                   args.seed))
            r = results[-1]
            print(f"{name}: {r['trained']}/{r['built']} trained, best "
                  f"{r['best_val_acc']}, {r['seconds']:.1f}s", flush=True)

    header = f"{'#':>2}  {'row':<22} {'built':>5} {'trained':>7} {'best val_acc':>12} {'s':>7}"
    print("\n" + header + "\n" + "-" * len(header))
    by_name = {r["name"]: r for r in results}
    for row in nas.ROWS:
        r = by_name.get(row.name)
        if r is None:
            if not args.rows:
                print(f"{row.number:>2}  {row.name:<22} {'(' + row.status + ')':>34}")
            continue
        best = "-" if r["best_val_acc"] is None else f"{r['best_val_acc']:.4f}"
        print(f"{row.number:>2}  {row.name:<22} {r['built']:>5} {r['trained']:>7} {best:>12} "
              f"{r['seconds']:>7.1f}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(results[0]))
            writer.writeheader()
            writer.writerows(results)
    return results


if __name__ == "__main__":
    main()
