"""Benchmark: a super-graph split over the ranks vs held whole by every rank (issue #14 item 5;
paper §5.2: super-graphs too large for one GPU are spread over several, one per device).

SPOS on K ranks (``--ranks``, gloo on the CPU) over a space of ``--layers`` choice blocks of
four candidates (3x3, 5x5 and 7x7 convolutions with BatchNorm, and a skip) of ``--width``
channels on the 8x8 digits (``ClassifierTrainer``: SGD with momentum, batch 32), two ways,
from the same initial weights:

- **replicated**: plain mixed parallelism, every rank holds the whole super-graph;
- **split**: ``device_memory`` = ``--fraction`` of the super-graph's bytes (weights, gradients
  and optimizer state), so no rank can hold it: the packing code cuts each segment into
  windows of models per rank (:mod:`retiarii.optim.split`) and weights move between windows.

Per way: seconds per training segment (an epoch; the first is not timed), the bytes of shared
weights the largest rank holds at most, the number of windows, and the mean validation
accuracy of the SPOS search's candidates afterwards (inherited weights, BatchNorm
recalibrated). The split trains other models on each rank than the replicated run (the
assignment changes, not the models drawn), so accuracies agree within noise, not exactly.
Prints one line per way and the ratios; writes ``benchmarks/out/split_supergraph-DEVICE.csv``.

Example::

    .venv/bin/python benchmarks/split_supergraph.py              # K = 2, CPU
    .venv/bin/python benchmarks/split_supergraph.py --quick      # seconds: a smoke test
    .venv/bin/python benchmarks/split_supergraph.py --device cuda --ranks 2
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import retiarii as rt  # noqa: E402 (the checkout's, beside benchmarks/)
from retiarii.engine.trainers.trainer import ClassifierTrainer, load_dataset  # noqa: E402
from retiarii.engine.executors.local_ranks import run_segment_on_ranks  # noqa: E402
from retiarii.strategies import SPOS  # noqa: E402
from retiarii.strategies.one_shot.base import SegmentContext  # noqa: E402

WAYS = ["replicated", "split"]


@dataclass(frozen=True)
class Config:
    ranks: int = 2
    width: int = 48
    layers: int = 4
    batch: int = 32
    segments: int = 10  # training segments (epochs); the first is not timed
    fraction: float = 0.7  # device_memory as a fraction of the whole super-graph's bytes
    population: int = 8  # candidates the search evaluates (one generation)
    train_limit: int | None = None  # examples (None: the whole training split)
    device: str = "cpu"
    seed: int = 0


def _conv(c: int, k: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(c, c, k, padding=k // 2, bias=False), nn.BatchNorm2d(c),
                         nn.ReLU())


class Net(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU())
        self.blocks = nn.ModuleList([
            rt.LayerChoice({"k3": _conv(width, 3), "k5": _conv(width, 5), "k7": _conv(width, 7),
                            "skip": nn.Identity()}, label=f"block{i}") for i in range(layers)])
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


def _trainer(cfg: Config) -> ClassifierTrainer:
    """Digits (the first ``train_limit`` images when given), SGD with momentum."""
    data = "digits"
    if cfg.train_limit is not None:
        x, y = load_dataset("digits")
        data = (x[:cfg.train_limit], y[:cfg.train_limit])
    return ClassifierTrainer(dataset=data, batch_size=cfg.batch, optimizer="sgd", lr=0.05,
                             momentum=0.9)


def _space(cfg: Config) -> rt.ModelSpace:
    torch.manual_seed(cfg.seed)
    return rt.ModelSpace(Net(cfg.width, cfg.layers), example_input=torch.randn(2, 1, 8, 8))


def build(cfg: Config, segment: int, memory: float | None):
    """One rank's SPOS and context (module level: the ranks unpickle it)."""
    device = torch.device(cfg.device)
    spos = SPOS(train_segments=cfg.segments, search_population=cfg.population,
                search_generations=1, eval_batches=None, calibrate_batches=4, seed=cfg.seed)
    trainer = _trainer(cfg)
    spos.setup(_space(cfg), trainer, {}, device)
    return spos, SegmentContext(segment, trainer, {}, device, device_memory=memory)


