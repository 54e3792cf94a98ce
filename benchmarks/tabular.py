"""Our own tabular benchmark: a NAS-Bench-201-like space on digits, trained in full, replayed.

**make** trains every model of :data:`SPACE` with the engine itself and writes the table that
ships with the project (``benchmarks/data/nb201_digits.csv``). The space is NAS-Bench-201's
cell on the ``small`` network for 8x8 digits, narrowed so the whole of it trains in under an
hour on 2 cores (``model_spaces.nasbench201.TABLE_OPS``): the input -> output edge is an identity
shortcut and the five other edges each pick one of none, skip_connect, nor_conv_1x1,
nor_conv_3x3, so 4 ** 5 = 1,024 cells; the 15,625 of the full space would take 7-15 hours
here. Every model gets the same trainer (:data:`TRAINER`: Adam, lr 1e-3, batch 64, 3 epochs, the
fixed 80/20 split); model ``i`` of the grid order gets seed ``i`` for its weights. The run is an
``rt.Experiment`` (GridSearch, LocalExecutor with 2 workers, ``optimize=True``) whose store
lives in ``runs/tabular/``: run ``make`` again after an interruption and it resumes.

**compare** replays the table: every strategy searches the same 1,024 models (so everything it
proposes is in the table) and is told each model's final val_acc from the table, over 20 seeds;
we record the table accuracy of the best model found after each model evaluated. By default a
search is the plain ask/tell loop over :class:`ChoiceSpace` (SPACE's choices without building
networks: seconds a strategy, minutes for the GBT surrogates); ``--engine`` runs each search
through ``rt.Experiment`` on SPACE with a
:class:`~retiarii.engine.executors.simulated.SimulatedExecutor` whose ``table=`` holds the
table's per-epoch metrics (one simulated worker). The two give the same curves
(tests/test_tabular.py checks it); the engine adds a few tens of ms per model.

    .venv/bin/python benchmarks/tabular.py make        # ~40 min on 2 busy cores; resumable
    .venv/bin/python benchmarks/tabular.py compare [--budget 100] [--seeds 20] [--engine]

compare writes benchmarks/out/tabular.csv (strategy, seed, models, best), tabular_summary.csv
and tabular.png.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT]

import torch  # noqa: E402

import retiarii as rt  # noqa: E402
from model_spaces.nasbench201 import (  # noqa: E402
    EDGE_LABELS, TABLE_OPS, arch_string, full_sample, small,
)
from retiarii.engine.executors.simulated import SimulatedExecutor  # noqa: E402
from retiarii.engine.trainers.trainer import ClassifierTrainer  # noqa: E402
from retiarii.strategies import (  # noqa: E402
    TPE, PolicyBasedRL, Predictor, Progressive, Random, RegularizedEvolution,
)

SPACE = small(ops=TABLE_OPS)
EPOCHS = 3
TRAINER = ClassifierTrainer(dataset="digits", epochs=EPOCHS)  # every other setting: the default
TABLE = os.path.join(HERE, "data", "nb201_digits.csv")
STORE = os.path.join(ROOT, "runs", "tabular", "nb201_digits.db")
METRICS = ("val_acc", "val_loss", "train_loss")
EDGES = EDGE_LABELS


# ---- make -----------------------------------------------------------------------------------


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _experiment(workers: int, origin: dict) -> rt.Experiment:
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
                         progress=progress, origin=origin)


def make(workers: int = 2, max_models: int | None = None) -> None:
    """Train every model of SPACE (resuming the store when it exists), then write the table;
    ``max_models`` stops early (a smoke test: the table says it is incomplete)."""
    commit, dirty = _git("rev-parse", "HEAD"), bool(_git("status", "--porcelain"))
    print(f"make: {SPACE.size()} models, {EPOCHS} epochs, {workers} workers, commit {commit}"
          f"{' (uncommitted changes)' if dirty else ''}; store {STORE}", flush=True)
    started = time.time()
    # The store keeps the origin of the run that created it: the table names that commit.
    exp = _experiment(workers, {"command": "python benchmarks/tabular.py make",
                                "commit": commit, "dirty": dirty})
    resumed = os.path.exists(STORE)
    if resumed:
        exp.resume(max_models=max_models)
    else:
        exp.run(max_models=max_models)
    print(f"make: trained in {time.time() - started:.0f} s this run", flush=True)
    export(resumed_at=commit if resumed else None)


def _rows_from_store() -> tuple[list[dict], dict]:
    """The table's rows (grid order) and facts about the run, read back from the store."""
    from retiarii.engine.storage.store import Store

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
             "origin": experiment["config"].get("origin") or {},
             "span_s": max(e for _, e in spans) - min(s for s, _ in spans) if spans else 0.0}
    return rows, facts


def _plans(store) -> list[dict]:
    from retiarii.engine.storage.plans_table import PlanTable

    return [p for p in PlanTable(store).rows() if p.get("status") not in ("reverted", "failed")]


