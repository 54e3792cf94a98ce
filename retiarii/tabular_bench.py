"""Replaying a published NAS table: any strategy (and scheduler) on the simulated clock.

A search over a :class:`~retiarii.nasbench_tables.Table` is told, for each architecture it
proposes, the validation accuracy of one of the table's runs (drawn with the trial's seed, as
NAS-Bench-201's baselines draw one) and is charged that run's training seconds on a simulated
clock; the figure is what the papers report for the architecture the search would return at
each instant (the one with the best search signal so far): its mean test accuracy.

Two ways give the same curves at one worker without a scheduler
(``tests/test_nasbench_tables.py`` checks it):

- :func:`replay`: the plain ask/tell loop over :class:`ChoiceView` (the space's choices
  without networks) with a clock that adds each run's seconds: a 12,000 s search in a second.
- :func:`engine_replay`: ``rt.Experiment`` on our space (``nasbench201`` or ``nasbench101``,
  small preset) with a :class:`~retiarii.engine.executors.simulated.SimulatedExecutor` that
  replays each run step by step (an epoch of NAS-Bench-201's 12, NAS-Bench-101's halfway and
  final points) at the table's seconds: any scheduler (ASHA stops runs at the table's epochs)
  and several workers. Half a second or so per model.

Example::

    >>> from retiarii import nasbench_tables, tabular_bench
    >>> table = nasbench_tables.load("nasbench201", "NAS-Bench-201-v1_0-e61699.pth")
    >>> curve = tabular_bench.replay(table, "evolution", seed=0, time_budget=12_000)
    >>> curve[-1].reported["cifar10 test"]        # the returned architecture's test accuracy
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import random
import statistics
import tempfile
from typing import Any

from .nasbench_tables import NB101_OPS, NB201_EDGES, NB201_OPS, Table

__all__ = ["PUBLISHED", "ChoiceView", "Point", "engine_replay", "make_strategy", "replay",
           "summarize", "value_at"]

# What the replays run under each name: NAS-Bench-201's baselines where we have them
# (REA: population 10, tournament 3, as AutoDL-Projects' REA.py runs it)
STRATEGY_OPTIONS = {"evolution": {"population_size": 10, "sample_size": 3}}

# NAS-Bench-201's Table 5 (Dong & Yang, ICLR 2020): mean ± std over 500 runs of each
# multi-trial baseline, searched on CIFAR-10's validation set (12-epoch results, 12,000 s
# simulated budget), the selected cell's accuracy after 200 epochs, in %.
PUBLISHED = {
    "source": "Dong & Yang, NAS-Bench-201, ICLR 2020, Table 5 (v1_0 table)",
    "rows": {
        "REA": ("evolution", {"cifar10 valid": (91.19, 0.31), "cifar10 test": (93.92, 0.30),
                              "cifar100 valid": (71.81, 1.12), "cifar100 test": (71.84, 0.99),
                              "ImageNet16-120 valid": (45.15, 0.89),
                              "ImageNet16-120 test": (45.54, 1.03)}),
        "RS": ("random", {"cifar10 valid": (90.93, 0.36), "cifar10 test": (93.70, 0.36),
                          "cifar100 valid": (70.93, 1.09), "cifar100 test": (71.04, 1.07),
                          "ImageNet16-120 valid": (44.45, 1.10),
                          "ImageNet16-120 test": (44.57, 1.25)}),
        "REINFORCE": ("rl", {"cifar10 valid": (91.09, 0.37), "cifar10 test": (93.85, 0.37),
                             "cifar100 valid": (71.61, 1.12), "cifar100 test": (71.71, 1.09),
                             "ImageNet16-120 valid": (45.05, 1.02),
                             "ImageNet16-120 test": (45.24, 1.18)}),
        "BOHB": ("tpe+asha", {"cifar10 valid": (90.82, 0.53), "cifar10 test": (93.61, 0.52),
                              "cifar100 valid": (70.74, 1.29), "cifar100 test": (70.85, 1.28),
                              "ImageNet16-120 valid": (44.26, 1.36),
                              "ImageNet16-120 test": (44.42, 1.49)}),
        "optimal": (None, {"cifar10 valid": (91.61, 0.0), "cifar10 test": (94.37, 0.0),
                           "cifar100 valid": (73.49, 0.0), "cifar100 test": (73.51, 0.0),
                           "ImageNet16-120 valid": (46.77, 0.0),
                           "ImageNet16-120 test": (47.31, 0.0)}),
    },
}


# Proposals in a row the table lacks before a replay gives up (a table of a few cells)
MAX_MISSES = 200


@dataclasses.dataclass(frozen=True)
class Point:
    """The search after an evaluation ended: when, how many models, the best signal so far
    and what the papers report for the architecture that holds it."""

    time: float  # simulated seconds
    models: int
    signal: float  # best validation accuracy (%) the search was told
    key: str  # that architecture
    reported: dict  # its published figures (%)


class ChoiceView:
    """Our space's choices without its networks (same labels, candidates and order), so a
    strategy proposes what it would on ``nas.build_space(benchmark)`` without building models.

    NAS-Bench-201: the six ``edge_ij`` of five ops. NAS-Bench-101: ``op1..op5`` then the 21
    edge bits asked in order while fewer than 9 are on (``model_spaces/nasbench101.py``'s
    CellMutator)."""

    class Model:
        def __init__(self, sample: dict):
            self.sample = sample

    def __init__(self, benchmark: str, num_vertices: int = 7, max_edges: int = 9):
        self.benchmark, self.num_vertices, self.max_edges = benchmark, num_vertices, max_edges

    def sample(self, sampler) -> "ChoiceView.Model":
        out: dict = {}

        def ask(label, candidates):
            out[label] = candidates[sampler.choose(label, list(candidates), dict(out))]
            return out[label]

        if self.benchmark == "nasbench201":
            for label in NB201_EDGES:
                ask(label, NB201_OPS)
            return self.Model(out)
        n, chosen = self.num_vertices, 0
        for v in range(1, n - 1):
            ask(f"op{v}", NB101_OPS)
        for j in range(1, n):
            for i in range(j):
                if chosen < self.max_edges:
                    chosen += ask(f"edge{i}{j}", [0, 1])
        return self.Model(out)

    def enumerate(self):
        if self.benchmark != "nasbench201":
            raise ValueError("enumerating NAS-Bench-101's 169 million labelled specs is not a "
                             "search; use a strategy that samples")
        for ops in itertools.product(NB201_OPS, repeat=len(NB201_EDGES)):
            yield self.Model(dict(zip(NB201_EDGES, ops)))

    def size(self) -> int:
        if self.benchmark == "nasbench201":
            return len(NB201_OPS) ** len(NB201_EDGES)
        pairs = self.num_vertices * (self.num_vertices - 1) // 2
        return len(NB101_OPS) ** (self.num_vertices - 2) * sum(
            math.comb(pairs, k) for k in range(self.max_edges + 1))


def make_strategy(name: str, seed: int):
    """Strategy ``name`` of the registry (``"tpe+asha"``: its strategy part) with the
    replays' settings."""
    from .registry import make_strategy as build

    name = name.split("+")[0]
    return build(name, seed, **STRATEGY_OPTIONS.get(name, {}))


