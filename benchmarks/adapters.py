"""Benchmark: adapters on a frozen MobileNetV2, N models trained separately, grouped with CSE,
and grouped with CSE + operator batching (issue #13 item 1; paper §7.2.2, Fig. 14).

The space is ``model_spaces/adapters.py``: a MobileNetV2 (randomly initialised under a fixed
seed and frozen with ``rt.freeze``: no weight trains, its BatchNorms use their running
statistics) with one trainable residual adapter after the block the space chooses, and a
trainable classifier. Model i puts its adapter after block ``i * 17 // N`` (spread over the
17 blocks; several per block past 17 models). Synthetic images and labels (the paper uses
synthetic data too, so that shared data loading does not count).

Three ways, one after the other in this process, each through the engine's code (a
``TrialRun`` per model, as a worker trains it):

- **separate**: each model's epoch alone (``TrialRun.train_epoch``), model after model;
- **cse**: one grouped job's group (``TrainingGroup`` over ``plan_group(...)``): the backbone
  up to each adapter once, every later block once per model;
- **cse+batching**: the same with ``batch_ops=True`` (``Experiment(batching=True)``): every
  frozen layer and residual add past the adapters runs once on the concatenated inputs of the
  models that reach it.

It compares every model's metrics with separate training's (largest relative difference
printed: 0 at the default settings on this CPU; a warning above 1e-4: at some batch sizes a
batched kernel rounds one step's values differently, about 1e-6 relative, and ten steps of
training through 16 random frozen blocks can amplify that to percents; tests/test_adapters.py
proves equality of training within 1e-5), prints per N the time per training step of the N models
(the epoch's time over its batches: forward, backward and every optimizer step; CPU time of
this process on the CPU, with one torch thread, so other jobs on the machine do not count;
wall-clock on a GPU) and the ratios over separate training (issue targets: >= 3x at N = 8 on
the CPU; >= 3.5x at 192 on a GPU), and writes ``benchmarks/out/adapters-DEVICE.csv`` and
``.png``. On a GPU an N that runs out of memory ends the sweep: the largest N that fit is
reported.

Example::

    .venv/bin/python benchmarks/adapters.py                              # CPU: N = 4 8 16 32
    .venv/bin/python benchmarks/adapters.py --quick                      # seconds: a smoke run
    .venv/bin/python benchmarks/adapters.py --device cuda                # N = 4 ... 256, 224 px
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import retiarii as rt
from retiarii.engine.worker_side.group_candidates import plan_group
from retiarii.engine.worker_side.training_group import TrainingGroup
from retiarii.engine.trainers.trial_training import TrialRun

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # model_spaces/, beside retiarii
from model_spaces import adapters  # noqa: E402

WAYS = ("separate", "cse", "cse+batching")
# The targets: (device, N) -> ratio over separate training.
TARGETS = {("cpu", 8): 3.0, ("cuda", 192): 3.5}


def _trainer(args, steps: int) -> rt.Trainer:
    """SGD over ``steps`` batches of synthetic images and one small validation batch."""
    g = torch.Generator().manual_seed(1)
    n = steps * args.batch + args.batch
    x = torch.randn(n, 3, args.image, args.image, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return rt.Trainer(dataset=(x, y), batch_size=args.batch, epochs=1, optimizer="sgd",
                      lr=args.lr, val_fraction=args.batch / n)


def _block(i: int, n: int, blocks: int) -> int:
    """Model i's adapter block: spread over the blocks (several per block past ``blocks``)."""
    return i * blocks // n