def export(resumed_at: str | None = None) -> None:
    """Write TABLE from the store: '#' lines say how it was made (the commit of the run that
    created the store, and ``resumed_at`` when a later one finished it), then one row per
    model."""
    rows, facts = _rows_from_store()
    origin = facts["origin"]
    commit = origin.get("commit", "unknown (not recorded in the store)")
    if resumed_at is not None and resumed_at != commit:
        commit += f", resumed at commit {resumed_at}"
    complete = len(rows) == SPACE.size()
    when = datetime.datetime.fromtimestamp(facts["created"], datetime.timezone.utc)
    header = [
        "Tabular benchmark: NAS-Bench-201-like cells on digits (benchmarks/tabular.py).",
        f"models: {len(rows)} of the {SPACE.size()} of model_spaces.nasbench201.small("
        f"ops=TABLE_OPS){'' if complete else ' (INCOMPLETE: run make again to resume)'}",
        f"command: python benchmarks/tabular.py make; commit {commit}"
        f"{' with uncommitted changes' if origin.get('dirty') else ''}",
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


# ---- compare --------------------------------------------------------------------------------


class ChoiceSpace:
    """SPACE's choices without its networks: the same labels, candidates and order, so a
    strategy proposes exactly what it would propose on SPACE, with no model built per draw
    (SPACE builds one in ~40 ms; TPE and Predictor draw 24 and 100 candidates per proposal).

    Example:
        >>> view = ChoiceSpace()
        >>> view.size(), next(view.enumerate()).sample["edge_23"]
        (1024, 'none')
    """

    class Model:
        def __init__(self, sample: dict):
            self.sample = sample

    def __init__(self, ops: dict = TABLE_OPS):
        # the searched edges in the order SPACE asks them: Cell.__init__ walks EDGE_LABELS
        self.choices = [(label, list(ops[label])) for label in EDGE_LABELS if len(ops[label]) > 1]

    def sample(self, sampler) -> "ChoiceSpace.Model":
        out: dict = {}
        for label, candidates in self.choices:
            out[label] = candidates[sampler.choose(label, list(candidates), dict(out))]
        return self.Model(out)

    def enumerate(self):
        """The models in SPACE.enumerate()'s order (the last choice varies fastest)."""
        labels = [label for label, _ in self.choices]
        for values in itertools.product(*(c for _, c in self.choices)):
            yield self.Model(dict(zip(labels, values)))

    def size(self) -> int:
        return math.prod(len(c) for _, c in self.choices)


class TableBySample(Mapping):
    """The table's per-epoch metrics looked up by a trial's sample (its ``choices``), for
    ``SimulatedExecutor(table=..., table_key="choices")``: a sample is a dict, the table is
    keyed by the architecture string it maps to."""

    def __init__(self, curves: dict[str, list[dict]]):
        self.curves = curves

    def __getitem__(self, sample: dict) -> list[dict]:
        return self.curves[arch_string(full_sample(sample, TABLE_OPS))]

    def __iter__(self):
        return iter(self.curves)

    def __len__(self) -> int:
        return len(self.curves)


# Every strategy with the settings benchmarks/strategies.py gives it. NAS-Bench-201 has no
# depth choice, so Progressive runs its one-stage form (ranked random models, then ranked
# neighbours of the best, `beam` at a time): PNAS's block-by-block growth does not apply.
STRATEGIES = {
    "random": lambda seed: Random(seed=seed),
    "evolution": lambda seed: RegularizedEvolution(population_size=20, sample_size=5, seed=seed),
    "rl": lambda seed: PolicyBasedRL(seed=seed),
    "tpe": lambda seed: TPE(seed=seed),
    "predictor": lambda seed: Predictor(seed=seed),
    "progressive": lambda seed: Progressive(seed=seed, depth_label=None),
}


def final_accuracy(rows: list[dict]) -> dict[str, float]:
    """``{arch: val_acc after the last epoch}``: the objective and the truth of a replay."""
    return {r["arch"]: r[f"val_acc_{EPOCHS}"] for r in rows}


def replay(name: str, seed: int, budget: int, accuracy: dict[str, float],
           space: ChoiceSpace | None = None) -> list[float]:
    """One sequential search (ask, tell the table's value, ask...): the table accuracy of the
    best model found after each of ``budget`` models."""
    space = space or ChoiceSpace()
    strategy = STRATEGIES[name](seed)
    best, curve = -math.inf, []
    for _ in range(budget):
        sample = strategy.ask(space)
        value = accuracy[arch_string(full_sample(sample, TABLE_OPS))]
        strategy.tell(sample, value)
        best = max(best, value)
        curve.append(best)
    return curve


def engine_replay(name: str, seed: int, budget: int, rows: list[dict],
                  workers: int = 1) -> list[float]:
    """The same search through the engine: ``rt.Experiment`` on SPACE (models built, shapes
    checked, every fact in a store) with a SimulatedExecutor replaying the table's epochs.
    About half a second per model here; with one worker it equals :func:`replay`."""
    accuracy = final_accuracy(rows)
    executor = SimulatedExecutor(workers, table=TableBySample(curves_by_arch(rows)),
                                 table_key="choices")
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "replay.db")
        rt.Experiment(SPACE, STRATEGIES[name](seed), TRAINER, store=store, executor=executor,
                      seed=seed, optimize=False).run(max_models=budget)
        from retiarii.engine.storage.store import Store

        with Store(store) as db:
            db.use_experiment(db.experiments()[-1]["id"])
            models = sorted(db.models(), key=lambda m: m["id"])
    best, curve = -math.inf, []
    for model in models:
        best = max(best, accuracy[arch_string(full_sample(model["sample"], TABLE_OPS))])
        curve.append(best)
    return curve


