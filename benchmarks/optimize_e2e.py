"""Benchmark: the demo search end to end with cross-model optimization off, on and auto.

Issue #12: "the demo search with optimize on vs off: the same models, same results, and the
wall-clock ratio". The demo space (``retiarii.demo``: a small CNN space on the 8x8 digits, 1008
models) is searched by random search (seeded: every mode proposes the same models in the same
order; evolution would propose other models once several are in flight) with the demo's
trainer on local worker processes, three times in this process:

- ``off``: ``optimize=False``, every model trains alone (the baseline);
- ``on``: ``optimize=True``, up to ``--batch-models`` models per job, never reverted;
- ``auto``: ``optimize="auto"`` (the default): grouped, measured, reverted when slower.

It checks that every model has the same metrics at every epoch in the three runs (exactly on
the CPU; within ``--rtol`` on a GPU), then prints each mode's wall-clock time, the ratio to
``off``, what the plans table says (jobs merged/reverted, measured speed-up), and writes
``benchmarks/out/optimize_e2e[-cuda].csv`` and ``.png``.

Example::

    .venv/bin/python benchmarks/optimize_e2e.py                     # 16 models, 3 epochs
    .venv/bin/python benchmarks/optimize_e2e.py --models 8 --modes off auto
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import retiarii as rt  # noqa: E402 (after the path: runs from a checkout without installing)
from retiarii.engine.plans import PlanTable  # noqa: E402
from retiarii.engine.store import Store  # noqa: E402

MODES = {"off": False, "on": True, "auto": "auto"}


def run_mode(mode: str, args, folder: str) -> dict:
    """One search; its wall time, its models' curves (by sample) and the plans summary."""
    db = os.path.join(folder, f"{mode}.db")
    trainer = rt.Trainer(dataset="digits", epochs=args.epochs, batch_size=args.batch_size)
    devices = [] if args.device == "cpu" else None
    exp = rt.Experiment("retiarii.demo:space", rt.strategies.Random(seed=0), trainer, store=db,
                        workers=args.workers, devices=devices, max_models=args.models, seed=0,
                        optimize=MODES[mode], batch_models=args.batch_models)
    t0 = time.perf_counter()
    exp.run()
    wall = time.perf_counter() - t0
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        curves = {}
        for t in store.trials():
            key = json.dumps(t["spec"]["choices"], sort_keys=True)
            curves[key] = {name: [v for _, v in store.learning_curve(t["id"], name)]
                           for name in ("train_loss", "val_loss", "val_acc")}
        plans = PlanTable(store).summary()
        best = max((c["val_acc"][-1] for c in curves.values() if c["val_acc"]), default=None)
    return {"mode": mode, "wall_s": wall, "models": len(curves), "curves": curves,
            "plans": plans, "best": best}


def differences(a: dict, b: dict) -> dict[str, float]:
    """The largest difference per metric between two runs' curves: relative for the losses,
    absolute for the accuracy (one validation image is 1/360 on digits); inf if the models
    or the number of epochs differ."""
    out = {"train_loss": 0.0, "val_loss": 0.0, "val_acc": 0.0}
    if a.keys() != b.keys():
        return {name: math.inf for name in out}
    for key in a:
        for name in out:
            x, y = a[key][name], b[key][name]
            if len(x) != len(y):
                return {name: math.inf for name in out}
            for u, v in zip(x, y):
                d = abs(u - v) if name == "val_acc" else abs(u - v) / max(abs(v), 1e-12)
                out[name] = max(out[name], d)
    return out


def same_curves(a: dict, b: dict, rtol: float, acc_tol: float) -> bool:
    d = differences(a, b)
    return d["train_loss"] <= rtol and d["val_loss"] <= rtol and d["val_acc"] <= acc_tol


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="the trainer's (default 64)")
    p.add_argument("--batch-models", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    p.add_argument("--device", choices=("cpu", "cuda"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rtol", type=float, default=None,
                   help="relative tolerance of the losses (default: exact on cpu, 1e-3 on cuda, "
                        "whose kernels are not bit-reproducible)")
    p.add_argument("--acc-tol", type=float, default=None,
                   help="absolute tolerance of val_acc (default: exact on cpu, 0.02 on cuda)")
    args = p.parse_args()
    rtol = args.rtol if args.rtol is not None else (0.0 if args.device == "cpu" else 1e-3)
    acc_tol = args.acc_tol if args.acc_tol is not None else (0.0 if args.device == "cpu" else 0.02)
    out = os.path.join(HERE, "out")
    folder = os.path.join(out, "optimize_e2e")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    print(f"demo search: {args.models} models x {args.epochs} epochs, random search, "
          f"{args.workers} workers, device {args.device}, batch_models {args.batch_models}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    runs = [run_mode(mode, args, folder) for mode in args.modes]
    base = next((r for r in runs if r["mode"] == "off"), runs[0])
    rows = []
    print(f"\n{'mode':<6}{'wall s':>9}{'ratio':>8}{'models':>8}  same results  plans")
    for r in runs:
        same = same_curves(r["curves"], base["curves"], rtol, acc_tol)
        diff = differences(r["curves"], base["curves"])
        ratio = base["wall_s"] / r["wall_s"]
        plans = r["plans"]
        text = ", ".join(f"{n} {s}" for s, n in sorted(plans["jobs"].items())) or "-"
        if "speedup" in plans:
            text += f"; measured {plans['speedup']['median']}x median"
        print(f"{r['mode']:<6}{r['wall_s']:>9.1f}{ratio:>7.2f}x{r['models']:>8}  "
              f"{'yes' if same else 'NO':<12}  {text}")
        rows.append({"mode": r["mode"], "device": args.device, "models": r["models"],
                     "epochs": args.epochs, "wall_s": round(r["wall_s"], 3),
                     "ratio_to_off": round(ratio, 3), "same_results": same,
                     "merged_trials": plans.get("merged_trials", 0),
                     "jobs": json.dumps(plans["jobs"]),
                     "measured_speedup": (plans.get("speedup") or {}).get("median"),
                     "best_val_acc": r["best"]})
        rows[-1].update({f"max_diff_{k}": v for k, v in diff.items()})
        if r is not base:
            print(f"  largest difference to off: train_loss {diff['train_loss']:.2e} (relative), "
                  f"val_loss {diff['val_loss']:.2e}, val_acc {diff['val_acc']:.4f} (absolute)")
        if not same:
            print(f"  the {r['mode']} run's metrics differ from the baseline's", file=sys.stderr)
    suffix = "" if args.device == "cpu" else f"-{args.device}"
    with open(os.path.join(out, f"optimize_e2e{suffix}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.bar([r["mode"] for r in rows], [r["wall_s"] for r in rows], color="#4878a8")
        for i, r in enumerate(rows):
            ax.text(i, r["wall_s"], f"{r['ratio_to_off']:.2f}x", ha="center", va="bottom")
        ax.set_ylabel("wall-clock seconds")
        ax.set_title(f"demo search, {args.models} models ({args.device})")
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"optimize_e2e{suffix}.png"), dpi=120)
    except ImportError:
        pass
    if not all(r["same_results"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