def _runs(space, n: int, trainer, args) -> dict[str, TrialRun]:
    runs = {}
    for i in range(n):
        sample = {"block": _block(i, n, args.blocks)}
        runs[f"m{i}"] = TrialRun(lambda s=sample: space.build(s, check=False), trainer, {},
                                 seed=i, device=args.device, trial_id=f"m{i}")
    return runs


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(way: str, space, n: int, trainer, args) -> tuple[float, float, dict]:
    """(wall, CPU) seconds of one epoch of the N models, and each model's metrics."""
    device = args.device
    runs = _runs(space, n, trainer, args)
    group = None
    if way != "separate":
        plan = plan_group({t: space.replay({"block": _block(i, n, args.blocks)})
                           for i, t in enumerate(runs)}, trainer.data_key({}),
                          {t: {} for t in runs}, batch_ops=way == "cse+batching")
        group = TrainingGroup(plan.restrict(list(runs)), runs, trainer)
    _sync(device)
    start, cpu = time.perf_counter(), time.process_time()
    if group is None:
        metrics = {t: run.train_epoch() for t, run in runs.items()}
    else:
        metrics = group.train_epoch()
    _sync(device)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    failed = {t: m for t, m in metrics.items() if isinstance(m, Exception)}
    if failed:
        raise next(iter(failed.values()))
    return wall, cpu, metrics


def _difference(a: dict, b: dict) -> float:
    """The largest relative difference between two ways' metrics."""
    return max(abs(a[t][k] - b[t][k]) / max(abs(a[t][k]), 1e-12) for t in a for k in a[t])


def measure(n: int, space, args) -> dict:
    """One row: every way's time per step for N models (the least of ``--repeats`` epochs,
    after a warm-up epoch of two batches that builds the kernels' caches)."""
    warm, timed = _trainer(args, 2), _trainer(args, args.steps)
    row = {"device": args.device, "models": n, "width": args.width, "image": args.image,
           "batch": args.batch, "steps": args.steps}
    seconds, metrics = {}, {}
    for way in WAYS:
        _time(way, space, n, warm, args)
        best = None
        for _ in range(args.repeats):
            wall, cpu, metrics[way] = _time(way, space, n, timed, args)
            best = (wall, cpu) if best is None else (min(best[0], wall), min(best[1], cpu))
        seconds[way] = best
        row[f"{way}_ms_per_step"] = round(1000 * best[0] / args.steps, 2)
        row[f"{way}_cpu_ms_per_step"] = round(1000 * best[1] / args.steps, 2)
    clock = 1 if args.device == "cpu" else 0  # CPU time on the CPU, wall-clock on a GPU
    for way in WAYS[1:]:
        row[f"{way}_ratio"] = round(seconds["separate"][clock] / seconds[way][clock], 2)
        row[f"{way}_wall_ratio"] = round(seconds["separate"][0] / seconds[way][0], 2)
        diff = _difference(metrics["separate"], metrics[way])
        row[f"{way}_max_rel_diff"] = float(f"{diff:.2g}")
        if diff > 1e-4:  # a batched kernel rounds differently (below), or a real error
            print(f"N={n}: {way}'s metrics differ from separate training's by up to "
                  f"{diff:.2g} relative (see benchmarks/README.md: one step differs by float32 "
                  f"rounding at some batch sizes, and training amplifies it)", flush=True)
    target = TARGETS.get((args.device, n))
    row["target"] = target
    row["holds"] = None if target is None else row["cse+batching_ratio"] >= target
    row["load_avg_1min"] = round(os.getloadavg()[0], 2)
    return row


def _summary(row: dict) -> str:
    target = row["target"]
    verdict = "" if target is None else (f"  target >= {target}x: "
                                         f"{'holds' if row['holds'] else 'missed'}")
    unit = "CPU ms" if row["device"] == "cpu" else "ms"
    key = "_cpu_ms_per_step" if row["device"] == "cpu" else "_ms_per_step"
    return (f"{row['device']} N={row['models']:3d}  {unit}/step: separate {row['separate' + key]:8.1f}"
            f"  cse {row['cse' + key]:8.1f} ({row['cse_ratio']:.2f}x)  cse+batching "
            f"{row['cse+batching' + key]:8.1f} ({row['cse+batching_ratio']:.2f}x){verdict}  "
            f"wall ratios {row['cse_wall_ratio']:.2f}x / {row['cse+batching_wall_ratio']:.2f}x  "
            f"max rel metric diff {max(row['cse_max_rel_diff'], row['cse+batching_max_rel_diff']):.1g}"
            f"  load {row['load_avg_1min']}")


