"""benchmarks/sharing_bound.py: the FLOP bound of exact sharing on workload (b) (issue #26),
checked by hand on made-up blocks, on the real backbone's parts, and run as a script."""
from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import sharing_bound  # noqa: E402


def test_the_bound_by_hand():
    # stem 1, blocks 10, 20, 30, head 5; adapters after blocks 0 and 2
    # apart: each model the whole forward (66) + its tail backward: (66 + 55) + (66 + 5)
    # shared: stem and blocks 0-2 once (61) + each tail forward and backward: 2*55 + 2*5
    assert sharing_bound.flop_bound([1, 10, 20, 30, 5], [0, 2]) == (192, 181)
    # every adapter after the last block: only the head per model, the backbone once
    apart, shared = sharing_bound.flop_bound([1, 10, 20, 30, 5], [2, 2, 2, 2])
    assert (apart, shared) == (4 * (66 + 5), 61 + 4 * 10)


def test_the_parts_are_the_backbone_in_order_and_sum_to_the_model():
    import e2e_workloads as workloads
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    sizes = workloads.sizes(True)
    parts = sharing_bound.block_flops(sizes, batch=4)
    blocks = sum(repeats for _, _, repeats, _ in sizes.b_stages)
    assert [name for name, _ in parts] == ["stem", *(f"block {i}" for i in range(blocks)), "head"]
    assert all(f > 0 for _, f in parts)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = workloads.MobileNetV2(sizes.b_width, sizes.b_stages).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        net.head(net.layers(net.stem(torch.randn(4, 3, 32, 32))))
    assert sum(f for _, f in parts) == counter.get_total_flops()


def test_the_script_prints_and_writes_the_bound(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sharing_bound.py"),
                           "--quick", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FLOP bound" in done.stdout
    with open(tmp_path / "sharing_bound-quick.csv") as f:
        rows = list(csv.DictReader(f))
    bound = float(rows[-1]["forward_flops"])
    apart, shared = (float(r["forward_flops"]) for r in rows[-3:-1])
    assert rows[-1]["part"] == "bound" and bound == pytest.approx(apart / shared, rel=1e-4)
    assert 1.0 < bound < 2  # two adapters of the quick sizes: most of the backbone apart
