"""``retiarii nas bench``: strategies compared over a published table, CSV + PNG, next to the
paper's means (:mod:`retiarii.tabular_bench` replays; ``benchmarks/nasbench_replay.py`` is
the same comparison as a script).
"""
from __future__ import annotations

import csv
import math
import os
import statistics
import time

from .cli_common import CliError, format_table

__all__ = ["cmd_nas_bench", "compare", "add_bench_parser"]

# The papers' budgets: NAS-Bench-201's baselines ran 12,000 simulated seconds; NAS-Bench-101's
# comparisons plot up to 10^7 s (Ying et al., Fig. 7): 5e5 s is about 280 cells there.
TIME_BUDGET = {"nasbench201": 12_000.0, "nasbench101": 500_000.0}


def compare(table, strategies: list[str], seeds: int, time_budget: float, out_dir: str,
            scheduler: str | None = None, workers: int = 1, engine: bool = False,
            max_models: int | None = None, log=print) -> list[dict]:
    """Every strategy over ``table``, ``seeds`` seeds each: writes ``{benchmark}_replay.csv``
    (strategy, seed, simulated time, models, best signal, the held architecture's figures),
    ``{benchmark}_replay_summary.csv`` and ``{benchmark}_replay.png`` (the held architecture's
    test accuracy vs simulated time, mean ± s.e.) to ``out_dir``; returns the summary rows."""
    from . import tabular_bench

    engine = engine or scheduler is not None or workers > 1 or any("+" in s for s in strategies)
    columns = [c for c in table.columns() if c.endswith("test")] + [
        c for c in table.columns() if c.endswith("valid")]
    if max_models is None:  # the engine stops on models: enough for the budget's cheapest runs
        cheapest = sorted(sum(r.seconds) for e in table.entries.values() for r in e.runs)
        max_models = int(time_budget / cheapest[len(cheapest) // 10] * workers) + 1
    curves = {}
    for name in strategies:
        start = time.perf_counter()
        curves[name] = [tabular_bench.engine_replay(table, name, seed, time_budget, max_models,
                                                    scheduler, workers)
                        if engine else tabular_bench.replay(table, name, seed, time_budget)
                        for seed in range(seeds)]
        log(f"{name}: {seeds} seeds in {time.perf_counter() - start:.1f} s")
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{table.benchmark}_replay")
    with open(stem + ".csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["strategy", "seed", "time_s", "models", "best_signal", "arch", *columns])
        for name, runs in curves.items():
            for seed, points in enumerate(runs):
                for p in points:
                    writer.writerow([name, seed, round(p.time, 3), p.models, p.signal, p.key,
                                     *[p.reported.get(c) for c in columns]])
    summary = tabular_bench.summarize(curves, time_budget, columns)
    with open(stem + "_summary.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["strategy", "seeds", "models", *[f"{c} mean" for c in columns],
                         *[f"{c} std" for c in columns], "paper row",
                         *[f"{c} paper" for c in columns]])
        for row in summary:
            writer.writerow([row["strategy"], row["seeds"], round(row["models"], 1),
                             *[_r(row[c][0]) for c in columns], *[_r(row[c][1]) for c in columns],
                             row["paper row"], *[_paper(row[f"{c} (paper)"]) for c in columns]])
    _plot(curves, time_budget, columns[0], table, seeds, stem + ".png")
    return summary


def _r(value):
    return None if value is None else round(value, 3)


def _paper(figure):
    return "" if figure is None else f"{figure[0]:.2f}±{figure[1]:.2f}"


def _plot(curves, time_budget: float, column: str, table, seeds: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .tabular_bench import value_at

    grid = [time_budget * (i + 1) / 100 for i in range(100)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, runs in curves.items():
        xs, mean, se = [], [], []
        for t in grid:
            values = [v for v in (value_at(r, t, column) for r in runs) if v is not None]
            if len(values) == len(runs):
                xs.append(t)
                mean.append(statistics.fmean(values))
                se.append(statistics.stdev(values) / math.sqrt(len(values))
                          if len(values) > 1 else 0.0)
        ax.plot(xs, mean, label=name)
        ax.fill_between(xs, [m - s for m, s in zip(mean, se)], [m + s for m, s in zip(mean, se)],
                        alpha=0.2)
    best = table.optimum(column)[1]
    ax.axhline(best, color="black", linewidth=0.8, linestyle=":", label="table's best")
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel(f"{column} (%) of the architecture held")
    ax.set_title(f"{table.benchmark} ({os.path.basename(table.source)}), mean ± s.e. over "
                 f"{seeds} seeds", fontsize=10)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_nas_bench(args) -> int:
    from . import nasbench_tables, registry
    from .published_formats import CorruptRecordError, UnsafePickleError

    for value, flag in ((args.seeds, "--seeds"), (args.workers, "--workers")):
        if value < 1:
            raise CliError(f"{flag} {value}: give a number >= 1")
    strategies = [s.strip() for s in args.strategy.split(",") if s.strip()]
    try:
        for name in strategies:
            registry.entry("multi-trial strategy", name.split("+")[0])
            if "+" in name:
                registry.entry("scheduler", name.split("+")[1])
        if args.scheduler:
            registry.entry("scheduler", args.scheduler)
    except registry.UnknownName as err:
        raise CliError(str(err)) from None
    if not os.path.isfile(args.table):
        raise CliError(f"--table {args.table}: no such file. Download the published table "
                       f"yourself (nothing is downloaded here): docs/spaces.md names the "
                       f"supported files")
    try:
        table = nasbench_tables.load(args.benchmark, args.table)
    except (nasbench_tables.TableError, UnsafePickleError, CorruptRecordError,
            ValueError) as err:
        raise CliError(f"--table: {err}") from None
    budget = args.time_budget or TIME_BUDGET[args.benchmark]
    print(f"{args.table}: {len(table.entries)} architectures; the search is told "
          f"{table.signal}; budget {budget:g} simulated s, {args.seeds} seeds")
    try:
        summary = compare(table, strategies, args.seeds, budget, args.out, args.scheduler,
                          args.workers, args.engine, args.max_models)
    except ValueError as err:  # a table of a few cells, a strategy's refusal
        raise CliError(str(err)) from None
    columns = [c for c in table.columns() if c.endswith("test")]
    rows = [[r["strategy"], f"{r['models']:.1f}",
             *[f"{r[c][0]:.2f}±{r[c][1]:.2f}" if r[c][0] is not None else "-" for c in columns],
             r["paper row"] and f"{r['paper row']}: " + ", ".join(
                 _paper(r[f"{c} (paper)"]) for c in columns)] for r in summary]
    print(format_table(rows, ["strategy", "models", *columns, "paper (mean±std)"]))
    print(f"wrote {args.out}/{args.benchmark}_replay.csv, _summary.csv, .png")
    return 0


def add_bench_parser(nas_sub) -> None:
    """``retiarii nas bench``'s arguments (``nas_sub``: the ``nas`` subparsers)."""
    p = nas_sub.add_parser("bench", help="replay a published table (NAS-Bench-201/101): "
                                         "strategies on a simulated clock, many seeds")
    p.add_argument("benchmark", choices=("nasbench201", "nasbench101"))
    p.add_argument("--table", required=True, help="the published file you downloaded")
    p.add_argument("--strategy", default="random,evolution,rl,tpe",
                   help="comma-separated registry names; NAME+SCHEDULER (tpe+asha) runs that "
                        "scheduler too (default random,evolution,rl,tpe)")
    p.add_argument("--scheduler", default=None, help="a scheduler for every strategy (asha...)")
    p.add_argument("--seeds", type=int, default=20, help="seeds per strategy (default 20)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="simulated seconds (default: 12000 for 201, 500000 for 101)")
    p.add_argument("--workers", type=int, default=1, help="simulated workers (default 1)")
    p.add_argument("--engine", action="store_true",
                   help="run every search through rt.Experiment (implied by --scheduler, "
                        "--workers > 1, NAME+SCHEDULER)")
    p.add_argument("--max-models", type=int, default=None,
                   help="the engine's bound on models per search (default: from the budget)")
    p.add_argument("--out", default="runs/nas-bench", help="folder for CSV and PNG")
    p.set_defaults(fn=cmd_nas_bench)
