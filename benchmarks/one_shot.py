"""Benchmark: one-shot search quality and cost vs multi-trial search on the same wall clock
(issue #14, "one-shot search quality and cost"), on the digits DARTS cell space.

Each one-shot strategy (SPOS, ENAS, ``WeightSharing(Random)``) runs all its segments by hand
(``setup``, then ``run_segment`` per segment, as the engine does in a worker) and is timed.
Multi-trial random search then gets the mean of those times: it draws models, trains each
alone for ``--trial-epochs`` epochs (``TrialRun``) and keeps the best by validation accuracy
until the budget is spent. Every method's selected model is then **retrained alone** from
scratch for ``--retrain-epochs`` epochs (same seed, same data) and its validation accuracy
reported: the quality of what each search found, judged the same way. All of it runs in this
process, one method after the other, on one torch thread (``--threads``).

Prints one line per method (search seconds, models evaluated, retrained accuracy) and writes
``benchmarks/out/one_shot-DEVICE.csv`` and ``.png``.

Example::

    .venv/bin/python benchmarks/one_shot.py                 # the figures of benchmarks/README.md
    .venv/bin/python benchmarks/one_shot.py --quick         # seconds: a smoke test
    .venv/bin/python benchmarks/one_shot.py --device cuda --segments 10
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository: retiarii, model_spaces

from model_spaces import darts  # noqa: E402
from retiarii.engine.trainers.trainer import ClassifierTrainer, TrialRun, load_dataset  # noqa: E402
from retiarii.strategies import (ENAS, SPOS, Random, SegmentContext,  # noqa: E402
                                 SpaceExhausted, WeightSharing)


def one_shot(strategy, space, trainer, device) -> tuple[dict, float, int]:
    """(selected sample, seconds, models evaluated) of a one-shot search run by hand."""
    started = time.perf_counter()
    strategy.setup(space, trainer, {}, device)
    models = 0
    for segment in range(strategy.num_segments()):
        result = strategy.run_segment(SegmentContext(segment, trainer, {}, device))
        models += len(result.models)
    return strategy.selected(), time.perf_counter() - started, models


def multi_trial(space, trainer, device, budget: float, epochs: int,
                seed: int) -> tuple[dict, float, int]:
    """(best sample, seconds, models trained) of random search, each model trained alone,
    until ``budget`` seconds are used (the model in training when it runs out finishes)."""
    strategy = Random(seed=seed)
    started = time.perf_counter()
    best, models = None, 0
    while time.perf_counter() - started < budget:
        try:
            sample = strategy.ask(space)
        except SpaceExhausted:
            break
        acc = train_alone(space, trainer, sample, epochs, device, seed)
        strategy.tell(sample, acc)
        models += 1
        if best is None or acc > best[1]:
            best = (sample, acc)
    return best[0], time.perf_counter() - started, models


def train_alone(space, trainer, sample, epochs, device, seed) -> float:
    run = TrialRun(lambda: space.build(sample), trainer, {"epochs": epochs}, seed=seed,
                   device=device)
    metrics = {}
    for _ in range(epochs):
        metrics = run.train_epoch()
    return float(metrics["val_acc"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke test")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--segments", type=int, default=4,
                        help="segments (epochs) of super-net training per one-shot strategy")
    parser.add_argument("--trial-epochs", type=int, default=1,
                        help="epochs each multi-trial model trains alone")
    parser.add_argument("--retrain-epochs", type=int, default=5,
                        help="epochs each selected model is retrained alone")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")

    space = darts.small()
    batch = 64
    trainer = ClassifierTrainer(dataset="digits", batch_size=batch, lr=3e-3)
    segments, retrain = args.segments, args.retrain_epochs
    population, generations, steps = 8, 3, 20
    if args.quick:
        # a few labelled digits only: seconds, not minutes
        x, y = (t[:160] for t in load_dataset("digits"))
        trainer = ClassifierTrainer(dataset=(x, y), batch_size=32, lr=3e-3)
        segments, retrain, population, generations, steps = 1, 1, 2, 1, 2
    seed = args.seed
    strategies = {
        "SPOS": SPOS(train_segments=segments, search_population=population,
                     search_generations=generations, search_parents=max(2, population // 4),
                     eval_batches=2, calibrate_batches=2, seed=seed),
        "ENAS": ENAS(segments=segments, controller_steps=steps, eval_batches=1, seed=seed),
        "WeightSharing(Random)": WeightSharing(Random(seed=seed, dedup=False),
                                               segments=segments, eval_batches=1, seed=seed),
    }
    rows = []
    for name, strategy in strategies.items():
        sample, seconds, models = one_shot(strategy, space, trainer, device)
        rows.append({"method": name, "search_s": seconds, "models": models, "sample": sample})
        print(f"{name}: searched in {seconds:.1f} s", flush=True)
    budget = sum(r["search_s"] for r in rows) / len(rows)
    sample, seconds, models = multi_trial(space, trainer, device, budget, args.trial_epochs,
                                          seed)
    rows.append({"method": f"Random, multi-trial ({args.trial_epochs} epoch each)",
                 "search_s": seconds, "models": models, "sample": sample})
    for row in rows:
        row["retrained_val_acc"] = train_alone(space, trainer, row["sample"], retrain, device,
                                               seed)
        row["sample"] = json.dumps(row["sample"], sort_keys=True)
        row["device"] = device.type
        print(f"{row['method']:<38} search {row['search_s']:7.1f} s  {row['models']:5d} models "
              f" retrained {retrain} epochs: val_acc {row['retrained_val_acc']:.4f}", flush=True)
    sys.path.insert(0, HERE)
    from _out import pyplot, write_csv

    name = f"one_shot-{device.type}" + ("-quick" if args.quick else "")
    print("wrote", write_csv(rows, name))
    plt = pyplot()
    if plt is not None:
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
        labels = [r["method"].split(",")[0] for r in rows]
        a.bar(labels, [r["retrained_val_acc"] for r in rows])
        a.set_ylabel(f"val acc, retrained {retrain} epochs")
        b.bar(labels, [r["search_s"] for r in rows])
        b.set_ylabel("search seconds")
        for ax in (a, b):
            ax.tick_params(axis="x", labelrotation=20)
        fig.tight_layout()
        fig.savefig(os.path.join(HERE, "out", f"{name}.png"))


if __name__ == "__main__":
    main()
