"""Benchmark: N same-shape models trained fused vs separately (issue #13 item 2; HFTA).

Two workloads, each N models with one architecture, their own initial weights and their own
learning rate (and LR schedule), on the same batches (synthetic data, fixed seeds):

- ``mlp``: 64 -> W -> W -> 10 with ReLU (W = ``--mlp-width``, 64 by default), Adam (lr 1e-4
  ... 1e-3), batch 128;
- ``cnn``: conv 3->16 (BN, ReLU, max-pool), conv 16->32 (BN, ReLU), global average pool,
  linear 32->10, on 32x32 images, SGD with momentum 0.9 and Nesterov (lr 0.01 ... 0.05),
  batch 64.

Both ways run in this process, one after the other:

- **separate**: each model trains ``--steps`` steps alone (its own forward, backward,
  ``torch.optim`` step and scheduler step), one model after the other;
- **fused**: :func:`retiarii.optim.fusion.fuse_models` + :class:`~retiarii.optim.fused_optim.
  FusedOptimizer`: one forward/backward/optimizer step for the N models per batch, each
  model's scheduler stepping its own optimizer (the fused step reads their rates).

The first step of each is a warm-up and not timed. It asserts that both give every model the
same losses and final weights: each tensor within 1e-4 of its largest magnitude (each loss
within 1e-4 relative), or, where max-pool and ReLU comparisons flip, no further than
separate training from itself with its loss scaled by 1 + 2**-23 (times 10, the largest over
the workload's tensors); it prints both.
It runs one torch thread unless ``--threads`` says otherwise, prints the ratio (separate time /
fused time; issue targets: >= 2x for the MLPs on the CPU, >= 6x for the CNNs on a GPU) and
writes ``benchmarks/out/fusion-DEVICE-wWIDTH.csv`` and ``.png``.

Example::

    .venv/bin/python benchmarks/fusion.py                      # N = 16, both workloads, CPU
    .venv/bin/python benchmarks/fusion.py --models 2 4 8 16 --device cuda
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn
from torch.nn import functional as F

from retiarii.optim.fused_optim import FusedOptimizer
from retiarii.optim.fusion import fuse_models

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-4  # largest |fused - separate| / largest |separate|, per tensor and per loss


MLP_WIDTH = 64  # --mlp-width: 64 is a digits-sized MLP (8x8 inputs), as the demo spaces train


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, MLP_WIDTH), nn.ReLU(), nn.Linear(MLP_WIDTH, MLP_WIDTH),
                         nn.ReLU(), nn.Linear(MLP_WIDTH, 10))


def cnn() -> nn.Module:
    # No bias before a BatchNorm (it would cancel): its gradient is zero up to rounding.
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1, bias=False),
                         nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(32, 10))


WORKLOADS = {
    # name: (model, input shape per example, batch size, optimizer factory)
    "mlp": (mlp, (64,), 128, lambda m, i, n: torch.optim.Adam(
        m.parameters(), lr=1e-4 * (10 ** (i / max(n - 1, 1))))),
    "cnn": (cnn, (3, 32, 32), 64, lambda m, i, n: torch.optim.SGD(
        m.parameters(), lr=0.01 + 0.04 * i / max(n - 1, 1), momentum=0.9, nesterov=True)),
}


def _setup(workload: str, n: int, device: torch.device):
    make, shape, batch, optim = WORKLOADS[workload]
    models = []
    for i in range(n):
        torch.manual_seed(100 + i)  # each model its own initial weights
        models.append(make().to(device))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch * 8, *shape, generator=gen)
    # Labels from a random linear teacher: a task the models can learn smoothly. (Memorizing
    # random labels with Adam is chaotic: a one-ulp change of the loss alone moves a weight
    # by 1e-3 within 40 steps, and no comparison at float tolerance can hold.)
    teacher = torch.randn(x[0].numel(), 10, generator=gen)
    y = (x.flatten(1) @ teacher).argmax(1)
    x, y = x.to(device), y.to(device)
    batches = [(x[j * batch:(j + 1) * batch], y[j * batch:(j + 1) * batch]) for j in range(8)]
    opts = [optim(m, i, n) for i, m in enumerate(models)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.7) for o in opts]
    return models, opts, scheds, batches


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def separate(workload: str, n: int, steps: int, device: torch.device, scale: float = 1.0):
    models, opts, scheds, batches = _setup(workload, n, device)
    losses = [[] for _ in models]
    wall = cpu = 0.0
    for i, (model, opt, sched) in enumerate(zip(models, opts, scheds)):
        model.train()
        for s in range(steps):
            if s == 1:  # the first step warms caches and allocators up
                _sync(device)
                t0, c0 = time.perf_counter(), time.process_time()
            x, y = batches[s % len(batches)]
            loss = F.cross_entropy(model(x), y) * scale
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses[i].append(loss.detach())
        _sync(device)
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
    return models, torch.stack([torch.stack(lo) for lo in losses]).cpu(), wall, cpu


def fused(workload: str, n: int, steps: int, device: torch.device):
    models, opts, scheds, batches = _setup(workload, n, device)
    net = fuse_models(models)
    opt = FusedOptimizer(net, opts)
    net.train()
    losses = []
    for s in range(steps):
        if s == 1:
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
        x, y = batches[s % len(batches)]
        out = net(x)  # (N, B, 10)
        # Per-model mean cross entropy, summed: each model's gradient is its own loss's.
        per = F.cross_entropy(out.flatten(0, 1), y.repeat(n), reduction="none").view(n, -1)
        loss = per.mean(1)
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
        for sched in scheds:
            sched.step()
        losses.append(loss.detach())
    _sync(device)
    return models, torch.stack(losses, 1).cpu(), time.perf_counter() - t0, time.process_time() - c0


def _differences(a_models, b_models, a_loss, b_loss) -> dict[str, float]:
    """Per tensor (and per model's losses): the largest difference relative to the tensor's
    largest magnitude (losses: to each loss)."""
    out = {f"model {i} losses": ((a_loss[i] - b_loss[i]).abs()
                                 / a_loss[i].abs().clamp_min(1e-12)).max().item()
           for i in range(len(a_models))}
    for i, (a, b) in enumerate(zip(a_models, b_models)):
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
            x, y = x.double(), y.double()
            out[f"model {i} {name}"] = ((x - y).abs().max() / x.abs().max().clamp_min(1e-12)).item()
    return out


def _check(fused_diff: dict[str, float], spread: dict[str, float]) -> tuple[float, float]:
    """Fused must agree with separate within TOL, or at most as far as separate agrees with
    itself under a one-ulp change of its loss (``spread``: the loss scaled by 1 + 2**-23),
    times 10, over the workload's tensors. Max-pooling and ReLU route gradients by
    comparisons such a change can flip: after 20 steps a tensor of one model or another (which
    one depends on the rounding) moves by up to ~3e-4 of its scale, alone or fused alike
    (measured); the others agree to 1e-7."""
    worst, bound = max(fused_diff.values()), max(TOL, 10 * max(spread.values()))
    if worst > bound:
        what = max(fused_diff, key=fused_diff.get)
        raise AssertionError(f"{what}: fused and separate differ by {worst:.1e} of the tensor's "
                             f"largest magnitude; separate vs itself with a one-ulp change of "
                             f"its loss: up to {max(spread.values()):.1e}")
    return worst, max(spread.values())


def run(workloads: list[str], counts: list[int], steps: int, device: torch.device) -> list[dict]:
    rows = []
    for workload in workloads:
        for n in counts:
            a_models, a_loss, a_wall, a_cpu = separate(workload, n, steps, device)
            b_models, b_loss, b_wall, b_cpu = fused(workload, n, steps, device)
            c_models, c_loss, _, _ = separate(workload, n, steps, device, 1 + 2 ** -23)
            diff, spread = _check(_differences(a_models, b_models, a_loss, b_loss),
                                  _differences(a_models, c_models, a_loss, c_loss))
            timed = steps - 1
            rows.append({"workload": workload, "models": n, "steps": timed,
                         "mlp_width": MLP_WIDTH if workload == "mlp" else "",
                         "device": device.type, "separate_s": round(a_wall, 4),
                         "fused_s": round(b_wall, 4), "ratio": round(a_wall / b_wall, 3),
                         "separate_cpu_s": round(a_cpu, 4), "fused_cpu_s": round(b_cpu, 4),
                         "cpu_ratio": round(a_cpu / b_cpu, 3), "largest_difference": diff,
                         "one_ulp_spread": spread,
                         "threads": torch.get_num_threads(),
                         "load_avg_1min": round(os.getloadavg()[0], 2)})
            print(f"{workload:4} N={n:3}: separate {a_wall / timed * 1e3:8.2f} ms/step, fused "
                  f"{b_wall / timed * 1e3:7.2f} ms/step -> {a_wall / b_wall:5.2f}x wall "
                  f"({a_cpu / b_cpu:5.2f}x CPU time); largest difference {diff:.1e} "
                  f"(one-ulp spread {spread:.1e}); "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    return rows


def write(rows: list[dict], device: str) -> None:
    from _out import OUT, pyplot, write_csv  # benchmarks/: this script's folder

    out = OUT

    name = f"fusion-{device}-w{MLP_WIDTH}"
    write_csv(rows, name)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for workload in sorted({r["workload"] for r in rows}):
        mine = [r for r in rows if r["workload"] == workload]
        ax.plot([r["models"] for r in mine], [r["ratio"] for r in mine], "o-", label=workload)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("models fused (N)")
    ax.set_ylabel("separate time / fused time")
    ax.set_title(f"Fused training of same-shape models ({device})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"{name}.png"), dpi=100)
    print(f"wrote {out}/{name}.csv and .png")


def main() -> None:
    global MLP_WIDTH
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=["mlp", "cnn", "all"], default="all")
    p.add_argument("--models", type=int, nargs="+", default=[16])
    # 20 timed steps: training's own sensitivity grows with steps (a CNN at SGD rate 0.1,
    # Nesterov, alone: a one-ulp change of its loss moved its weights by 9e-7 after 20 steps,
    # by 2e-4 after 40), and the check compares against it (see _check).
    p.add_argument("--steps", type=int, default=21, help="steps per model (the first untimed)")
    p.add_argument("--mlp-width", type=int, default=MLP_WIDTH, help="the MLPs' hidden width")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a CPU shared with other jobs, "
                        "two OpenMP threads on two cores wait on each other and time is noise)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    MLP_WIDTH = args.mlp_width
    workloads = ["mlp", "cnn"] if args.workload == "all" else [args.workload]
    device = torch.device(args.device)
    write(run(workloads, args.models, args.steps, device), device.type)


if __name__ == "__main__":
    main()