def compare(budget: int = 100, seeds: int = 20, only: list[str] | None = None,
            path: str = TABLE, engine: bool = False) -> dict:
    """Every strategy over the table, ``seeds`` seeds each: CSVs, a PNG, a printed table.
    ``engine``: each search runs through the engine (:func:`engine_replay`, one simulated
    worker) instead of the ask/tell loop; the curves are the same, only slower."""
    rows, header = load_table(path)
    accuracy = final_accuracy(rows)
    ranked = sorted(accuracy.values())
    optimum = ranked[-1]
    print(f"table: {len(rows)} models ({header[1] if len(header) > 1 else ''}); final val_acc: "
          f"best {optimum:.4f}, median {ranked[len(ranked) // 2]:.4f}, worst {ranked[0]:.4f}; "
          f"budget {budget}, {seeds} seeds")
    space = ChoiceSpace()
    curves: dict[str, list[list[float]]] = {}
    seconds: dict[str, float] = {}
    for name in only or list(STRATEGIES):
        start = time.perf_counter()
        curves[name] = [engine_replay(name, seed, budget, rows) if engine else
                        replay(name, seed, budget, accuracy, space) for seed in range(seeds)]
        seconds[name] = time.perf_counter() - start
    out_dir = os.path.join(HERE, "out")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tabular.csv"), "w", newline="") as f:
        csv.writer(f).writerows([("strategy", "seed", "models", "best_val_acc"),
                                 *[(name, seed, step + 1, best) for name, runs in curves.items()
                                   for seed, run in enumerate(runs)
                                   for step, best in enumerate(run)]])
    budgets = sorted({b for b in (10, 25, 50, 100, budget) if b <= budget})
    head = ["strategy", *[f"best@{b}" for b in budgets], "se@end", "found_best", "seconds"]
    summary = []
    for name, runs in curves.items():
        ends = [r[-1] for r in runs]
        summary.append([name, *[f"{statistics.mean(r[b - 1] for r in runs):.4f}" for b in budgets],
                        f"{statistics.stdev(ends) / math.sqrt(len(ends)):.4f}" if seeds > 1 else "-",
                        f"{sum(e == optimum for e in ends)}/{len(ends)}", f"{seconds[name]:.1f}"])
    with open(os.path.join(out_dir, "tabular_summary.csv"), "w", newline="") as f:
        csv.writer(f).writerows([head, *summary])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *summary)]
    for line in [head, *summary]:
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)))
    _plot(curves, optimum, len(rows), seeds, os.path.join(out_dir, "tabular.png"))
    print(f"wrote {out_dir}/tabular.csv, tabular_summary.csv, tabular.png")
    return curves


def _plot(curves: dict, optimum: float, n_models: int, seeds: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, runs in curves.items():
        steps = range(1, len(runs[0]) + 1)
        mean = [statistics.mean(r[i] for r in runs) for i in range(len(runs[0]))]
        se = [statistics.stdev(r[i] for r in runs) / math.sqrt(len(runs)) if len(runs) > 1
              else 0.0 for i in range(len(runs[0]))]
        ax.plot(steps, mean, label=name)
        ax.fill_between(steps, [m - s for m, s in zip(mean, se)],
                        [m + s for m, s in zip(mean, se)], alpha=0.2)
    ax.axhline(optimum, color="black", linewidth=0.8, linestyle=":", label="table's best")
    ax.set_xlabel("models evaluated")
    ax.set_ylabel(f"val_acc (epoch {EPOCHS}) of the best model found")
    ax.set_title(f"NAS-Bench-201-like table on digits, {n_models} models, "
                 f"mean ± s.e. over {seeds} seeds", fontsize=10)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("make", help="train the table's models (resumes) and write the table")
    p.add_argument("--workers", type=int, default=2)
    sub.add_parser("export", help="write the table from the store as it stands")
    p = sub.add_parser("compare", help="every strategy over the table, many seeds")
    p.add_argument("--budget", type=int, default=100)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--only", nargs="*", choices=list(STRATEGIES))
    p.add_argument("--engine", action="store_true",
                   help="run each search through rt.Experiment and the SimulatedExecutor")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.command == "make":
        make(args.workers)
    elif args.command == "export":
        export()
    else:
        compare(args.budget, args.seeds, args.only, engine=args.engine)


if __name__ == "__main__":
    main()
