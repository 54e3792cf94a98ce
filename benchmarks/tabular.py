"""Our own tabular benchmark: a NAS-Bench-201-like space on digits, trained in full, replayed.

**make** trains every model of :data:`SPACE` with the engine itself and writes the table that
ships with the project (``benchmarks/data/nb201_digits.csv``). The space is NAS-Bench-201's
cell on the ``small`` network for 8x8 digits, narrowed so the whole of it trains in under an
hour on 2 cores (``model_spaces.nasbench201.TABLE_OPS``): the input -> output edge is an identity
shortcut and the five other edges each pick one of none, skip_connect, nor_conv_1x1,
nor_conv_3x3, so 4 ** 5 = 1,024 cells. The 15,625 of the full space would take about 12 hours
here. Every model gets the same trainer (:data:`TRAINER`: Adam, lr 1e-3, batch 64, 3 epochs, the
fixed 80/20 split); model ``i`` of the grid order gets seed ``i`` for its weights. The run is an
``rt.Experiment`` (GridSearch, LocalExecutor with 2 workers, ``optimize=True``) whose store
lives in ``runs/tabular/``: run ``make`` again after an interruption and it resumes.

**compare** replays the table: each strategy's experiment runs on a
:class:`~retiarii.engine.executors.simulated.SimulatedExecutor` whose ``table=`` is the table's
per-epoch metrics, keyed by the architecture string. A strategy searches :data:`SPACE` itself, so
every model it can propose is in the table. For every strategy and seed we record the true
(table) final val_acc of the best model found after each model evaluated.

    .venv/bin/python benchmarks/tabular.py make        # ~40 min on 2 busy cores; resumable
    .venv/bin/python benchmarks/tabular.py compare [--budget 100] [--seeds 20]

compare writes benchmarks/out/tabular.csv (strategy, seed, models, best), tabular_summary.csv
and tabular.png.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT]

import torch  # noqa: E402

import retiarii as rt  # noqa: E402
from model_spaces.nasbench201 import TABLE_OPS, arch_string, full_sample, small  # noqa: E402
from retiarii.engine.trainer import ClassifierTrainer  # noqa: E402

SPACE = small(ops=TABLE_OPS)
EPOCHS = 3
TRAINER = ClassifierTrainer(dataset="digits", epochs=EPOCHS)  # every other setting: the default
TABLE = os.path.join(HERE, "data", "nb201_digits.csv")
STORE = os.path.join(ROOT, "runs", "tabular", "nb201_digits.db")
METRICS = ("val_acc", "val_loss", "train_loss")
EDGES = ("edge_01", "edge_02", "edge_12", "edge_03", "edge_13", "edge_23")


# ---- make -----------------------------------------------------------------------------------


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _experiment(workers: int) -> rt.Experiment:
    def progress(summary: dict) -> None:
        done = summary["trials"].get("TERMINATED", 0) + summary["trials"].get("ERRORED", 0)
        if done % 32 == 0:
            print(f"{time.strftime('%H:%M:%S')} {done}/{SPACE.size()} trained", flush=True)

    # seed=0: the grid's i-th model trains with seed i; the same everywhere a run resumes.
    # optimize=True: groups of 8 models train as one job (about 2x faster here) and, unlike
    # "auto", are not split up by a speed measurement that a busy machine makes noisy; the
    # metrics are the same either way (bit for bit on CPU).
    return rt.Experiment(SPACE, rt.strategies.GridSearch(), TRAINER, store=STORE,
                         workers=workers, devices=[], seed=0, optimize=True,
                         progress=progress)


def make(workers: int = 2, max_models: int | None = None) -> None:
    """Train every model of SPACE (resuming the store when it exists), then write the table;
    ``max_models`` stops early (a smoke test: the table says it is incomplete)."""
    commit, dirty = _git("rev-parse", "HEAD"), bool(_git("status", "--porcelain"))
    print(f"make: {SPACE.size()} models, {EPOCHS} epochs, {workers} workers, commit {commit}"
          f"{' (uncommitted changes)' if dirty else ''}; store {STORE}", flush=True)
    started = time.time()
    exp = _experiment(workers)
    if os.path.exists(STORE):
        exp.resume(max_models=max_models)
    else:
        exp.run(max_models=max_models)
    print(f"make: trained in {time.time() - started:.0f} s this run", flush=True)
    export(commit, dirty)


def _rows_from_store() -> tuple[list[dict], dict]:
    """The table's rows (grid order) and facts about the run, read back from the store."""
    from retiarii.engine.store import Store

    with Store(STORE) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        experiment = store.get_experiment()
        models = {m["id"]: m for m in store.models()}
        curves = {name: store.learning_curves(name) for name in METRICS}
        trials = store.trials()
        jobs = {}  # trial id -> how many trials its (last) job trained together
        for plan in _plans(store):
            for trial_id in plan["trials"]:
                jobs[trial_id] = len(plan["trials"])
    rows = []
    for trial in trials:
        model = models[trial["model_id"]]
        if trial["state"] != "TERMINATED" or model["status"] != "trained":
            continue
        per_epoch = {name: [v for _, v in curves[name].get(trial["id"], [])] for name in METRICS}
        if any(len(v) != EPOCHS for v in per_epoch.values()):
            continue
        sample = full_sample(model["sample"], TABLE_OPS)
        net = SPACE.build(model["sample"])
        row = {"arch": arch_string(sample), **sample,
               "params": sum(p.numel() for p in net.parameters()),
               "seed": trial["spec"].get("seed"),
               "job_seconds": round(trial["ended"] - trial["started"], 3),
               "job_models": jobs.get(trial["id"], 1)}
        for name in METRICS:
            for epoch, value in enumerate(per_epoch[name], 1):
                row[f"{name}_{epoch}"] = round(value, 6)
        rows.append(row)
    spans = [(t["started"], t["ended"]) for t in trials if t["started"] and t["ended"]]
    facts = {"created": experiment["created"], "trials": len(trials),
             "span_s": max(e for _, e in spans) - min(s for s, _ in spans) if spans else 0.0}
    return rows, facts


