"""Benchmark: SPOS training on a super-graph vs checkpoint-to-file vs an in-memory dict
(issue #14, paper Fig. 15: 6.52x at batch 32, 2.08x at batch 256 on a GPU).

Single-path one-shot training over the SPOS ShuffleNetV2-block space (``model_spaces/spos.py``,
the ``small`` preset: 20 choice blocks of 4 candidates, widths 16 ... 48, 8x8 inputs, 10
classes): a fixed, seeded sequence of uniformly sampled models, **one batch each** (SGD,
momentum 0.9), the same models and batches for each way:

- **super-graph** (ours): :class:`retiarii.optim.supergraph.SuperGraph`; each model is a path
  on the shared operators (built once per structure), one optimizer for the pool;
- **checkpoint-to-file**: each model built standalone (``space.build(sample, check=False)``,
  as a worker does), it loads the shared weights and momentum buffers from one file
  (``torch.load``), trains its batch, and saves them back (``torch.save``), as weight sharing
  through the engine's checkpoints would;
- **dict**: the same, with an in-memory dict instead of the file (no disk, no
  serialization).

Both baselines find each tensor's place in the shared weights through
:func:`retiarii.optim.weight_keys.weight_keys` (the same keys the super-graph uses). The first
``--warmup`` models of each way are not timed (the pool and the file fill up; allocators warm).
That the super-graph trains to the same weights as checkpoint-to-file is proved by
``tests/test_supergraph.py`` (1e-6 relative after 20 steps), not here.

It prints models/s per way and the ratios (super-graph over each baseline; wall clock, and
process CPU time, which a CPU shared with other jobs disturbs less), one line per batch size,
and writes ``benchmarks/out/supergraph-DEVICE.csv`` and ``.png``.

Example::

    .venv/bin/python benchmarks/supergraph.py                   # batch 32 and 256, CPU
    .venv/bin/python benchmarks/supergraph.py --device cuda     # the GPU figure (target 6.5x)
    .venv/bin/python benchmarks/supergraph.py --quick           # a few models, seconds
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch
from torch.nn import functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # model_spaces/ beside retiarii/

from model_spaces import spos  # noqa: E402
from retiarii.optim.supergraph import SuperGraph  # noqa: E402
from retiarii.optim.weight_keys import weight_keys  # noqa: E402

LR, MOMENTUM = 0.05, 0.9


def _batches(n: int, batch: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(64, 10, generator=gen)
    out = []
    for _ in range(n):
        x = torch.randn(batch, 1, 8, 8, generator=gen)
        out.append((x.to(device), (x.flatten(1) @ teacher).argmax(1).to(device)))
    return out


def _samples(space, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [space.sample(lambda label, keys, ctx: rng.randrange(len(keys))).sample
            for _ in range(n)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(net, opt, x, y) -> None:
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(net(x), y).backward()
    opt.step()


def supergraph(space, samples, batches, device, warmup: int) -> tuple[float, float]:
    """(wall, CPU) seconds for the timed models, trained as paths of one super-graph."""
    sg = SuperGraph(space, device)
    opt = torch.optim.SGD([{"params": sg.parameters()}], lr=LR, momentum=MOMENTUM)
    sg.attach(opt)
    for i, (smp, (x, y)) in enumerate(zip(samples, batches)):
        if i == warmup:
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
        _step(sg.path(smp).train(), opt, x, y)
    _sync(device)
    return time.perf_counter() - t0, time.process_time() - c0


class _FileStore:
    """The shared weights and momentum buffers in one file, read and written whole."""

    def __init__(self, path: str):
        self.path = path
        torch.save({"weights": {}, "momentum": {}}, path)

    def load(self) -> dict:
        return torch.load(self.path)

    def save(self, state: dict) -> None:
        torch.save(state, self.path)


class _DictStore:
    """The same in memory: tensors copied in and out, no serialization."""

    def __init__(self):
        self.state = {"weights": {}, "momentum": {}}

    def load(self) -> dict:
        return self.state

    def save(self, state: dict) -> None:
        self.state = state


def checkpoint(space, samples, batches, device, warmup: int, store) -> tuple[float, float]:
    """(wall, CPU) seconds for the timed models, each built alone and handed the shared
    weights and optimizer state through ``store``."""
    for i, (smp, (x, y)) in enumerate(zip(samples, batches)):
        if i == warmup:
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
        model = space.replay(smp)
        net = space.build(smp, check=False).to(device)
        keys = weight_keys(space, model)
        owners = sorted(keys, key=len, reverse=True)

        def where(name, keys=keys, owners=owners):
            attr = next(a for a in owners if name == a or name.startswith(a + "."))
            op = keys[attr]
            return op.key, "value" if op.kind == "param" else name[len(attr) + 1:]

        saved = store.load()
        names = {name: where(name) for name in net.state_dict()}
        state = {n: saved["weights"][k] for n, k in names.items() if k in saved["weights"]}
        net.load_state_dict(state, strict=False)
        opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
        for name, p in net.named_parameters():
            buf = saved["momentum"].get(names[name])
            if buf is not None:
                opt.state[p]["momentum_buffer"] = buf.to(device).clone()
        _step(net.train(), opt, x, y)
        for name, t in net.state_dict().items():
            saved["weights"][names[name]] = t.detach().clone()
        for name, p in net.named_parameters():
            if "momentum_buffer" in opt.state.get(p, {}):
                saved["momentum"][names[name]] = opt.state[p]["momentum_buffer"]
        store.save(saved)
    _sync(device)
    return time.perf_counter() - t0, time.process_time() - c0


def run(batch_sizes: list[int], models: int, warmup: int, device: torch.device,
        seed: int) -> list[dict]:
    space = spos.small()
    rows = []
    for batch in batch_sizes:
        samples = _samples(space, warmup + models, seed)
        batches = _batches(warmup + models, batch, device)
        with tempfile.TemporaryDirectory() as tmp:
            ours, ours_cpu = supergraph(space, samples, batches, device, warmup)
            to_file, file_cpu = checkpoint(space, samples, batches, device, warmup,
                                           _FileStore(os.path.join(tmp, "shared.pt")))
            file_bytes = os.path.getsize(os.path.join(tmp, "shared.pt"))
        in_dict, dict_cpu = checkpoint(space, samples, batches, device, warmup, _DictStore())
        row = {"batch": batch, "models": models, "device": device.type,
               "supergraph_models_per_s": round(models / ours, 3),
               "file_models_per_s": round(models / to_file, 3),
               "dict_models_per_s": round(models / in_dict, 3),
               "ratio_vs_file": round(to_file / ours, 3),
               "ratio_vs_dict": round(in_dict / ours, 3),
               "supergraph_cpu_ms": round(ours_cpu / models * 1e3, 2),
               "file_cpu_ms": round(file_cpu / models * 1e3, 2),
               "dict_cpu_ms": round(dict_cpu / models * 1e3, 2),
               "cpu_ratio_vs_file": round(file_cpu / ours_cpu, 3),
               "cpu_ratio_vs_dict": round(dict_cpu / ours_cpu, 3),
               "checkpoint_mb": round(file_bytes / 2 ** 20, 3),
               "threads": torch.get_num_threads(),
               "load_avg_1min": round(os.getloadavg()[0], 2)}
        rows.append(row)
        print(f"batch {batch:4}: super-graph {row['supergraph_models_per_s']:7.2f} models/s, "
              f"checkpoint-to-file {row['file_models_per_s']:7.2f}, dict "
              f"{row['dict_models_per_s']:7.2f} -> {row['ratio_vs_file']:.2f}x vs file, "
              f"{row['ratio_vs_dict']:.2f}x vs dict (CPU time per model: "
              f"{row['supergraph_cpu_ms']:.0f} / {row['file_cpu_ms']:.0f} / "
              f"{row['dict_cpu_ms']:.0f} ms: {row['cpu_ratio_vs_file']:.2f}x, "
              f"{row['cpu_ratio_vs_dict']:.2f}x; {models} models, {device.type}, "
              f"checkpoint {row['checkpoint_mb']:.2f} MB, load {row['load_avg_1min']:.1f})",
              flush=True)
    return rows


def write(rows: list[dict], device: str) -> None:
    from _out import OUT, pyplot, write_csv  # benchmarks/: this script's folder

    name = f"supergraph-{device}"
    write_csv(rows, name)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ways = [("supergraph_models_per_s", "super-graph"), ("file_models_per_s",
                                                          "checkpoint-to-file"),
            ("dict_models_per_s", "in-memory dict")]
    width = 0.25
    for j, (col, label) in enumerate(ways):
        ax.bar([i + (j - 1) * width for i in range(len(rows))], [r[col] for r in rows], width,
               label=label)
    ax.set_xticks(range(len(rows)), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("models trained per second (one batch each)")
    ax.set_title(f"SPOS weight sharing ({device})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, f"{name}.png"), dpi=100)
    print(f"wrote {OUT}/{name}.csv and .png")


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    p.add_argument("--models", type=int, default=60, help="timed models per way")
    p.add_argument("--warmup", type=int, default=10, help="untimed models first")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a CPU shared with other jobs, "
                        "two OpenMP threads on two cores wait on each other)")
    p.add_argument("--quick", action="store_true", help="2 timed models, batch 32: a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.models, args.warmup = [32], 2, 1
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = run(args.batch, args.models, args.warmup, device, args.seed)
    write(rows, device.type)
    return rows


if __name__ == "__main__":
    main()
