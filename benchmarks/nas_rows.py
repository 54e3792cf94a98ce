"""NAS rows searched then retrained, against random architectures retrained alike (#31 item 3).

For each row and seed: ``retiarii.nas_retrain.search_and_retrain`` (the row's search, then
its selection retrained from scratch with the row's recipe), and one random architecture of
the same space retrained from scratch with the same recipe and epochs (DARTS: a random cell
DARTS could derive, ``model_spaces.darts.genotype_sample``). Writes one CSV line per (row,
seed) and prints whether the selection beats the random sample on average over the seeds,
then every pair pooled with a sign test (on digits most architectures of these spaces retrain
to within a few images of each other: one row's seeds cannot separate them, all rows can).

    nice -n 10 python benchmarks/nas_rows.py --seeds 1 --first-seed 0 --out seed0.csv
    python benchmarks/nas_rows.py summarize seed0.csv seed1.csv seed2.csv

``--rows`` defaults to every image row (``images``); the sequence rows have no floor.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# the rows whose task is not an image (digit rows read as sequences or tokens): no floor
SEQUENCE_ROWS = ("enas_rnn", "darts_rnn", "textnas")
FIELDS = ["row", "seed", "search_s", "search_models", "search_epochs", "retrain_epochs",
          "retrain_seeds",
          "selected_val_acc", "random_val_acc", "retrain_s", "selected_sample"]


def random_sample(name: str, seed: int) -> dict:
    """A random architecture of row ``name``'s space (DARTS: a derivable cell)."""
    from retiarii import nas

    if name == "darts":
        from model_spaces import darts

        return darts.genotype_sample(random.Random(seed))
    return dict(nas.build_space(name, "small").random_sample(seed=seed).sample)


