"""The mixed-parallelism benchmark (benchmarks/mixed_parallel.py): its SyncBN baseline for
gloo is BatchNorm over the whole batch, and its --quick mode runs."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import mixed_parallel as bench  # noqa: E402  (benchmarks/ is not a package)

from retiarii.engine.executors.local_ranks import spawn  # noqa: E402


def _example():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 4, 3, 3, generator=gen) * 2 + 1  # (B, C, H, W), not centred
    probe = torch.randn(8, 4, 3, 3, generator=gen)  # the loss is sum(y * probe)
    weight, bias = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    return x, probe, weight, bias


def _syncbn_rank(rank: int, world: int, group) -> dict:
    x, probe, weight, bias = _example()
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)  # this rank's share of the batch
    bn = bench._GlooSyncBN(4)
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
    x = x[rows].clone().requires_grad_()
    y = bn(x)
    (y * probe[rows]).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad, "w_grad": bn.weight.grad, "b_grad": bn.bias.grad,
            "mean": bn.running_mean, "var": bn.running_var}


def test_gloo_syncbn_is_batchnorm_over_every_rank_batch():
    x, probe, weight, bias = _example()
    bn = nn.BatchNorm2d(4)
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
    x.requires_grad_()
    y = bn(x)
    (y * probe).sum().backward()
    ranks = spawn(_syncbn_rank, 2, timeout=60)

    def close(a, b):
        return torch.allclose(a, b, rtol=1e-5, atol=1e-5)

    assert close(torch.cat([r["y"] for r in ranks]), y.detach())
    assert close(torch.cat([r["x_grad"] for r in ranks]), x.grad)
    # Each rank holds the gradient of its own loss; the whole batch's is their sum.
    assert close(ranks[0]["w_grad"] + ranks[1]["w_grad"], bn.weight.grad)
    assert close(ranks[0]["b_grad"] + ranks[1]["b_grad"], bn.bias.grad)
    for r in ranks:
        assert close(r["mean"], bn.running_mean) and close(r["var"], bn.running_var)


@pytest.mark.slow  # five spawned runs: ~10 s on a quiet machine, ~40 s at load 10
def test_quick_mode_compares_the_five_ways():
    rows = {r["way"]: r for r in bench.main(["--quick"])}
    assert list(rows) == bench.WAYS
    assert rows["mixed"]["time_vs_mixed"] == 1.0
    assert all(r["s_per_epoch"] > 0 and 0 <= r["val_acc"] <= 1 for r in rows.values())
    # mixed and ddp_kbatch take one step per K batches of B, the others one per batch of B
    steps = {way: r["steps_per_epoch"] for way, r in rows.items()}
    assert steps["mixed"] == steps["mixed_supergraph"] == steps["ddp_kbatch"]
    assert steps["ddp_syncbn"] == steps["ddp"] == 2 * steps["mixed"]


@pytest.mark.gpu
def test_quick_mode_on_the_gpu():
    """What the lead runs on a lent GPU: two ranks share one GPU through gloo (NCCL when
    there is a GPU per rank); every way runs and reports."""
    rows = {r["way"]: r for r in bench.main(["--quick", "--device", "cuda"])}
    assert list(rows) == bench.WAYS
    assert all(r["device"] == "cuda" and r["s_per_epoch"] > 0 for r in rows.values())
