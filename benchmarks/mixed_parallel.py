"""Benchmark: mixed parallelism vs data parallelism for weight-sharing training (issue #14;
paper §7.4, Fig. 17: 8.58x over SyncBN data parallelism on 8 GPUs, the same accuracy).

An SPOS-like super-net on the 8x8 digits: a stem, ``--layers`` choice blocks of four
candidates (3x3 and 5x5 convolutions, 3x3 and 5x5 depthwise-separable ones, every one with
BatchNorm, residual), global pooling and a linear head. K ranks (``--ranks``, gloo on the CPU)
train it for ``--epochs`` epochs, five ways, from the same initial weights (but one):

- **mixed** (ours, :mod:`retiarii.optim.mixed_parallel`): per step each rank trains its own
  sampled path on its own batch of B (``--batch``), then :func:`average_used_gradients`;
  BatchNorm per rank. An epoch is N / (K B) steps.
- **mixed_supergraph**: the same on retiarii's :class:`~retiarii.optim.supergraph.SuperGraph`
  of the same super-net written as a model space (``SpaceNet``: a LayerChoice per block), each
  rank building every rank's path; its initial weights are the super-graph's own (seeded per
  operator), so its accuracy differs from mixed's by the initialization only. The DDP ways
  below need one fixed module, the hand-written one.
- **ddp_syncbn**: DDP (``find_unused_parameters=True``) of the whole super-net, every rank
  the SAME sampled path per step, the batch of B split over the ranks (B / K each), BatchNorm
  synchronized across ranks (``nn.SyncBatchNorm`` on NCCL; on gloo, where PyTorch has none,
  ``_GlooSyncBN`` below: the same two all-reduces per layer and step). N / B steps.
- **ddp**: the same without SyncBN (each rank normalizes its B / K examples).
- **ddp_kbatch**: DDP with a K-times batch (B per rank) and a K-times learning rate: N / (K B)
  steps.

Every way sees each training image once per epoch with the same SGD (momentum 0.9, learning
rate ``--lr`` per batch of B). Time per epoch is measured on rank 0 between barriers, and CPU
time per epoch summed over the ranks' processes (less moved by other jobs on shared cores),
the first epoch (warm-up) left out. Then rank 0 evaluates ``--eval-paths`` sampled paths (the same for
every way) on the validation split with inherited weights, each after recomputing its
BatchNorm statistics on training batches (as SPOS does), and reports their mean accuracy.
Prints one line per way with its ratio (its time / mixed's time), writes
``benchmarks/out/mixed_parallel-DEVICE-kK.csv`` and ``.png``.

Example::

    .venv/bin/python benchmarks/mixed_parallel.py                  # K = 2, CPU, gloo
    .venv/bin/python benchmarks/mixed_parallel.py --quick          # seconds: a smoke test
    .venv/bin/python benchmarks/mixed_parallel.py --device cuda --ranks 2   # NCCL if 2 GPUs
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import retiarii as rt
from retiarii.engine.trainers.trainer import load_dataset
from retiarii.engine.executors.local_ranks import spawn
from retiarii.optim.mixed_parallel import average_used_gradients
from retiarii.optim.supergraph import SuperGraph

WAYS = ["mixed", "mixed_supergraph", "ddp_syncbn", "ddp", "ddp_kbatch"]
CANDIDATES = 4


@dataclass
class Config:
    ranks: int = 2  # K: the paper's figure is 8 GPUs; 2 ranks fit the 2-core CPU
    batch: int = 32  # B per model and step (the paper: 256 per model, 32 per GPU for DP)
    lr: float = 0.05  # per batch of B; ddp_kbatch scales it by K, as its practice does
    epochs: int = 10  # the first is warm-up, not timed; at 4 the fewer steps of mixed and
    # ddp_kbatch (N / (K B) per epoch) still cost accuracy, at 10 mixed matches SyncBN DDP
    width: int = 32  # channels of every block
    layers: int = 4  # choice blocks: 4 ** layers paths
    eval_paths: int = 16  # sampled paths whose validation accuracy is averaged
    calib_batches: int = 8  # training batches (of 64) that recompute a path's BN statistics
    train_limit: int = 0  # use only this many training images (0: all); --quick sets it
    device: str = "cpu"
    backend: str = "gloo"
    seed: int = 0


# ---- the super-net ------------------------------------------------------------------------


def _candidate(kind: int, c: int, bn: type) -> nn.Module:
    if kind < 2:  # a full 3x3 or 5x5 convolution
        k = 3 if kind == 0 else 5
        return nn.Sequential(nn.Conv2d(c, c, k, padding=k // 2, bias=False), bn(c), nn.ReLU())
    k = 3 if kind == 2 else 5  # depthwise-separable 3x3 or 5x5
    return nn.Sequential(nn.Conv2d(c, c, k, padding=k // 2, groups=c, bias=False), bn(c),
                         nn.Conv2d(c, c, 1, bias=False), bn(c), nn.ReLU())


class SuperNet(nn.Module):
    """Digits (B, 1, 8, 8) -> (B, 10); ``path`` picks one of four candidates per block."""

    def __init__(self, width: int, layers: int, bn: type = nn.BatchNorm2d):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1, bias=False), bn(width),
                                  nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.ModuleList(_candidate(k, width, bn) for k in range(CANDIDATES))
            for _ in range(layers))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor, path: tuple[int, ...]) -> torch.Tensor:
        x = self.stem(x)  # (B, 1, 8, 8) -> (B, C, 8, 8)
        for block, choice in zip(self.blocks, path):
            x = x + block[choice](x)
        return self.head(x.mean((2, 3)))  # (B, C, 8, 8) -> (B, C) -> (B, 10)


class _Residual(nn.Module):
    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class SpaceNet(nn.Module):
    """The same super-net as a retiarii model space (a LayerChoice per block), for
    :class:`~retiarii.optim.supergraph.SuperGraph`: ``mixed_supergraph`` trains its paths."""

    def __init__(self, width: int, layers: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(*[rt.LayerChoice(
            {f"op{k}": _Residual(_candidate(k, width, nn.BatchNorm2d)) for k in range(CANDIDATES)},
            label=f"block{i}") for i in range(layers)])
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1, 8, 8) -> (B, 10)
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class _OnSuperGraph:
    """``net(x, path)`` for the super-graph of :class:`SpaceNet`'s space: that path's module."""

    def __init__(self, cfg: Config, device: torch.device):
        space = rt.ModelSpace(SpaceNet(cfg.width, cfg.layers),
                              example_input=torch.zeros(1, 1, 8, 8))
        self.sg = SuperGraph(space, device=device, seed=cfg.seed)

    def path(self, path: tuple[int, ...]) -> nn.Module:
        return self.sg.path({f"block{i}": f"op{c}" for i, c in enumerate(path)})

    def __call__(self, x: torch.Tensor, path: tuple[int, ...]) -> torch.Tensor:
        return self.path(path)(x)


class _OnePath(nn.Module):
    """One path of :class:`SuperNet` as a module of its own (for evaluation)."""

    def __init__(self, net: SuperNet, path: tuple[int, ...]):
        super().__init__()
        self.net, self.choice = net, path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x, self.choice)


class _AllReduce(torch.autograd.Function):
    """A sum over the ranks whose gradient is the sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _GlooSyncBN(nn.BatchNorm2d):
    """BatchNorm whose training statistics are those of the whole batch over every rank, for
    gloo (PyTorch's ``nn.SyncBatchNorm`` runs on GPUs only): per channel sum and sum of
    squares all-reduced in the forward pass, their gradients all-reduced in the backward pass,
    as ``nn.SyncBatchNorm`` does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        c = x.size(1)
        local = torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3)),
                           x.new_full((1,), x.numel() / c)])  # (2C + 1,)
        total = _AllReduce.apply(local)
        n = total[-1]
        mean = total[:c] / n
        var = total[c:2 * c] / n - mean * mean
        with torch.no_grad():
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)
            self.num_batches_tracked.add_(1)
        scale = self.weight * torch.rsqrt(var + self.eps)
        return x * scale[None, :, None, None] + (self.bias - mean * scale)[None, :, None, None]


# ---- one rank --------------------------------------------------------------------------------


def _data(cfg: Config, device: torch.device):
    x, y = load_dataset("digits")  # (1797, 1, 8, 8), (1797,)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(cfg.seed))
    cut = int(len(x) * 0.8)
    train, val = order[:cut], order[cut:]
    if cfg.train_limit:
        train = train[:cfg.train_limit]
    return x[train].to(device), y[train].to(device), x[val].to(device), y[val].to(device)


def _paths(cfg: Config, epoch: int, n: int) -> list[tuple[int, ...]]:
    """The epoch's sampled paths: the same on every rank (a seeded generator)."""
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + epoch + 1)
    return [tuple(torch.randint(0, CANDIDATES, (cfg.layers,), generator=gen).tolist())
            for _ in range(n)]