def run_row(name: str, seed: int, args, folder: str) -> dict:
    from retiarii import nas, nas_retrain

    row = nas.get(name)
    store = os.path.join(folder, f"{name}-{seed}.db")
    result = None
    if not args.random_only:
        result = nas_retrain.search_and_retrain(
            name, max_models=None if row.one_shot else args.max_models,
            epochs=args.search_epochs, retrain_epochs=args.retrain_epochs, store=store,
            workers=args.workers, seed=seed, retrain_seeds=args.retrain_seeds)
    start = time.time()
    settings = {"name": name, "preset": "small", "store": os.path.join(folder, f"r-{name}-{seed}.db"),
                "search_experiment": None, "model": None, "sample": random_sample(name, seed),
                "value": None, "retrain_epochs": args.retrain_epochs, "workers": args.workers,
                "seed": seed, "retrain_seeds": args.retrain_seeds}
    exp = nas_retrain.retrain_experiment(settings)
    exp.run()
    best = nas_retrain.runs_mean(nas_retrain.run_metrics(
        exp.path, exp.store.experiment_id)).get("val_acc")  # the runs' mean
    print(result.line() if result else f"{name} seed {seed}", f"| random retrained: {best}",
          flush=True)
    line = {"row": name, "seed": seed, "search_s": None, "search_models": None,
            "search_epochs": None, "retrain_epochs": args.retrain_epochs,
            "retrain_seeds": args.retrain_seeds,
            "selected_val_acc": None, "random_val_acc": best,
            "retrain_s": round(time.time() - start, 1), "selected_sample": None}
    if result:  # the selection kept, so that it can be retrained again without its search
        line.update({"search_s": round(result.search_seconds, 1),
                     "search_models": result.search_models,
                     "search_epochs": args.search_epochs,
                     "selected_val_acc": result.retrained.get("val_acc"),
                     "selected_sample": json.dumps(result.selected, sort_keys=True)})
    return line


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=["images"],
                        help="row names, or 'images' for every image row (issue #31's floor)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0,
                        help="seeds FIRST .. FIRST + SEEDS - 1 (a long run split over calls)")
    parser.add_argument("--search-epochs", type=int, default=4,
                        help="a one-shot row's segments, a multi-trial row's epochs per model")
    parser.add_argument("--max-models", type=int, default=None,
                        help="multi-trial rows (default: the row's, nas.MODELS or 8)")
    parser.add_argument("--retrain-epochs", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--retrain-seeds", type=int, default=1,
                        help="runs of every retraining, the selection's and the random "
                             "sample's, each figure their mean (one run's val_acc moves by "
                             "about 2 images of 359 with its seed)")
    parser.add_argument("--random-only", action="store_true",
                        help="retrain only the random samples of the seeds (more of them for "
                             "the rows' random mean; no search)")
    parser.add_argument("--out", default=None, help="CSV file (default: stdout only)")
    args = parser.parse_args(argv)
    if args.rows == ["images"]:
        from retiarii import nas

        args.rows = [r.name for r in nas.ROWS if r.name not in SEQUENCE_ROWS]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.rows:
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                rows.append(run_row(name, seed, args, folder))
                if args.out:  # written as it goes: a long run keeps what it measured
                    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                    with open(args.out, "w", newline="") as f:
                        writer = csv.DictWriter(f, FIELDS)
                        writer.writeheader()
                        writer.writerows(rows)
    summarize(rows)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per row over its seeds: the mean retrained accuracy of the selection and of the
    random samples (every random sample of the row: a ``--random-only`` run adds more), the
    selection's worst, the gap with its standard error, and the floor (#31 item 3: every
    selection retrained >= 0.9, and the selections beat the random samples on average)."""
    import statistics

    out = []
    for name in dict.fromkeys(r["row"] for r in rows):
        mine = [r for r in rows if r["row"] == name]
        sel = [float(r["selected_val_acc"]) for r in mine if r["selected_val_acc"] not in (None, "")]
        rnd = [float(r["random_val_acc"]) for r in mine if r["random_val_acc"] not in (None, "")]
        if not sel or not rnd:
            continue
        line = {"row": name, "seeds": len(sel), "random_samples": len(rnd),
                "selected": sum(sel) / len(sel), "random": sum(rnd) / len(rnd),
                "min_selected": min(sel)}
        line["gap"] = line["selected"] - line["random"]
        # the gap's standard error (None until each side has 2 values)
        line["gap_se"] = ((statistics.variance(sel) / len(sel) + statistics.variance(rnd)
                           / len(rnd)) ** 0.5) if len(sel) > 1 and len(rnd) > 1 else None
        # above by more than rounding: the metrics are float32 values of k / 359, so means of
        # the same images over 3 and over 6 values can differ by 1e-8
        line["floor"] = line["min_selected"] >= 0.9 and line["gap"] > 1e-6
        out.append(line)
        se = f" ± {line['gap_se']:.4f} s.e." if line["gap_se"] is not None else ""
        print(f"{name}: selected {line['selected']:.4f} over {len(sel)} seeds vs random "
              f"{line['random']:.4f} over {len(rnd)} samples (gap {line['gap']:+.4f}{se}); "
              f"min selected {line['min_selected']:.4f}; floor "
              f"{'met' if line['floor'] else 'NOT met'}")
    pooled = sign_test(rows)
    if pooled["pairs"]:
        print(f"all rows: {pooled['pairs']} (row, seed) pairs, the selection above its random "
              f"sample in {pooled['wins']}, tied in {pooled['ties']}, below in "
              f"{pooled['losses']}; sign test over the untied, two-sided p = {pooled['p']:.2g}")
    return out


def sign_test(rows: list[dict]) -> dict:
    """Every (row, seed) pair pooled: how often the selection retrained above, level with or
    below its random sample, and the exact two-sided sign test's p-value over the untied
    pairs (the chance of a split at least this uneven if selection and random sample were
    exchangeable). One row's 3 seeds cannot tell 1-2 images of 359 from noise; 24 rows can."""
    from math import comb

    diffs = [float(r["selected_val_acc"]) - float(r["random_val_acc"]) for r in rows
             if r["selected_val_acc"] not in (None, "") and r["random_val_acc"] not in (None, "")]
    wins, losses = sum(d > 1e-9 for d in diffs), sum(d < -1e-9 for d in diffs)
    n, k = wins + losses, min(wins, losses)
    p = min(1.0, 2 * sum(comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0
    return {"pairs": len(diffs), "wins": wins, "ties": len(diffs) - n, "losses": losses, "p": p}


if __name__ == "__main__":
    if sys.argv[1:2] == ["summarize"]:  # summarize A.csv B.csv ...: runs split over calls
        summarize([r for path in sys.argv[2:] for r in csv.DictReader(open(path))])
    else:
        main()
