"""Benchmark: DARTS, GumbelDARTS and ProxylessNAS on the DARTS cell space (digits) vs random
search with the same wall-clock budget (issue #14, "one-shot search quality and cost").

For each differentiable strategy, in this process: the search (``--epochs`` epochs of bilevel
training of the relaxation of ``model_spaces.darts.small()``, batch ``--batch``), timed, with
its time per step (one architecture step + one weight step) and, on a GPU, its peak memory
(ProxylessNAS' point: one path's activations instead of every candidate's); then the selected
architecture **retrained alone** from scratch for ``--retrain-epochs`` and its validation
accuracy. The baseline: random search given the same budget as the search (setup, search and
retraining; CPU time of this process on a CPU, so that other load on the machine does not
move the comparison; wall clock on a GPU), each
sampled model trained alone for ``--retrain-epochs`` and the best validation accuracy kept
(a model started before the budget runs out finishes). Everything is on the digits split of
``ClassifierTrainer`` (1437 training, 360 validation images), seeds fixed.

It prints one line per configuration and writes ``benchmarks/out/differentiable-DEVICE.csv``
(+ ``.png``: validation accuracy per strategy, one-shot vs random).

Example::

    .venv/bin/python benchmarks/differentiable.py --quick            # a few seconds' smoke run
    .venv/bin/python benchmarks/differentiable.py --epochs 2
    .venv/bin/python benchmarks/differentiable.py --device cuda --epochs 10 --retrain-epochs 20
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from _out import pyplot, write_csv  # noqa: E402

from model_spaces import darts  # noqa: E402
from retiarii.engine.trainers.trainer import ClassifierTrainer  # noqa: E402
from retiarii.strategies import DARTS, GumbelDARTS, ProxylessNAS, SegmentContext  # noqa: E402

STRATEGIES = {
    "darts": lambda e, s: DARTS(epochs=e, seed=s),
    "gumbel": lambda e, s: GumbelDARTS(epochs=e, seed=s),
    "proxyless": lambda e, s: ProxylessNAS(epochs=e, seed=s),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(device: torch.device):
    """The budget's clock: CPU time of this process on a CPU, wall clock on a GPU."""
    return time.perf_counter if device.type == "cuda" else time.process_time


def train_alone(space, sample: dict, trainer, epochs: int, device: torch.device,
                batches: int | None, seed: int) -> float:
    """Validation accuracy of ``sample`` built fresh and trained alone for ``epochs``."""
    torch.manual_seed(seed)
    net = space.build(sample).to(device)
    opt = trainer.configure_optimizers(net, {})
    opt = opt[0] if isinstance(opt, tuple) else opt
    for epoch in range(epochs):
        net.train()
        for x, y in trainer.train_dataloader({}, epoch)[:batches]:
            opt.zero_grad(set_to_none=True)
            loss = trainer.training_step(net, (x.to(device), y.to(device)), {})
            loss.backward()
            opt.step()
    net.eval()
    right = total = 0
    with torch.no_grad():
        for x, y in trainer.val_dataloader({}):
            right += int((net(x.to(device)).argmax(1) == y.to(device)).sum())
            total += len(y)
    return right / total


def search(name: str, space, trainer, args, device: torch.device) -> dict:
    strategy = STRATEGIES[name](args.epochs, args.seed)
    clock = _clock(device)
    _sync(device)
    t0 = clock()
    strategy.setup(space, trainer, {}, device)
    setup_s = clock() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps = 0
    t1, w1 = clock(), time.perf_counter()
    for seg in range(args.epochs):
        batches = trainer.train_dataloader({}, seg)[:args.batches]
        result = strategy.run_segment(SegmentContext(seg, trainer, {}, device, train=batches))
        steps += result.metrics["train_batches"]
    _sync(device)
    train_s, wall_s = clock() - t1, time.perf_counter() - w1
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 20 if device.type == "cuda" else ""
    sample = strategy.selected()
    return {"strategy": name, "setup_s": round(setup_s, 2), "search_s": round(train_s, 2),
            "search_wall_s": round(wall_s, 2),
            "s_per_step": round(train_s / max(1, steps), 4), "peak_mem_mib": peak,
            "supernet_val_acc": round(result.metrics["val_acc"], 4), "sample": sample}


def random_search(space, trainer, budget_s: float, args, device: torch.device) -> dict:
    rng = random.Random(args.seed)
    best, models = 0.0, 0
    clock = _clock(device)
    t0 = clock()
    while clock() - t0 < budget_s or models == 0:
        sample = space.random_sample(rng.randrange(2 ** 31)).sample
        best = max(best, train_alone(space, sample, trainer, args.retrain_epochs, device,
                                     args.batches, args.seed))
        models += 1
    return {"models": models, "best_val_acc": round(best, 4),
            "random_s": round(clock() - t0, 2)}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES),
                        choices=list(STRATEGIES))
    parser.add_argument("--epochs", type=int, default=2, help="search epochs")
    parser.add_argument("--retrain-epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=None,
                        help="at most this many training batches per epoch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true",
                        help="1 epoch of 2 batches, retrain 1 epoch of 2 batches: a smoke test")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.retrain_epochs, args.batches = 1, 1, 2
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    space = darts.small()
    trainer = ClassifierTrainer(dataset="digits", batch_size=args.batch, lr=3e-3, seed=args.seed)
    rows = []
    for name in args.strategies:
        row = search(name, space, trainer, args, device)
        clock = _clock(device)
        t0 = clock()
        row["retrained_val_acc"] = round(train_alone(space, row.pop("sample"), trainer,
                                                     args.retrain_epochs, device, args.batches,
                                                     args.seed), 4)
        row["retrain_s"] = round(clock() - t0, 2)
        budget = row["setup_s"] + row["search_s"] + row["retrain_s"]
        row.update(random_search(space, trainer, budget, args, device))
        row.update({"device": device.type, "epochs": args.epochs, "batch": args.batch,
                    "retrain_epochs": args.retrain_epochs})
        rows.append(row)
        mem = f", peak {row['peak_mem_mib']:.0f} MiB" if row["peak_mem_mib"] != "" else ""
        unit = "s" if device.type == "cuda" else "CPU s"
        print(f"{name:9s} search {row['search_s']:7.1f} s ({row['s_per_step']:.3f} s/step{mem}, "
              f"wall {row['search_wall_s']:.0f} s),"
              f" selected retrained: val_acc {row['retrained_val_acc']:.3f} | random search, "
              f"same budget ({budget:.0f} {unit}): {row['models']} models, best "
              f"{row['best_val_acc']:.3f}", flush=True)
    path = write_csv(rows, f"differentiable-{device.type}")
    print("wrote", path)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["retrained_val_acc"] for r in rows], 0.4,
               label="one-shot, selected model retrained")
        ax.bar([x + 0.2 for x in xs], [r["best_val_acc"] for r in rows], 0.4,
               label="random search, same budget")
        ax.set_xticks(list(xs), [r["strategy"] for r in rows])
        ax.set_ylabel("validation accuracy (digits)")
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(path[:-4] + ".png", dpi=120)
    return rows


if __name__ == "__main__":
    main()
