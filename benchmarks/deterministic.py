"""What deterministic mode costs: the demo search with and without ``deterministic=True``.

Runs the demo space (``retiarii run demo``'s space and default trainer, Random strategy,
``optimize=False`` so that every model trains alone) ``--rounds`` times in each mode,
alternating the modes so that a change in the machine's load falls on both, and prints each
search's wall time, the median per mode, their ratio, and whether the two modes gave the same
metrics (on a CPU they do: the same kernels run). On a GPU machine run it as it is (the
workers take the GPUs); ``--devices`` as ``Experiment(devices=...)`` (``[]``: CPU only).

Example::

    python benchmarks/deterministic.py --models 2 --epochs 1 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import retiarii as rt  # noqa: E402
from retiarii.engine.storage.store import Store  # noqa: E402
from retiarii.engine.trainers.trainer import ClassifierTrainer  # noqa: E402



def _metrics(db: str) -> dict:
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        return {json.dumps(t["spec"]["choices"], sort_keys=True): [
            store.learning_curve(t["id"], m) for m in ("train_loss", "val_loss", "val_acc")]
            for t in store.trials()}


def search(folder: str, name: str, deterministic: bool, args) -> tuple[float, dict]:
    """One demo search: (wall seconds, its metrics)."""
    db = os.path.join(folder, f"{name}.db")
    trainer = ClassifierTrainer(dataset="digits", epochs=args.epochs)  # the CLI default, shorter
    start = time.perf_counter()
    rt.Experiment("retiarii.demo:space", rt.strategies.Random(seed=0), trainer, store=db,
                  workers=args.workers, devices=args.devices, max_models=args.models, seed=0,
                  optimize=False, deterministic=deterministic).run()
    return time.perf_counter() - start, _metrics(db)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--devices", type=json.loads, default=None,
                   help="JSON list of GPU ids, [] for CPU only (default: every visible GPU)")
    args = p.parse_args()
    times: dict[bool, list[float]] = {False: [], True: []}
    metrics: dict[bool, dict] = {}
    same = {False: True, True: True}
    with tempfile.TemporaryDirectory() as folder:
        # untimed: the workers' start, CUDA's and cuDNN's first use (12 s of an H200's first
        # round against 2 s of the next; timing it put it all on the first mode)
        search(folder, "warm-up", False, args)
        for r in range(args.rounds):
            for mode in ((False, True) if r % 2 == 0 else (True, False)):
                seconds, got = search(folder, f"r{r}-{int(mode)}", mode, args)
                times[mode].append(seconds)
                if metrics.setdefault(mode, got) != got:
                    same[mode] = False
                    print(f"mode deterministic={mode}: round {r} differs from round 0"
                          + ("" if mode else " (a GPU's default kernels are not deterministic)"))
                print(f"round {r} deterministic={mode!s:5}  {seconds:7.1f} s", flush=True)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"\n{args.models} demo models x {args.epochs} epochs, {args.workers} workers, "
          f"{args.rounds} rounds: median {off:.1f} s default, {on:.1f} s deterministic, "
          f"ratio {on / off:.3f}; rounds identical: deterministic {same[True]}, default "
          f"{same[False]}; same metrics in both modes: {metrics[False] == metrics[True]}")


if __name__ == "__main__":
    main()