def _device(cfg: Config, rank: int) -> torch.device:
    if cfg.device == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _evaluate(module_of, cfg: Config, xt, yt, xv, yv) -> float:
    """Mean validation accuracy of ``cfg.eval_paths`` sampled paths with inherited weights
    (``module_of(path)``: the path's module), each after recomputing its BatchNorm statistics
    on ``cfg.calib_batches`` batches."""
    paths = _paths(cfg, -1, cfg.eval_paths)  # the same for every way
    accs = []
    with torch.no_grad():
        for path in paths:
            net = module_of(path)
            for m in net.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.reset_running_stats()
                    m.momentum = None  # a cumulative average over the calibration batches
            net.train()
            for i in range(cfg.calib_batches):
                net(xt[i * 64:(i + 1) * 64])
            net.eval()
            accs.append((net(xv).argmax(1) == yv).float().mean().item())
    return sum(accs) / len(accs)


def train_rank(rank: int, world: int, group, cfg: Config, way: str) -> dict | None:
    device = _device(cfg, rank)
    xt, yt, xv, yv = _data(cfg, device)
    bn = nn.BatchNorm2d
    if way == "ddp_syncbn":
        bn = nn.SyncBatchNorm if cfg.backend == "nccl" else _GlooSyncBN
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank and for every way
    k, b = world, cfg.batch
    lr = cfg.lr * (k if way == "ddp_kbatch" else 1)
    mixed = way.startswith("mixed")
    if way == "mixed_supergraph":  # initial weights: seeded per operator by the super-graph
        net = model = _OnSuperGraph(cfg, device)
        opt = torch.optim.SGD([{"params": net.sg.parameters()}], lr=lr, momentum=0.9)
        net.sg.attach(opt)  # operators join it as paths add them
    else:
        net = SuperNet(cfg.width, cfg.layers, bn).to(device)
        net.train()
        model = net if mixed else DistributedDataParallel(net, find_unused_parameters=True)
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    if mixed:
        steps, rows = len(xt) // (k * b), b  # per step: K models, each its own batch of B
    elif way == "ddp_kbatch":
        steps, rows = len(xt) // (k * b), b  # per step: one model, a batch of K B
    else:
        steps, rows = len(xt) // b, b // k  # per step: one model, a batch of B split K ways
    times, cpu = [], []
    for epoch in range(cfg.epochs):
        perm = torch.randperm(len(xt), generator=torch.Generator().manual_seed(epoch)).to(device)
        paths = _paths(cfg, epoch, steps * k)
        _sync(device)
        dist.barrier(group)
        t0, c0 = time.perf_counter(), time.process_time()
        for s in range(steps):
            if way == "mixed_supergraph":
                for p in paths[s * k:(s + 1) * k]:  # every rank's path, on every rank: the
                    net.path(p)  # pools grow alike (built once, cached, then reused)
            if mixed:
                path = paths[s * k + rank]  # rank r's own model ...
                idx = perm[(s * k + rank) * b:(s * k + rank + 1) * b]  # ... and its own batch
            else:
                path = paths[s * k]  # the same model on every rank ...
                idx = perm[s * k * rows + rank * rows:s * k * rows + (rank + 1) * rows]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(xt[idx], path), yt[idx]).backward()
            if mixed:
                params = net.sg.parameters() if way == "mixed_supergraph" else net.parameters()
                average_used_gradients(params, group)
            opt.step()
        _sync(device)
        dist.barrier(group)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    cpu_timed = cpu[1:] or cpu
    mine = {"cpu_s_per_epoch": sum(cpu_timed) / len(cpu_timed)}
    if rank != 0:
        return mine
    timed = times[1:] or times
    if way == "mixed_supergraph":
        module_of = net.path
    else:
        plain = SuperNet(cfg.width, cfg.layers).to(device)  # no SyncBN: rank 0 evaluates alone
        plain.load_state_dict(net.state_dict())
        module_of = functools.partial(_OnePath, plain)
    return {**mine, "s_per_epoch": sum(timed) / len(timed), "steps_per_epoch": steps,
            "val_acc": _evaluate(module_of, cfg, xt, yt, xv, yv)}


