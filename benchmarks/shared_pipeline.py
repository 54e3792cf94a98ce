"""Benchmark: one data pipeline feeding N models (issue #12, paper Fig. 12: 3.41x at 8 models).

N small MobileNet-style CNNs (depthwise-separable blocks at a width multiplier <= 0.5) train
one epoch on JPEG files this script generates (``benchmarks/out/jpegs-<size>/``), decoded,
randomly resized-cropped, flipped and normalized by :class:`retiarii.ImageFolderTrainer`:
DataLoader worker processes (``--loader torch``) or an NVIDIA DALI pipeline (``dali``, when
installed: CPU decoding with ``device_id=None``, or ``mixed`` GPU decoding with ``--device
cuda``). Both ways run in this process, one after the other, on the same tasks:

- **separate**: each model in a job of its own (``worker.run_job``, the engine without
  cross-model optimization): N pipelines, each decoding every image once;
- **shared**: one job of the N tasks with ``meta["group"] = True``: one pipeline decodes each
  image once and every model trains on the batch (the data key is the same).

It checks that both ways give every model the same metrics (exactly on the CPU; within float
tolerance on a GPU, whose kernels are not bit-reproducible), then prints aggregate samples/s,
the ratio (separate time / shared time; issue target >= 0.75 N on the CPU, >= 4x at N = 8 on a
GPU) and CPU utilization (CPU time of this process and its reaped children, the DataLoader
workers, over wall time and cores), and writes ``benchmarks/out/shared_pipeline*.csv`` and
``.png``.

Example::

    .venv/bin/python benchmarks/shared_pipeline.py                     # N = 1, 2, 4, 8
    .venv/bin/python benchmarks/shared_pipeline.py --models 1 8 --loader torch --size 64
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import sys
import time

import torch
from torch import nn

import retiarii as rt
from retiarii.codec import ref_of
from retiarii.engine.trainers.data import dali_available, make_jpeg_folder
from retiarii.engine.jobs.job import Job, JobFailed, TrialResult, TrialTask
from retiarii.engine.worker_side.worker import WorkerContext, run_job

HERE = os.path.dirname(os.path.abspath(__file__))
# The space is read from this file anew by the worker code (run_job resolves "path:SPACE"),
# after main() has set the width in the environment.
WIDTH = float(os.environ.get("SHARED_PIPELINE_WIDTH", "0.25"))


def _c(channels: int) -> int:
    return max(8, int(channels * WIDTH))


class Separable(nn.Module):
    """A MobileNet block: depthwise k x k conv, BN, ReLU6, then pointwise conv, BN, ReLU6."""

    def __init__(self, cin: int, cout: int, stride: int, k: int = 3):
        super().__init__()
        self.dw = nn.Conv2d(cin, cin, k, stride, k // 2, groups=cin, bias=False)
        self.bn1 = nn.BatchNorm2d(cin)
        self.pw = nn.Conv2d(cin, cout, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.act = nn.ReLU6()

    def forward(self, x):  # (B, cin, H, W) -> (B, cout, H / stride, W / stride)
        return self.act(self.bn2(self.pw(self.act(self.bn1(self.dw(x))))))


class MobileNet(nn.Module):
    """MobileNet v1's layout, shortened to 6 blocks for small (24-64 px) inputs, 4 classes."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, _c(32), 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(_c(32)), nn.ReLU6())
        self.b1 = Separable(_c(32), _c(64), 1)
        self.b2 = Separable(_c(64), _c(128), 2)
        self.b3 = Separable(_c(128), _c(128), 1)
        self.b4 = Separable(_c(128), _c(256), 2)
        self.b5 = Separable(_c(256), _c(256), 1)
        self.b6 = Separable(_c(256), _c(512), 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(_c(512), classes)

    def forward(self, x):  # (B, 3, S, S) -> (B, classes)
        x = self.b6(self.b5(self.b4(self.b3(self.b2(self.b1(self.stem(x)))))))
        return self.fc(torch.flatten(self.pool(x), 1))


# The models differ in the depthwise kernel of two blocks (3 or 5) and in their seeds.
def _depthwise(channels: int) -> rt.mutators.OperatorMutator:
    return rt.mutators.OperatorMutator(
        {f"k{k}": nn.Conv2d(channels, channels, k, 1, k // 2, groups=channels, bias=False)
         for k in (3, 5)}, label="kernel")


SPACE = rt.ModelSpace(MobileNet(), [rt.apply_mutator("b3.dw", _depthwise(_c(128))),
                                    rt.apply_mutator("b5.dw", _depthwise(_c(256)))],
                      example_input=torch.randn(2, 3, 32, 32))
KERNELS = [("k3", "k3"), ("k5", "k3"), ("k3", "k5"), ("k5", "k5")]


def _tasks(n: int, trainer: dict) -> list[TrialTask]:
    return [TrialTask(f"m{i}", {"space": f"{os.path.abspath(__file__)}:SPACE", "trainer": trainer,
                                "sample": {"kernel/b3.dw": KERNELS[i % 4][0],
                                           "kernel/b5.dw": KERNELS[i % 4][1]},
                                "hparams": {}, "seed": i,
                                "checked": True},  # as the engine sends them
                      0, 1)
            for i in range(n)]


def _cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (DataLoader workers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _run(jobs: list[Job], context: WorkerContext) -> tuple[float, float, dict]:
    events: list = []
    cpu, start = _cpu_seconds(), time.perf_counter()
    for job in jobs:
        run_job(job, events.append, context=context)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    failed = [e for e in events if isinstance(e, JobFailed)]
    if failed:
        raise SystemExit(f"a benchmark job failed: {failed[0].error}")
    return seconds, cpu, {(e.trial_id, e.step): e.metrics for e in events if isinstance(e, TrialResult)}


def _compare(separate: dict, shared: dict, exact: bool) -> float:
    """The largest relative difference of a loss; asserts equality on the CPU, and on a GPU
    losses within 1e-3 and accuracies within 2% (a last-bit difference can flip a prediction)."""
    assert separate.keys() == shared.keys(), "both ways must report every model's epoch"
    if exact:
        assert separate == shared, "one shared pipeline must give every model its metrics alone"
        return 0.0
    worst = 0.0
    for key, metrics in separate.items():
        for name, value in metrics.items():
            if name.endswith("acc"):
                assert abs(value - shared[key][name]) <= 0.02, (key, name, value, shared[key][name])
            else:
                worst = max(worst, abs(value - shared[key][name]) / max(abs(value), 1e-12))
    assert worst < 1e-3, f"shared and separate losses differ by {worst:.2g} (relative)"
    return worst


def _profile(trainer: dict, n_train: int) -> tuple[float, float]:
    """CPU milliseconds per sample of (decoding one epoch alone, training one model on
    batches already decoded): what bounds the ratio (see main)."""
    rebuilt = WorkerContext().trainer(trainer)
    cpu = _cpu_seconds()
    batches = [(x.cpu(), y.cpu()) for x, y in rebuilt.train_dataloader({}, 0)]
    decode = _cpu_seconds() - cpu
    model = SPACE.build({"kernel/b3.dw": "k3", "kernel/b5.dw": "k3"}, check=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    cpu = _cpu_seconds()
    for x, y in batches:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    train = _cpu_seconds() - cpu
    return 1000 * decode / n_train, 1000 * train / n_train


def _images(args: argparse.Namespace) -> str:
    """The JPEG folder (generated once per --images/--size: the files are kept)."""
    root = os.path.join(HERE, "out", f"jpegs-{args.size}")
    stamp = os.path.join(root, "made.json")
    want = {"classes": 4, "per_class": args.images // 4, "size": args.size, "seed": 0}
    if not os.path.exists(stamp) or json.load(open(stamp)) != want:
        start = time.perf_counter()
        make_jpeg_folder(root, **want)
        with open(stamp, "w") as f:
            json.dump(want, f)
        print(f"wrote {args.images} JPEGs of {args.size}x{args.size} to {root} "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
    return root


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--images", type=int, default=2000, help="JPEGs, 4 classes (5%% held out)")
    p.add_argument("--size", type=int, default=256, help="side of the JPEG files, in pixels")
    p.add_argument("--crop", type=int, default=32, help="side of the crop the models see")
    p.add_argument("--width", type=float, default=0.25, help="MobileNet width multiplier (<= 0.5)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--loader", nargs="+", default=["torch", "dali"], choices=["torch", "dali"])
    p.add_argument("--device", choices=["cpu", "cuda"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--workers", type=int, default=2 if (os.cpu_count() or 2) <= 4 else 4,
                   help="DataLoader workers (and DALI threads) of each pipeline")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the training process on the CPU (the workers decode "
                        "on the other cores)")
    args = p.parse_args()
    if args.device == "cpu" and torch.cuda.is_available() \
            or float(os.environ.get("SHARED_PIPELINE_WIDTH", "nan")) != args.width:
        # The worker code reads the space (its width) from this file anew; a CPU run on a
        # GPU machine must not see the GPU (TrialRun picks the GPU when there is one).
        os.environ["SHARED_PIPELINE_WIDTH"] = str(args.width)
        if args.device == "cpu":
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]])
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU")
    torch.set_num_threads(args.threads)
    # the same convolution algorithms for the models alone and shared: their metrics can be
    # compared closely (CPU kernels are deterministic already)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    root = _images(args)
    loaders = []
    for loader in args.loader:
        if loader == "dali" and not dali_available():
            print("dali: skipped (NVIDIA DALI is not installed: pip install -e .[dali])")
        else:
            loaders.append(loader)
    context = WorkerContext()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{args.images} JPEGs {args.size}px -> crop {args.crop}, MobileNet width {args.width}, "
          f"batch {args.batch_size}, {args.device}, {cores} cores, {args.workers} workers, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for loader in loaders:
        trainer = {"class": ref_of(rt.ImageFolderTrainer), "config": {
            "dataset": root, "loader": loader, "num_workers": args.workers,
            "dali_threads": args.workers, "dali_device": "gpu" if args.device == "cuda" else "cpu",
            "image_size": args.crop, "batch_size": args.batch_size, "epochs": 1,
            "val_fraction": 0.05, "lr": 3e-3}}
        _run([Job("warm", _tasks(1, trainer))], context)  # imports, caches, the first pipeline
        train_images = args.images - round(args.images * 0.05)
        decode_ms, train_ms = _profile(trainer, train_images) if args.device == "cpu" else (None, None)
        if decode_ms is not None:
            # The shared pipeline saves N - 1 decodings of each image and nothing else: N models
            # alone cost N (d + m) CPU per sample, shared d + N m. That bounds the CPU-time ratio.
            print(f"{loader}: CPU per sample: decode + augment {decode_ms:.2f} ms, train one "
                  f"model {train_ms:.2f} ms: the CPU-time ratio is at most N (d + m) / (d + N m)",
                  flush=True)
        for n in args.models:
            tasks = _tasks(n, trainer)
            sep_s, sep_cpu, separate = _run([Job(f"alone-{t.trial_id}", [t]) for t in tasks], context)
            sh_s, sh_cpu, shared = _run([Job("shared", tasks, meta={"group": True})], context)
            worst = _compare(separate, shared, exact=args.device == "cpu")
            ratio = sep_s / sh_s
            # the targets: >= 0.75 N at N = 2, 4, 8 on the CPU, >= 4x at N = 8 on a GPU
            target = (0.75 * n if n > 1 else None) if args.device == "cpu" else (4.0 if n == 8 else None)
            row = {"loader": loader, "device": args.device, "models": n,
                   "separate_s": round(sep_s, 2), "shared_s": round(sh_s, 2),
                   "separate_samples_per_s": round(n * train_images / sep_s),
                   "shared_samples_per_s": round(n * train_images / sh_s),
                   "ratio": round(ratio, 2),
                   "separate_cpu_util": round(sep_cpu / sep_s / cores, 2),
                   "shared_cpu_util": round(sh_cpu / sh_s / cores, 2),
                   "cpu_time_ratio": round(sep_cpu / sh_cpu, 2),
                   "cpu_time_bound": None if decode_ms is None else round(
                       n * (decode_ms + train_ms) / (decode_ms + n * train_ms), 2),
                   "target": target, "holds": None if target is None else ratio >= target,
                   "max_rel_diff": worst, "load_avg": round(os.getloadavg()[0], 2),
                   # after one epoch; chance is 0.25 (4 classes)
                   "mean_val_acc": round(sum(m["val_acc"] for m in shared.values()) / n, 3)}
            rows.append(row)
            print(f"{loader:5s} N={n}  separate {sep_s:6.2f} s ({row['separate_samples_per_s']:5d} "
                  f"samples/s, CPU {row['separate_cpu_util']:.0%})  shared {sh_s:6.2f} s "
                  f"({row['shared_samples_per_s']:5d} samples/s, CPU {row['shared_cpu_util']:.0%})"
                  f"  ratio {ratio:5.2f}x (CPU time {row['cpu_time_ratio']:.2f}x, bound "
                  f"{row['cpu_time_bound']})" + ("" if target is None else
                                              f"  (target >= {target:.2f}x: "
                                              f"{'holds' if ratio >= target else 'missed'})"),
                  flush=True)
    if not rows:
        raise SystemExit("no loader to measure")
    _write(rows, args)


def _write(rows: list[dict], args: argparse.Namespace) -> None:
    out = os.path.join(HERE, "out")
    os.makedirs(out, exist_ok=True)
    name = f"shared_pipeline-{args.device}-{args.size}px-w{args.width}"
    with open(os.path.join(out, name + ".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    for loader in dict.fromkeys(r["loader"] for r in rows):
        mine = [r for r in rows if r["loader"] == loader]
        ax.plot([r["models"] for r in mine], [r["ratio"] for r in mine], marker="o",
                label=f"shared / separate ({loader})")
    ns = sorted({r["models"] for r in rows})
    if args.device == "cpu":
        ax.plot(ns, [0.75 * n for n in ns], ls="--", label="target 0.75 N")
    ax.set(xlabel="models", ylabel="throughput ratio",
           title=f"One pipeline for N models ({args.device}, {args.size}px JPEGs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, name + ".png"), dpi=100)
    print(f"wrote {out}/{name}.csv and .png")


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
