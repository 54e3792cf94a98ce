"""Benchmark: a mixed-parallel one-shot search on Ray rank actors vs on local rank processes.

Issue #16 item 3 runs each segment of ``Experiment(..., ranks=K)`` on Ray as K rank actors in
one placement group (:mod:`retiarii.engine.executors.ray_ranks`) instead of K processes forked
on the worker's machine (:func:`retiarii.engine.executors.local_ranks.run_segment_on_ranks`). Both
give the same search (``tests/test_ray_ranks.py`` checks it bit for bit); this script measures
what the actors cost: each segment creates a placement group and K actors that import torch
and retiarii, where the local ranks fork from a warm forkserver.

One run, side by side: the SPOS search of ``benchmarks/one_shot_engine.py`` (its space on
digits, its strategy) with ``ranks=K`` through ``rt.Experiment`` on a warm one-worker
``LocalExecutor`` and on a warm one-worker ``RayExecutor`` (a private local Ray instance,
started first). Prints one line per configuration with the wall time per segment of each and
the ratio Ray / local, writes ``benchmarks/out/ray_ranks[-cuda].csv`` and a PNG beside it.

Example::

    .venv/bin/python benchmarks/ray_ranks.py                   # 2 and 4 training segments
    .venv/bin/python benchmarks/ray_ranks.py --quick           # seconds: a smoke test
    .venv/bin/python benchmarks/ray_ranks.py --device cuda     # ranks share the GPU (gloo)
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

import retiarii as rt
from retiarii.engine.executors.local import LocalExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import one_shot_engine as base  # noqa: E402  the space, trainer and strategy
from _out import pyplot, write_csv  # noqa: E402


def search(train_segments: int, ranks: int, executor, folder: str) -> tuple[float, dict]:
    """(wall seconds, selected architecture) of the search on ``executor``."""
    path = os.path.join(folder, f"run-{time.monotonic_ns()}.db")
    exp = rt.Experiment(base.space, base.strategy(train_segments), base.trainer, store=path,
                        seed=0, executor=executor, ranks=ranks)
    start = time.perf_counter()
    summary = exp.run()
    return time.perf_counter() - start, summary["one_shot"]["selected"]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one small configuration (seconds)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ranks", type=int, default=2, help="K")
    p.add_argument("--segments", type=int, nargs="+", default=[2, 4],
                   help="training segments of each configuration (SPOS adds its search)")
    p.add_argument("--rank-cpus", type=float, default=0.5,
                   help="logical CPUs per Ray slot and per rank (Ray's accounting)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    from retiarii.engine.executors.ray import RayExecutor, start_local_ray
    import ray

    # a GPU per rank when there are K (NCCL), else the ranks share one (gloo through the host)
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    rank_gpus = 0.0 if gpus == 0 else (1.0 if gpus >= args.ranks else 1.0 / (args.ranks + 1))
    temp_dir = start_local_ray(num_cpus=max(os.cpu_count() or 1,
                                            (args.ranks + 1) * args.rank_cpus),
                               num_gpus=gpus)
    folder = tempfile.mkdtemp(prefix="ray-ranks-bench-")
    rows = []
    local = LocalExecutor(1, None if args.device == "cuda" else [], threads_per_worker=1)
    on_ray = RayExecutor(1, num_cpus=args.rank_cpus, num_gpus=rank_gpus, threads_per_worker=1)
    try:
        local.wait_ready()
        on_ray.wait_ready()
        search(1, args.ranks, local, folder)  # warm: the forkserver, the data set
        for train_segments in [1] if args.quick else args.segments:
            segments = base.strategy(train_segments).num_segments()
            local_s, local_best = search(train_segments, args.ranks, local, folder)
            ray_s, ray_best = search(train_segments, args.ranks, on_ray, folder)
            row = {"device": args.device, "ranks": args.ranks, "segments": segments,
                   "local_s": round(local_s, 3), "ray_s": round(ray_s, 3),
                   "local_per_segment_s": round(local_s / segments, 3),
                   "ray_per_segment_s": round(ray_s / segments, 3),
                   "ratio": round(ray_s / local_s, 3),
                   "ray_overhead_per_segment_s": round((ray_s - local_s) / segments, 3),
                   "same_selection": local_best == ray_best, "load": _load()}
            rows.append(row)
            print(f"{args.device} K={args.ranks} {segments} segments: local ranks "
                  f"{local_s:.2f} s ({row['local_per_segment_s']:.2f} s/segment), Ray rank "
                  f"actors {ray_s:.2f} s ({row['ray_per_segment_s']:.2f} s/segment): "
                  f"{row['ratio']}x, +{row['ray_overhead_per_segment_s']:.2f} s per segment; "
                  f"same selection: {row['same_selection']}", flush=True)
    finally:
        local.close()
        on_ray.close()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
    name = "ray_ranks" + ("-cuda" if args.device == "cuda" else "") + \
        ("-quick" if args.quick else "")  # a smoke test keeps the real figures
    print("wrote", write_csv(rows, name))
    plt = pyplot()
    if plt is not None and not args.quick:
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in (("local_s", "local rank processes"), ("ray_s", "Ray rank actors")):
            ax.plot([r["segments"] for r in rows], [r[key] for r in rows], marker="o",
                    label=label)
        ax.set(xlabel="segments", ylabel="seconds",
               title=f"SPOS search, K={args.ranks} ({args.device})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(os.path.dirname(os.path.abspath(__file__)), "out",
                                 name + ".png"), dpi=100)
    return rows


def _load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return ""


if __name__ == "__main__":
    main()
