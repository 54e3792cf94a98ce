"""The device model's batching rule on a CPU (issue #26, workload b with ``rt.freeze``): operator
batching is taken where the frozen layers do little arithmetic per call and model, decided
from shapes (``device_model.batching_wins``), and a default search that batches stays
reproducible and trains as ``optimize=False`` does.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import fx, nn

import retiarii as rt
import test_optimize as o
from engine_helpers import InProcessExecutor
from test_reproducible import _random_clock
from retiarii.optim import device_model as dm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model_spaces import adapters  # noqa: E402

ADAPTERS = adapters.small()  # 5 blocks of a MobileNetV2 0.25 frozen with rt.freeze, 16 px


def _frozen_mlp(width: int) -> fx.GraphModule:
    """Two frozen Linear(width, width) and a trainable Linear(width, 10)."""
    seq = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                        nn.Linear(width, 10))
    seq[0].requires_grad_(False)
    seq[2].requires_grad_(False)
    return fx.symbolic_trace(seq)


def test_frozen_flops_per_call_by_hand():
    costs = dm.step_costs(_frozen_mlp(64), [torch.zeros(32, 64)])
    # two frozen calls of 2 * 32 * 64 * 64 FLOPs each; the trainable layer is not counted
    assert costs.frozen_calls == 2 and costs.frozen_flops == 2 * (2 * 32 * 64 * 64)
    assert costs.frozen_flops_per_call == 2 * 32 * 64 * 64
    assert dm.step_costs(_frozen_mlp(64).requires_grad_(True),
                         [torch.zeros(32, 64)]).frozen_flops_per_call == 0.0


def test_batching_wins_on_a_cpu_up_to_the_flops_per_call():
    # per call and model 2 * B * 64 * 64 = 8192 B FLOPs: the limit falls between two batches
    limit = int(dm.BATCH_CPU_CALL_FLOPS // 8192)
    at, past = (dm.step_costs(_frozen_mlp(64), [torch.zeros(b, 64)]) for b in (limit, limit + 1))
    assert at.frozen_flops_per_call <= dm.BATCH_CPU_CALL_FLOPS < past.frozen_flops_per_call
    assert dm.batching_wins([at] * 4, "cpu") and not dm.batching_wins([past] * 4, "cpu")
    # the mean over the models decides: one at the limit and one 3x past it average past it
    far = dm.step_costs(_frozen_mlp(64), [torch.zeros(3 * limit, 64)])
    assert not dm.batching_wins([at, far], "cpu")
    # nothing frozen: nothing to batch on a CPU; a GPU batches whatever the sizes
    free = dm.step_costs(_frozen_mlp(64).requires_grad_(True), [torch.zeros(8, 64)])
    assert not dm.batching_wins([free] * 2, "cpu")
    assert dm.batching_wins([past] * 4, "cuda:0")


def test_the_measured_cases_fall_on_their_side():
    """benchmarks/README.md ("bfreeze"): MobileNetV2 0.25 at 32 px wins at 16, 32 and 64
    examples per model; the 3x3 CNN of benchmarks/batching.py (width 32, 16x16 maps) wins at 4
    examples and loses at 32."""
    mnv2 = adapters.cifar()
    model = mnv2.build({"block": 8}, check=False)
    for b in (16, 32, 64):
        assert dm.batching_wins([dm.step_costs(model, [torch.zeros(b, 3, 32, 32)])], "cpu")
    conv = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(32 * 16 * 16, 10))
    conv[0].requires_grad_(False)
    conv[2].requires_grad_(False)
    conv = fx.symbolic_trace(conv)
    # 2 * B * 32 * 16 * 16 * (32 * 9) FLOPs per call: 18.9 M at 4 examples, 151 M at 32
    small, large = (dm.step_costs(conv, [torch.zeros(b, 32, 16, 16)]) for b in (4, 32))
    assert small.frozen_flops_per_call == 2 * 4 * 32 * 16 * 16 * 32 * 9
    assert dm.batching_wins([small], "cpu") and not dm.batching_wins([large], "cpu")


def _images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


# 32 examples per model and step: batched under the rule, not under the old 16-example limit
TRAINER = rt.Trainer(dataset=_images(9 * 32), batch_size=32, epochs=2, optimizer="sgd",
                     lr=0.05, val_fraction=1 / 9)


def _search(tmp_path, name, **kw):
    db = tmp_path / f"{name}.db"
    rt.Experiment(ADAPTERS, rt.strategies.GridSearch(), TRAINER, store=str(db),
                  executor=InProcessExecutor(), seed=0, max_models=5, **kw).run()
    return db


@pytest.mark.slow
def test_a_default_search_of_adapters_batches_reproducibly_and_as_off(tmp_path, monkeypatch):
    runs = []
    for seed in (1, 2):
        with monkeypatch.context() as m:
            _random_clock(m, seed)  # what batches is not timed: any clock gives one result
            runs.append(_search(tmp_path, f"auto{seed}"))
    first, second = (o._curves(db) for db in runs)
    assert len(first) == 5 and first == second
    units = [u for r in o._plans(runs[0]) for u in r["units"]]
    assert units and all(u.get("layout") == "batching" for u in units)  # 32 examples a model
    off = o._curves(_search(tmp_path, "off", optimize=False))
    # batching through frozen eval-mode layers: the same values as each model alone
    for key, (state, curves) in off.items():
        for name, points in curves.items():
            assert [v for _, v in first[key][1][name]] == pytest.approx(
                [v for _, v in points], rel=1e-6)