def _run_of(table: Table, key: str, trial_seed: int):
    """The run a trial with seed ``trial_seed`` is told (drawn as the paper's baselines draw:
    one of the architecture's runs at random)."""
    runs = table.entries[key].runs
    return runs[random.Random(trial_seed).randrange(len(runs))]


def replay(table: Table, strategy: str, seed: int, time_budget: float,
           max_models: int = 100_000) -> list[Point]:
    """One sequential search on the simulated clock, one worker, every run to its end (see the
    module docstring): a :class:`Point` after each evaluation ending within ``time_budget``.
    A sample the table lacks (NAS-Bench-101 cells with no input -> output path) is told as a
    failed model and costs nothing, as the engine records a model whose trial fails."""
    view, search = ChoiceView(table.benchmark), make_strategy(strategy, seed)
    clock, best, points, seen, count, misses = 0.0, None, [], {}, 0, 0
    for _ in range(max_models):
        if misses >= MAX_MISSES:
            raise ValueError(f"{table.source}: {misses} proposals in a row are not in the "
                             f"table ({len(table.entries)} architectures): it holds too little "
                             f"of the space to replay a search over")
        try:
            sample = search.ask(view)
        except Exception as err:  # noqa: BLE001 (SpaceExhausted and budget ends alike)
            if type(err).__name__ in ("SpaceExhausted", "BudgetExhausted"):
                break
            raise
        key = table.key_of(sample)
        if key in seen:  # a structure evaluated before: told again, not trained again
            search.tell(sample, seen[key])
            continue
        count += 1  # the engine's trials count failed ones too: their seeds stay aligned
        if key not in table.entries:
            seen[key], misses = None, misses + 1
            search.tell(sample, None)
            continue
        misses = 0
        run = _run_of(table, key, seed + count - 1)
        clock += sum(run.seconds)
        if clock > time_budget:
            break
        value = run.accuracy[-1]
        seen[key] = value / 100
        search.tell(sample, value / 100)
        if best is None or value > best[0]:
            best = (value, key)
        points.append(Point(clock, len(points) + 1, best[0], best[1],
                            table.entries[best[1]].reported))
    return points


