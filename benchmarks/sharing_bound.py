"""Benchmark: the most that exact sharing can save on workload (b) of ``optimize_e2e.py`` (adapters
after N blocks of a frozen MobileNetV2), in arithmetic, against what the engine measured.

Model k of the workload puts a trainable residual adapter after block ``b_k`` of one frozen
backbone (``e2e_workloads.adapter_space``). Trained apart, each model runs the whole backbone
forward, then backward through the blocks after its adapter (input gradients only: the
backbone's weights are frozen, but the adapter's gradient flows through them). Trained
together, exactly (CSE: same frozen weights, same batch), the stem and the blocks up to the
deepest adapter run once for all, and each model still runs its own blocks after its adapter,
forward and backward: their inputs differ from the first step on, so nothing exact can share
them. Operator batching (``Layout.BATCHING``) runs those per-model calls as one call each, which
saves the calls' fixed costs but computes the same FLOPs.

So the *FLOP bound* of any exact layout is::

    apart  = sum_k [F(all blocks) + F(blocks after b_k)]          (backward ~ forward FLOPs)
    shared = F(stem .. deepest adapter's block) + sum_k 2 F(blocks after b_k)
    bound  = apart / shared

The script counts each block's forward FLOPs with ``torch.utils.flop_counter.FlopCounterMode``
at the workload's batch (32 images of 32x32), prints them, the bound, and writes
``benchmarks/out/sharing_bound.csv``. A measured speed-up above the bound (``optimize_e2e
--workload b``'s bfreeze) comes from fewer calls (batching), not from less arithmetic.

Example::

    .venv/bin/python benchmarks/sharing_bound.py
    .venv/bin/python benchmarks/sharing_bound.py --quick
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402


def flop_bound(block_flops: list[float], adapters: list[int]) -> tuple[float, float]:
    """(apart, shared) FLOPs of one training step of the models (see the module docstring).

    Args:
        block_flops: forward FLOPs of the backbone's parts in order: the stem, block 0,
            block 1, ..., then the parts after the last block (the head).
        adapters: the block each model's adapter follows (block i is ``block_flops[i + 1]``).

    Example::

        >>> flop_bound([1.0, 2.0, 3.0, 4.0], [0, 1])   # stem 1, blocks 2 and 3, head 4
        (31.0, 28.0)
    """
    total = sum(block_flops)

    def after(block: int) -> float:  # the parts past the block the adapter follows
        return sum(block_flops[block + 2:])

    apart = sum(total + after(b) for b in adapters)
    shared = sum(block_flops[:max(adapters) + 2]) + sum(2 * after(b) for b in adapters)
    return apart, shared


def block_flops(sizes, batch: int = 32, image: int = 32) -> list[tuple[str, float]]:
    """(name, forward FLOPs) of the workload's backbone parts, at ``batch`` images."""
    import e2e_workloads as workloads

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        backbone = workloads.MobileNetV2(sizes.b_width, sizes.b_stages).eval()
    parts = [("stem", backbone.stem)] + [(f"block {i}", layer)
                                         for i, layer in enumerate(backbone.layers)]
    parts.append(("head", backbone.head))
    x = torch.randn(batch, 3, image, image)
    out = []
    with torch.no_grad():
        for name, module in parts:
            with FlopCounterMode(display=False) as counter:
                x = module(x)
            out.append((name, float(counter.get_total_flops())))
    return out


def main(argv: list[str] | None = None) -> None:
    import e2e_workloads as workloads
    from _out import write_csv

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the workload's quick sizes")
    p.add_argument("--out", help="folder of the CSV (default benchmarks/out)")
    args = p.parse_args(argv)
    if args.out:
        import _out

        _out.OUT = args.out
    sizes = workloads.sizes(args.quick)
    parts = block_flops(sizes)
    blocks = len(parts) - 2
    adapters = [i * blocks // sizes.b_adapters for i in range(sizes.b_adapters)]  # as the space
    apart, shared = flop_bound([f for _, f in parts], adapters)
    print(f"MobileNetV2 at width {sizes.b_width}%, {blocks} blocks, 32 images of 32x32; adapters "
          f"after blocks {adapters}")
    for name, f in parts:
        print(f"  {name:9} {f / 1e6:8.1f} MFLOP forward")
    print(f"one step of the {len(adapters)} models: apart {apart / 1e9:.3f} GFLOP, shared "
          f"exactly {shared / 1e9:.3f} GFLOP: FLOP bound {apart / shared:.2f}x")
    rows = [{"part": name, "forward_flops": int(f)} for name, f in parts]
    rows.append({"part": "apart (one step, all models)", "forward_flops": int(apart)})
    rows.append({"part": "shared exactly (one step)", "forward_flops": int(shared)})
    rows.append({"part": "bound", "forward_flops": round(apart / shared, 4)})
    print(f"wrote {write_csv(rows, 'sharing_bound' + ('-quick' if args.quick else ''))}")


if __name__ == "__main__":
    main()
