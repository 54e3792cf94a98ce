"""Fusion across architectures (issue #26 item 2): models of a space that chose other
activations train as one fused model: one batched call per layer with weights, each distinct
activation on the slices of the models holding it (``optim.fusion_family``,
``fused_ops.PerModelPointwise``). Checked against each model trained alone."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import retiarii as rt
import test_optimize as o
from engine_helpers import InProcessExecutor
from retiarii.optim import FusedOptimizer, FusionError, fuse_models, fusion_family, fusion_key

ACTS = [nn.ReLU(), nn.GELU(), nn.Tanh(), nn.Sigmoid()]


class ActNet(nn.Module):
    """A 64-64-64-10 MLP whose two activations are chosen (16 architectures)."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, width), nn.Linear(width, width)
        self.fc3 = nn.Linear(width, 10)
        self.a1 = rt.nn.LayerChoice(copy.deepcopy(ACTS), label="a1")
        self.a2 = rt.nn.LayerChoice(copy.deepcopy(ACTS), label="a2")

    def forward(self, x):
        x = x.flatten(1)
        return self.fc3(self.a2(self.fc2(self.a1(self.fc1(x)))))


act_space = rt.ModelSpace(ActNet(), example_input=torch.zeros(2, 1, 8, 8))
wide_space = rt.ModelSpace(ActNet(96), example_input=torch.zeros(2, 1, 8, 8))
trainer = rt.Trainer(dataset="digits", epochs=2, batch_size=64, lr=0.05)
SAMPLES = [{"a1": a, "a2": b} for a, b in (("ReLU", "GELU"), ("Tanh", "Sigmoid"),
                                           ("ReLU", "ReLU"), ("GELU", "Tanh"))]


def test_the_family_ignores_the_activations_and_nothing_else():
    models = [act_space.replay(s) for s in SAMPLES]
    assert len({fusion_key(m) for m in models}) == 4  # four architectures
    assert len({fusion_family(m) for m in models}) == 1  # one family
    assert fusion_family(wide_space.replay(SAMPLES[0])) != fusion_family(models[0])


def _built(seed: int):
    torch.manual_seed(seed)
    return [act_space.build(s) for s in SAMPLES]


def test_fused_models_of_other_activations_train_as_each_alone():
    fused_models, alone = _built(0), _built(0)
    lrs = [0.001, 0.003, 0.01, 0.02]
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(fused_models, lrs)]
    solo = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(alone, lrs)]
    fused = fuse_models(fused_models)
    fopt = FusedOptimizer(fused, opts)
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        x, y = torch.randn(32, 1, 8, 8, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        out = fused(x)
        losses = [F.cross_entropy(out[k], y) for k in range(4)]
        sum(losses).backward()
        fopt.step()
        fopt.zero_grad()
        for k, (m, opt) in enumerate(zip(alone, solo)):
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            assert losses[k].item() == pytest.approx(loss.item(), rel=1e-5)  # measured: ~1e-7
    for m, a in zip(fused_models, alone):  # each model's own weights, in its own layout
        for (name, p), (_, q) in zip(m.state_dict().items(), a.state_dict().items()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


def test_models_differing_where_no_place_can_hold_it_are_refused():
    class Other(nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.fc, self.out, self.out2 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
            self.a = nn.LayerNorm(4) if norm else nn.Linear(4, 4)
            self.b = nn.LayerNorm(4) if norm else nn.Linear(4, 4)

        def forward(self, x):  # the place (a, b) has two outputs: common nodes read both
            y = self.a(self.fc(x))
            return self.out(y) + self.out2(self.b(y))
    with pytest.raises(FusionError, match="differs from model 0.*2 outputs"):
        fuse_models([Other(True), Other(False)])


def _search(tmp_path, name, **kw):
    db = tmp_path / f"{name}.db"
    rt.Experiment(act_space, rt.strategies.GridSearch(), trainer, store=str(db),
                  executor=InProcessExecutor(), seed=0, max_models=8, **kw).run()
    return db


def test_a_search_choosing_activations_fuses_its_architectures_by_default(tmp_path):
    auto = o._curves(_search(tmp_path, "auto"))
    units = [u for r in o._plans(tmp_path / "auto.db") for u in r["units"]]
    fused = [u for u in units if u.get("fused")]
    assert fused and max(len(u["trials"]) for u in fused) >= 2
    off = o._curves(_search(tmp_path, "off", optimize=False))
    assert auto.keys() == off.keys() and len(off) == 8
    for key, (state, curves) in off.items():
        for name, points in curves.items():
            assert [v for _, v in auto[key][1][name]] == pytest.approx(
                [v for _, v in points], rel=1e-4), (key, name)
    assert o._curves(_search(tmp_path, "again")) == auto  # reproducible