def _plans(store) -> list[dict]:
    from retiarii.engine.plans import PlanTable

    return [p for p in PlanTable(store).rows() if p.get("status") not in ("reverted", "failed")]


def export(commit: str | None = None, dirty: bool = False) -> None:
    """Write TABLE from the store: '#' lines say how it was made, then one row per model."""
    rows, facts = _rows_from_store()
    complete = len(rows) == SPACE.size()
    when = datetime.datetime.fromtimestamp(facts["created"], datetime.timezone.utc)
    header = [
        "Tabular benchmark: NAS-Bench-201-like cells on digits (benchmarks/tabular.py).",
        f"models: {len(rows)} of the {SPACE.size()} of model_spaces.nasbench201.small("
        f"ops=TABLE_OPS){'' if complete else ' (INCOMPLETE: run make again to resume)'}",
        f"command: python benchmarks/tabular.py make; commit {commit or _git('rev-parse', 'HEAD')}"
        f"{' with uncommitted changes' if dirty else ''}",
        f"started: {when:%Y-%m-%d %H:%M} UTC; trials {facts['trials']}, first start to last end "
        f"{facts['span_s'] / 60:.1f} min",
        f"machine: {platform.node()}, {os.cpu_count()} cores ({platform.processor() or '?'}), "
        f"torch {torch.__version__}, python {platform.python_version()}",
        f"trainer: ClassifierTrainer(dataset='digits', epochs={EPOCHS}) defaults: Adam lr 1e-3, "
        f"batch 64, val_fraction 0.2, split_seed 0, data seed 0; model seed = grid index",
        "engine: rt.Experiment(GridSearch, LocalExecutor 2 workers, optimize=True); "
        "job_seconds: wall time of the job that trained the model (job_models models at once)",
    ]
    columns = ["arch", *EDGES, "params", "seed", "job_seconds", "job_models",
               *[f"{name}_{e}" for name in METRICS for e in range(1, EPOCHS + 1)]]
    os.makedirs(os.path.dirname(TABLE), exist_ok=True)
    with open(TABLE, "w", newline="") as f:
        f.writelines(f"# {line}\n" for line in header)
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(sorted(rows, key=lambda r: r["seed"]))
    print(f"wrote {TABLE}: {len(rows)} models", flush=True)


# ---- the table ------------------------------------------------------------------------------


def load_table(path: str = TABLE) -> tuple[list[dict], list[str]]:
    """``(rows, header lines)``: rows with numbers parsed; header: the '#' lines, unprefixed."""
    header, lines = [], []
    with open(path, newline="") as f:
        for line in f:
            if line.startswith("#"):
                header.append(line[1:].strip())
            else:
                lines.append(line)
    rows = []
    for row in csv.DictReader(lines):
        rows.append({k: v if k == "arch" or k in EDGES else
                     (int(v) if k in ("params", "seed", "job_models") else float(v))
                     for k, v in row.items()})
    return rows, header


def curves_by_arch(rows: list[dict]) -> dict[str, list[dict]]:
    """``{arch: [metrics of epoch 1, 2, ...]}``: what SimulatedExecutor(table=) replays."""
    return {r["arch"]: [{name: r[f"{name}_{e}"] for name in METRICS}
                        for e in range(1, EPOCHS + 1)] for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("make", help="train the table's models (resumes) and write the table")
    p.add_argument("--workers", type=int, default=2)
    sub.add_parser("export", help="write the table from the store as it stands")
    p = sub.add_parser("compare", help="every strategy over the table, many seeds")
    p.add_argument("--budget", type=int, default=100)
    p.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args()
    if args.command == "make":
        make(args.workers)
    elif args.command == "export":
        export()
    else:
        raise SystemExit("compare: not written yet")


if __name__ == "__main__":
    main()