def engine_replay(table: Table, strategy: str, seed: int, time_budget: float,
                  max_models: int, scheduler: str | None = None, workers: int = 1,
                  store: str | None = None) -> list[Point]:
    """The search through ``rt.Experiment`` on our small space of the benchmark with a
    SimulatedExecutor replaying the table's runs step by step (see the module docstring).
    ``max_models`` bounds the run (the engine's ``max_time`` is wall-clock); the points are
    the evaluations that ended by ``time_budget`` on the simulated clock. A run a scheduler
    stopped early counts as evaluated at its last step."""
    from .engine.executors.simulated import SimulatedExecutor
    from .engine.driver.experiment import Experiment
    from .engine.trainers.trainer import ClassifierTrainer
    from .registry import make_scheduler

    def run_of(spec: dict):
        return _run_of(table, table.key_of(spec["choices"]), int(spec["seed"]))

    def curve(spec: dict, step: int) -> dict:
        return {"val_acc": run_of(spec).accuracy[step - 1] / 100}

    def step_time(spec: dict, step: int) -> float:
        if table.key_of(spec["choices"]) not in table.entries:
            return 0.0  # its curve fails the trial (a cell the table lacks), at no cost
        return run_of(spec).seconds[step - 1]

    executor = SimulatedExecutor(workers, curve=curve, step_time=step_time)
    name = strategy.split("+")
    sched = make_scheduler(scheduler or (name[1] if len(name) > 1 else "none"),
                           max_t=table.steps)
    with tempfile.TemporaryDirectory() as folder:
        Experiment(f"retiarii.nas:SPACES.{table.benchmark}.small", make_strategy(strategy, seed),
                   ClassifierTrainer(dataset="digits", epochs=table.steps),
                   store=store or os.path.join(folder, "replay.db"), executor=executor,
                   scheduler=sched, seed=seed, workers=workers, optimize=False,
                   max_models=max_models).run()
    last: dict[str, tuple[float, dict, int]] = {}  # trial -> (end, spec, last step)
    for job in executor.history:
        if job.get("failed") or job.get("cancelled"):
            continue
        for task in job["tasks"]:
            last[task["trial_id"]] = (job["end"], task["spec"], task["stop_step"])
    best, points = None, []
    for end, spec, step in sorted(last.values(), key=lambda item: item[0]):
        if end > time_budget:
            break
        key = table.key_of(spec["choices"])
        value = run_of(spec).accuracy[step - 1]
        if step == table.steps and (best is None or value > best[0]):
            best = (value, key)
        if best is not None:
            points.append(Point(end, len(points) + 1, best[0], best[1],
                                table.entries[best[1]].reported))
    return points


def value_at(points: list[Point], time: float, column: str) -> float | None:
    """``column`` of the architecture the search holds at simulated ``time`` (None before its
    first evaluation ends)."""
    held = None
    for point in points:
        if point.time > time:
            break
        held = point.reported.get(column)
    return held


def summarize(curves: dict[str, list[list[Point]]], time_budget: float,
              columns: list[str]) -> list[dict[str, Any]]:
    """Per strategy: the mean ± std over seeds of each column at ``time_budget`` and the mean
    number of models evaluated, next to NAS-Bench-201's published means where it has them."""
    out = []
    by_ours = {ours: (paper, figures) for paper, (ours, figures) in PUBLISHED["rows"].items()}
    for name, runs in curves.items():
        row: dict[str, Any] = {"strategy": name, "seeds": len(runs),
                               "models": statistics.fmean(len(r) for r in runs) if runs else 0}
        for column in columns:
            values = [v for v in (value_at(r, time_budget, column) for r in runs) if v is not None]
            row[column] = (statistics.fmean(values) if values else None,
                           statistics.stdev(values) if len(values) > 1 else 0.0)
            paper = by_ours.get(name)
            row[f"{column} (paper)"] = paper[1].get(column) if paper else None
        row["paper row"] = by_ours[name][0] if name in by_ours else ""
        out.append(row)
    return out