def _whole_bytes(cfg: Config) -> int:
    """Bytes of every operator of the space (weights, gradients, SGD momentum)."""
    from retiarii.optim.supergraph import SuperGraph
    from retiarii.strategies.one_shot.split_training import optimizer_slots

    space = _space(cfg)
    sg = SuperGraph(space)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    ops = {}
    for model in space.enumerate() if cfg.layers <= 4 else []:
        ops.update(sg.ops_of(model.sample))
    return sum(sg.training_bytes(op, optimizer_slots(opt)) for op in ops.values())


def run(cfg: Config) -> list[dict]:
    whole = _whole_bytes(cfg)
    rows = []
    for way in WAYS:
        memory = None if way == "replicated" else cfg.fraction * whole
        state, times, peak, windows = None, [], 0, 0
        for segment in range(cfg.segments + 1):  # the last is the search
            start = time.perf_counter()
            result, state = run_segment_on_ranks(functools.partial(build, cfg, segment, memory),
                                                 state, cfg.ranks)
            if segment < cfg.segments:
                if segment > 0:
                    times.append(time.perf_counter() - start)
                peak = max(peak, int(result.metrics.get("held_bytes", whole)))
                windows = max(windows, int(result.metrics.get("windows", 1)))
        accs = [m.metrics["val_acc"] for m in result.models]
        rows.append({"way": way, "device": cfg.device, "ranks": cfg.ranks, "width": cfg.width,
                     "layers": cfg.layers, "whole_bytes": whole,
                     "device_memory": "" if memory is None else int(memory),
                     "peak_held_bytes": peak, "windows_per_segment": windows,
                     "s_per_segment": round(sum(times) / max(len(times), 1), 4),
                     "mean_val_acc": round(sum(accs) / len(accs), 4),
                     "load_avg_1min": round(os.getloadavg()[0], 2)})
    base = rows[0]
    for row in rows:
        row["time_vs_replicated"] = round(row["s_per_segment"] / base["s_per_segment"], 3)
        row["memory_vs_replicated"] = round(row["peak_held_bytes"] / base["peak_held_bytes"], 3)
        print(f"{cfg.device} K={cfg.ranks} {row['way']:10}: {row['s_per_segment']:7.3f} s/segment "
              f"({row['time_vs_replicated']:.2f}x), largest rank holds {row['peak_held_bytes']} "
              f"bytes ({row['memory_vs_replicated']:.2f}x) in {row['windows_per_segment']} "
              f"windows, mean val_acc {row['mean_val_acc']:.4f}; load "
              f"{row['load_avg_1min']:.1f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Config()
    p.add_argument("--ranks", type=int, default=d.ranks)
    p.add_argument("--width", type=int, default=d.width)
    p.add_argument("--layers", type=int, default=d.layers, help="at most 4 (bytes counted "
                   "over every model of the space)")
    p.add_argument("--segments", type=int, default=d.segments)
    p.add_argument("--fraction", type=float, default=d.fraction)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--quick", action="store_true", help="seconds: a tiny net and data")
    args = p.parse_args(argv)
    cfg = Config(ranks=args.ranks, width=args.width, layers=args.layers, segments=args.segments,
                 fraction=args.fraction, device=args.device)
    if args.quick:
        cfg = Config(**{**asdict(cfg), "width": 8, "layers": 2, "segments": 2, "population": 2,
                        "fraction": max(cfg.fraction, 0.75),
                        "train_limit": 8 * cfg.batch * cfg.ranks})
    rows = run(cfg)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _out import write_csv

    print("wrote", write_csv(rows, f"split_supergraph-{cfg.device}"))
    return rows


if __name__ == "__main__":
    main()