# ---- the comparison ----------------------------------------------------------------------------


def run(cfg: Config) -> list[dict]:
    rows = []
    for way in WAYS:
        ranks = spawn(train_rank, cfg.ranks, cfg, way, backend=cfg.backend, threads=_threads(cfg))
        out = ranks[0]
        # CPU time of every rank (its process: gloo's threads included), per epoch: less
        # moved than wall time by other jobs on the cores
        out["cpu_s_per_epoch"] = sum(r["cpu_s_per_epoch"] for r in ranks)
        rows.append({"way": way, "device": cfg.device, "backend": cfg.backend,
                     "ranks": cfg.ranks, "batch": cfg.batch, "epochs_timed": max(1, cfg.epochs - 1),
                     "width": cfg.width, "layers": cfg.layers, **out,
                     "load_avg_1min": round(os.getloadavg()[0], 2)})
    base, cpu_base = rows[0]["s_per_epoch"], rows[0]["cpu_s_per_epoch"]
    for row in rows:
        row["time_vs_mixed"] = round(row["s_per_epoch"] / base, 3)
        row["cpu_vs_mixed"] = round(row["cpu_s_per_epoch"] / cpu_base, 3)
        row["s_per_epoch"] = round(row["s_per_epoch"], 4)
        row["cpu_s_per_epoch"] = round(row["cpu_s_per_epoch"], 4)
        row["val_acc"] = round(row["val_acc"], 4)
        print(f"{cfg.device} K={cfg.ranks} {row['way']:16}: {row['s_per_epoch']:8.3f} s/epoch "
              f"({row['steps_per_epoch']:3} steps), {row['time_vs_mixed']:5.2f}x mixed's time "
              f"({row['cpu_vs_mixed']:5.2f}x its CPU time), val_acc {row['val_acc']:.4f} (mean "
              f"of {cfg.eval_paths} paths); load {row['load_avg_1min']:.1f}", flush=True)
    return rows