def _write(rows: list[dict], name: str, out: str | None) -> None:
    import _out  # benchmarks/: this script's folder

    if out is not None:
        _out.OUT = out
    path = _out.write_csv(rows, name)
    plt = _out.pyplot()
    if plt is None:
        print(f"wrote {path}")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ns = [r["models"] for r in rows]
    for way in WAYS[1:]:
        ax.plot(ns, [r[f"{way}_ratio"] for r in rows], marker="o", label=way)
    targets = [(r["models"], r["target"]) for r in rows if r["target"] is not None]
    if targets:
        ax.plot(*zip(*targets), ls="none", marker="x", color="red", label="target")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("models (an adapter after a different block of one frozen MobileNetV2)")
    ax.set_ylabel("speed-up over separate training" + (" (CPU time)" if rows[0]["device"] == "cpu"
                                                       else ""))
    ax.set_title(f"Adapters on a frozen MobileNetV2 ({rows[0]['device']}, "
                 f"{rows[0]['batch']} images of {rows[0]['image']} px per model)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(_out.OUT, f"{name}.png"), dpi=100)
    plt.close(fig)
    print(f"wrote {path} and .png")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--models", type=int, nargs="+",
                   help="N values (CPU: 4 8 16 32; cuda: 4 8 12 32 64 128 192 256)")
    p.add_argument("--width", type=int, help="width multiplier in percent (CPU 25, cuda 100)")
    p.add_argument("--image", type=int, help="image size (CPU 32, cuda 224)")
    p.add_argument("--batch", type=int, default=None, help="images per model and step "
                   "(CPU 16; cuda 8, the paper's)")
    p.add_argument("--steps", type=int, default=10, help="timed training steps per way")
    p.add_argument("--lr", type=float, default=1e-3,
                   help="SGD's (momentum 0.9): small, so that a one-ulp difference of a batched "
                        "kernel is not amplified by training through 17 random frozen blocks")
    p.add_argument("--repeats", type=int, help="timed epochs per way, the least counts "
                   "(CPU 2; cuda 1: a GPU is not shared, and 256 models build slowly)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: stable CPU time)")
    p.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    p.add_argument("--out", help="folder for the CSV and PNG (default benchmarks/out)")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    args.width = args.width or (100 if gpu else 25)
    args.image = args.image or (224 if gpu else 32)
    args.batch = args.batch or (8 if gpu else 16)
    args.repeats = args.repeats or (1 if gpu else 2)
    models = args.models or ([4, 8, 12, 32, 64, 128, 192, 256] if gpu else [4, 8, 16, 32])
    if args.quick:  # the small preset's 5 blocks, 2 and 4 models, 2 steps
        models, args.steps, args.repeats, args.image, args.batch = [2, 4], 2, 1, 16, 4
    torch.set_num_threads(args.threads)
    if args.quick:
        space = adapters.small()
    else:
        space = adapters.adapter_space(args.width, 10, args.image, 2, head=None if gpu else 320)
    args.blocks = space.size()  # one choice: the block
    rows = []
    for n in models:
        try:
            row = measure(n, space, args)
        except torch.cuda.OutOfMemoryError:
            print(f"cuda N={n}: out of memory; the largest N that fit: "
                  f"{rows[-1]['models'] if rows else 'none'}", flush=True)
            break
        finally:
            if gpu:
                torch.cuda.empty_cache()
        rows.append(row)
        print(_summary(row), flush=True)
    if not rows:
        raise SystemExit("no N ran")
    best = max(rows, key=lambda r: r["cse+batching_ratio"])
    print(f"largest N run: {rows[-1]['models']}; best cse+batching ratio "
          f"{best['cse+batching_ratio']:.2f}x at N={best['models']}")
    _write(rows, f"adapters-{args.device}" + ("-quick" if args.quick else ""), args.out)


if __name__ == "__main__":
    main()
