"""Best-found curves of every exploration strategy on the synthetic objective, over seeds.

The space (tests/toy_spaces.py) is a cell of 2..5 paths with one of 4 ops per path and a
learning rate: 5440 models, conditional choices included. A model's score is a fixed function of
its choices (per-path op quality, neighbour interactions, the lr); a strategy sees it plus
Gaussian noise (sd 0.1). For each strategy and seed we record, after every model, the true
score of the best model found so far. Optuna's TPESampler (driven define-by-run through the
same sampler protocol, without dedup) runs beside our TPE as a reference.

    .venv/bin/python benchmarks/strategies.py [--budget 150] [--seeds 20]

Writes benchmarks/out/strategies.csv (one row per strategy, seed and step),
benchmarks/out/strategies_summary.csv and benchmarks/out/strategies.png.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

import toy_spaces  # noqa: E402
from retiarii.strategies import (  # noqa: E402
    TPE, GridSearch, PolicyBasedRL, Predictor, Progressive, Random, RegularizedEvolution,
)


class OptunaTPE:
    """Optuna's TPESampler behind ask/tell, as a reference (it may propose a model twice)."""

    def __init__(self, seed: int):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.study = optuna.create_study(direction="maximize",
                                         sampler=optuna.samplers.TPESampler(seed=seed))
        self.trials: list = []

    def ask(self, space) -> dict:
        trial = self.study.ask()

        class Sampler:
            def choose(self, label, candidates, context):
                return candidates.index(trial.suggest_categorical(label, candidates))

        sample = space.sample(Sampler()).sample
        self.trials.append((sample, trial))
        return sample

    def tell(self, sample: dict, value: float) -> None:
        i = next(i for i, (s, _) in enumerate(self.trials) if s is sample)
        self.study.tell(self.trials.pop(i)[1], value)


STRATEGIES = {
    "random": lambda seed: Random(seed=seed),
    "grid": lambda seed: GridSearch(seed=seed),
    "evolution": lambda seed: RegularizedEvolution(population_size=20, sample_size=5, seed=seed),
    "rl": lambda seed: PolicyBasedRL(seed=seed),
    "tpe": lambda seed: TPE(seed=seed),
    "predictor": lambda seed: Predictor(seed=seed),
    # n_paths is the synthetic cell's depth: PNAS grows it one path per stage
    "progressive": lambda seed: Progressive(seed=seed, depth_label="n_paths"),
    "optuna-tpe": lambda seed: OptunaTPE(seed),
}
try:  # Optuna is only a reference line: `./dev setup bench` installs it
    import optuna  # noqa: F401
except ImportError:
    print("optuna is not installed (./dev setup bench): leaving out the optuna-tpe reference")
    del STRATEGIES["optuna-tpe"]


def run(name: str, seed: int, budget: int, space) -> tuple[list[float], float]:
    """Best true score after each model, and seconds per ask + tell."""
    strategy = STRATEGIES[name](seed)
    noise = random.Random(10_000 + seed)  # the same noise stream for every strategy
    best, curve = -math.inf, []
    start = time.perf_counter()
    for _ in range(budget):
        sample = strategy.ask(space)
        strategy.tell(sample, toy_spaces.synthetic_noisy(sample, noise))
        best = max(best, toy_spaces.synthetic_score(sample))
        curve.append(best)
    return curve, (time.perf_counter() - start) / budget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=150)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--only", nargs="*", default=list(STRATEGIES), choices=list(STRATEGIES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    out_dir = os.path.join(HERE, "out")
    os.makedirs(out_dir, exist_ok=True)

    space = toy_spaces.synthetic_space()
    scores = sorted(toy_spaces.synthetic_score(m.sample) for m in space.enumerate())
    optimum = scores[-1]
    print(f"space: {len(scores)} models, optimum {optimum:.3f}, "
          f"median {scores[len(scores) // 2]:.3f}; budget {args.budget}, {args.seeds} seeds")

    curves: dict[str, list[list[float]]] = {}
    seconds: dict[str, float] = {}
    rows = []
    for name in args.only:
        curves[name], times = [], []
        for seed in range(args.seeds):
            curve, per_model = run(name, seed, args.budget, space)
            curves[name].append(curve)
            times.append(per_model)
            rows += [(name, seed, step + 1, best) for step, best in enumerate(curve)]
        seconds[name] = statistics.mean(times)
    with open(os.path.join(out_dir, "strategies.csv"), "w", newline="") as f:
        csv.writer(f).writerows([("strategy", "seed", "models", "best_true_score"), *rows])

    checkpoints = [c for c in (25, 50, 100, 150, args.budget) if c <= args.budget]
    checkpoints = sorted(set(checkpoints))
    header = ["strategy", *[f"best@{c}" for c in checkpoints], "se@end", "found_optimum",
              "ms_per_model"]
    summary = []
    for name, runs in curves.items():
        ends = [r[-1] for r in runs]
        summary.append([name, *[round(statistics.mean(r[c - 1] for r in runs), 3)
                                for c in checkpoints],
                        round(statistics.stdev(ends) / math.sqrt(len(ends)), 3)
                        if len(ends) > 1 else 0.0,
                        f"{sum(math.isclose(e, optimum) for e in ends)}/{len(ends)}",
                        round(1000 * seconds[name], 2)])
    with open(os.path.join(out_dir, "strategies_summary.csv"), "w", newline="") as f:
        csv.writer(f).writerows([header, *summary])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *summary)]
    for line in [header, *summary]:
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)))
    if "random" in curves:
        base = statistics.mean(r[-1] for r in curves["random"])
        for name, runs in curves.items():
            mean = statistics.mean(r[-1] for r in runs)
            print(f"{name:>11}: closes {(mean - base) / (optimum - base):6.1%} of random's gap "
                  f"to the optimum at {args.budget} models")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps = list(range(1, args.budget + 1))
    for name, runs in curves.items():
        mean = [statistics.mean(r[i] for r in runs) for i in range(args.budget)]
        se = [statistics.stdev(r[i] for r in runs) / math.sqrt(len(runs)) if len(runs) > 1
              else 0.0 for i in range(args.budget)]
        ax.plot(steps, mean, label=name, linestyle="--" if name == "optuna-tpe" else "-")
        ax.fill_between(steps, [m - s for m, s in zip(mean, se)],
                        [m + s for m, s in zip(mean, se)], alpha=0.2)
    ax.axhline(optimum, color="black", linewidth=0.8, linestyle=":", label="optimum")
    ax.set_xlabel("models evaluated")
    ax.set_ylabel("true score of the best model found")
    ax.set_title(f"Synthetic objective, {len(scores)} models, mean ± s.e. over {args.seeds} seeds")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "strategies.png"), dpi=120)
    print(f"wrote {os.path.join(out_dir, 'strategies.csv')}, strategies_summary.csv, "
          f"strategies.png")


if __name__ == "__main__":
    main()