def _threads(cfg: Config) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // cfg.ranks)


def write(rows: list[dict], cfg: Config) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _out import OUT, pyplot, write_csv

    name = f"mixed_parallel-{cfg.device}-k{cfg.ranks}"
    write_csv(rows, name)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ways = [r["way"] for r in rows]
    ax.bar(ways, [r["s_per_epoch"] for r in rows], color="tab:blue")
    ax.set_ylabel("seconds per epoch (bars)")
    acc = ax.twinx()
    acc.plot(ways, [r["val_acc"] for r in rows], "o-", color="tab:red")
    acc.set_ylabel("mean val_acc of sampled paths (line)")
    ax.set_title(f"Weight-sharing training on {cfg.ranks} ranks ({cfg.device}, {cfg.backend})")
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, f"{name}.png"), dpi=100)
    print(f"wrote {OUT}/{name}.csv and .png")


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Config()
    p.add_argument("--ranks", type=int, default=d.ranks)
    p.add_argument("--batch", type=int, default=d.batch, help="B: examples per model and step")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--epochs", type=int, default=d.epochs, help="the first is not timed")
    p.add_argument("--width", type=int, default=d.width)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--eval-paths", type=int, default=d.eval_paths)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--backend", choices=["gloo", "nccl"],
                   help="default: gloo on the CPU; on cuda NCCL when there is a GPU per rank, "
                        "else gloo (NCCL refuses two ranks on one GPU)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--quick", action="store_true", help="a few seconds: tiny net and data")
    args = p.parse_args(argv)
    if args.batch % args.ranks:
        p.error(f"--batch {args.batch} must split evenly over --ranks {args.ranks} "
                "(the DDP ways give each rank B / K examples)")
    backend = args.backend or ("nccl" if args.device == "cuda"
                               and torch.cuda.device_count() >= args.ranks else "gloo")
    cfg = Config(ranks=args.ranks, batch=args.batch, lr=args.lr, epochs=args.epochs,
                 width=args.width, layers=args.layers, eval_paths=args.eval_paths,
                 device=args.device, backend=backend, seed=args.seed)
    if args.quick:
        cfg = Config(**{**asdict(cfg), "epochs": 2, "width": 8, "layers": 2, "eval_paths": 2,
                        "calib_batches": 2, "train_limit": 8 * cfg.batch * cfg.ranks})
    rows = run(cfg)
    write(rows, cfg)
    return rows


if __name__ == "__main__":
    main()
