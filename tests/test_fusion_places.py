"""Fusion across architectures that differ by a layer with weights at one place (issue #26
item 2): a 3x3 convolution, a 5x5 one or a depthwise-separable block; a Linear of another
width. The common layers fuse, each model runs its own layers at the place
(``optim.fused_segments``), and every model trains, checkpoints and resumes as alone."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import retiarii as rt
import test_optimize as o
from engine_helpers import InProcessExecutor
from retiarii.engine.executors.base import JobFailed, JobFinished
from retiarii.optim import FusedOptimizer, fuse_models, fusion_family, fusion_key
from retiarii.optim import device_model as dm
from retiarii.optim.fused_segments import PerModelSegment


class DWSep(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dw, self.pw = nn.Conv2d(c, c, 3, 1, 1, groups=c), nn.Conv2d(c, c, 1)

    def forward(self, x):
        return self.pw(self.dw(x))


class ConvNet(nn.Module):
    """A small CNN whose middle layer is chosen: conv3x3, conv5x5 or depthwise-separable."""

    def __init__(self):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(1, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8)
        self.mid = rt.nn.LayerChoice({"c3": nn.Conv2d(8, 8, 3, 1, 1), "c5": nn.Conv2d(8, 8, 5, 1, 2),
                                      "dw": DWSep(8)}, label="mid")
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(8, 10)

    def forward(self, x):
        x = torch.relu(self.bn(self.stem(x)))
        return self.fc(self.pool(torch.relu(self.mid(x))).flatten(1))


class Bottleneck(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a, self.b = nn.Linear(64, width), nn.Linear(width, 64)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class PlaceMLP(nn.Module):
    """64-64-64-[place]-64-10: the place holds a Linear or a bottleneck of another width."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc4 = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        self.mid = rt.nn.LayerChoice({"lin": nn.Linear(64, 64), "narrow": Bottleneck(16),
                                      "wide": Bottleneck(96)}, label="mid")
        self.out = nn.Linear(64, 10)

    def forward(self, x):
        x = torch.relu(self.fc2(torch.relu(self.fc1(x.flatten(1)))))
        return self.out(torch.relu(self.fc4(torch.relu(self.mid(x)))))


conv_space = rt.ModelSpace(ConvNet(), example_input=torch.zeros(2, 1, 8, 8))
mlp_space = rt.ModelSpace(PlaceMLP(), example_input=torch.zeros(2, 1, 8, 8))
CONV = ["c3", "c5", "dw", "c3", "dw"]
MLP = ["lin", "narrow", "wide", "narrow"]


def test_models_with_another_operator_at_one_place_share_a_family():
    convs = [conv_space.replay({"mid": c}) for c in ("c3", "c5", "dw")]
    assert len({fusion_key(m) for m in convs}) == 3 and len({fusion_family(m) for m in convs}) == 1
    mlps = [mlp_space.replay({"mid": c}) for c in ("lin", "narrow", "wide")]
    assert len({fusion_family(m) for m in mlps}) == 1
    assert fusion_family(mlps[0]) != fusion_family(convs[0])


def _train(space, choices, make_opt, lrs, steps=10, seed=0):
    """Each model alone and all fused over the same batches: their losses per step."""
    torch.manual_seed(seed)
    fused_models = [space.build({"mid": c}) for c in choices]
    torch.manual_seed(seed)
    alone = [space.build({"mid": c}) for c in choices]
    opts = [make_opt(m.parameters(), lr) for m, lr in zip(fused_models, lrs)]
    solo = [make_opt(m.parameters(), lr) for m, lr in zip(alone, lrs)]
    fused = fuse_models(fused_models)
    fopt = FusedOptimizer(fused, opts)
    gen = torch.Generator().manual_seed(seed + 1)
    got, want = [], []
    for _ in range(steps):
        x, y = torch.randn(16, 1, 8, 8, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        out = fused(x)
        losses = [F.cross_entropy(out[k], y) for k in range(len(choices))]
        fopt.zero_grad()
        sum(losses).backward()
        fopt.step()
        got.append([v.item() for v in losses])
        row = []
        for m, opt in zip(alone, solo):
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            row.append(loss.item())
        want.append(row)
    return fused, fused_models, opts, alone, got, want


@pytest.mark.parametrize("space,choices", [(conv_space, CONV), (mlp_space, MLP)], ids=["conv", "mlp"])
@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_fused_models_differing_at_one_place_train_as_each_alone(space, choices, kind):
    make = (lambda ps, lr: torch.optim.Adam(ps, lr=lr)) if kind == "adam" else \
        (lambda ps, lr: torch.optim.SGD(ps, lr=lr * 10, momentum=0.9))
    lrs = [0.001, 0.003, 0.01, 0.02, 0.005][:len(choices)]
    fused, _, _, _, got, want = _train(space, choices, make, lrs)
    segments = [m for m in fused.modules() if isinstance(m, PerModelSegment)]
    assert len(segments) == 1
    # models of one sub-architecture fuse among themselves at the place; a lone one runs alone
    assert sorted(map(len, segments[0].members)) == sorted(
        [choices.count(c) for c in dict.fromkeys(choices)])
    for step, (g, w) in enumerate(zip(got, want)):
        assert g == pytest.approx(w, rel=1e-5), step  # measured: ~1e-7


def test_each_checkpoint_loads_into_its_model_alone():
    make = lambda ps, lr: torch.optim.Adam(ps, lr=lr)  # noqa: E731
    fused, models, opts, alone, _, _ = _train(conv_space, CONV, make, [1e-3, 3e-3, 1e-2, 2e-2, 5e-3],
                                               steps=4)
    x = torch.randn(8, 1, 8, 8)
    fused.eval()
    out = fused(x)
    for k, (model, opt) in enumerate(zip(models, opts)):
        fresh = conv_space.build({"mid": CONV[k]})  # that model's architecture, alone
        fresh.load_state_dict({n: t.clone() for n, t in model.state_dict().items()})
        fresh.eval()
        torch.testing.assert_close(fresh(x), out[k], rtol=1e-5, atol=1e-6)
        own = torch.optim.Adam(fresh.parameters(), lr=1.0)
        own.load_state_dict(opt.state_dict())  # the alone layout: every parameter, its step
        assert len(own.state_dict()["state"]) == len(list(fresh.parameters()))
        assert all(int(s["step"]) == 4 for s in own.state_dict()["state"].values())


def test_the_device_model_counts_the_place_as_unfused():
    same = dm.StepCosts(("fc1:Linear(a)", "relu:relu", "mid:Linear(b)"), 3e6, 0.0, (1e6, 0, 2e6))
    other = dm.StepCosts(("fc1:Linear(a)", "relu:relu", "mid:Linear(c)"), 3e6, 0.0, (1e6, 0, 2e6))
    dev = dm.DEVICES["cpu"]
    rate, fused_rate = (dev.rate * dm._device("cpu")[1], dev.fused_rate * dm._device("cpu")[1])
    apart = 2 * (3 * dev.op_s + dev.model_s + 3 * 3e6 / rate)
    # fused: fc1 and relu once; each model's "mid" as alone, two calls for its place
    fused = ((2 + 2 * 2) * dev.fused_op_s + 2 * dev.fused_model_s
             + 2 * (dev.op_s + 3 * 2e6 / rate) + 3 * 2 * 1e6 / fused_rate)
    assert dm.predicted_fused_speedup([same, other], "cpu") == pytest.approx(apart / fused)
    assert dm.predicted_fused_speedup([same, other]) < dm.predicted_fused_speedup([same, same])


TRAINER = rt.Trainer(dataset="digits", epochs=2, batch_size=64,
                     lr=rt.ValueChoice([0.02, 0.05], label="lr"))


def _search(tmp_path, name, executor=None, **kw):
    db = tmp_path / f"{name}.db"
    rt.Experiment(mlp_space, rt.strategies.GridSearch(), TRAINER, store=str(db),
                  executor=executor or InProcessExecutor(), seed=0, max_models=6, **kw).run()
    return db


def _close(got, want):
    assert got.keys() == want.keys() and len(want) == 6
    for key, (_, curves) in want.items():
        for name, points in curves.items():
            assert [v for _, v in got[key][1][name]] == pytest.approx(
                [v for _, v in points], rel=1e-4), (key, name)


def test_a_default_search_choosing_a_layer_at_one_place_is_fused_only_on_request(tmp_path):
    """On a CPU the device model does not fuse models that differ at a place with weights
    (measured slower there): the default fuses at most one architecture's models (its two
    learning rates), reproducibly; fuse=True fuses the architectures, within the fused
    tolerance."""
    off = o._curves(_search(tmp_path, "off", optimize=False))
    auto = o._curves(_search(tmp_path, "auto"))
    # at most one architecture's two learning rates fuse: never two architectures
    units = [u for r in o._plans(tmp_path / "auto.db") for u in r["units"] if u.get("fused")]
    assert all(len(u["trials"]) <= 2 for u in units), units
    _close(auto, off)
    forced = o._curves(_search(tmp_path, "on", fuse=True))
    rows = o._plans(tmp_path / "on.db")
    fused = [u for r in rows for u in r["units"] if u.get("fused")]
    assert fused and max(len(u["trials"]) for u in fused) >= 3  # architectures fuse together
    from retiarii.engine.storage.plans_table import PlanTable
    from retiarii.engine.storage.store import Store
    with Store(tmp_path / "on.db") as store:  # what `retiarii status` prints
        store.use_experiment(store.experiments()[-1]["id"])
        assert PlanTable(store).summary()["fused_trials"] == 6
    _close(forced, off)
    assert o._curves(_search(tmp_path, "again")) == auto  # the default: reproducible


class _Stops(InProcessExecutor):
    """Interrupts the driver (as a kill would) after ``after`` finished jobs."""

    def __init__(self, after):
        super().__init__()
        self.after, self.done = after, 0

    def next_event(self, timeout=None):
        event = super().next_event(timeout)
        if isinstance(event, (JobFinished, JobFailed)):
            self.done += 1
            if self.after is not None and self.done >= self.after:
                raise KeyboardInterrupt
        return event


def test_a_killed_fused_search_resumes_to_the_uninterrupted_one(tmp_path):
    whole = o._curves(_search(tmp_path, "whole"))
    db = tmp_path / "killed.db"
    ex = _Stops(1)

    def exp():
        return rt.Experiment(mlp_space, rt.strategies.GridSearch(), TRAINER, store=str(db),
                             executor=ex, seed=0, max_models=6)
    with pytest.raises(KeyboardInterrupt):
        exp().run()
    assert o._curves(db) != whole  # stopped part-way
    ex.after = None
    exp().resume()
    assert o._curves(db) == whole


def test_each_separate_place_costs_its_gather_and_scatter():
    """A model differing at three separate layers pays three places; a run of differing
    layers (a bottleneck) is one place; weightless differences are no place."""
    assert dm._places([False, True, False, True, False, True], [1, 1, 1, 1, 1, 1]) == 3
    assert dm._places([False, True, True, False], [1, 1, 1, 1]) == 1
    assert dm._places([True, False], [0.0, 1]) == 0  # an activation: PerModelPointwise
    one = dm.StepCosts(("a:L", "b:L", "c:L", "d:L"), 4e6, 0.0, (1e6,) * 4)
    many = dm.StepCosts(("a:L", "b:L2", "c:L", "d:L2"), 4e6, 0.0, (1e6,) * 4)
    few = dm.StepCosts(("a:L", "b:L2", "c:L", "d:L"), 4e6, 0.0, (1e6,) * 4)
    # differing at two places predicts less than at one, with the same FLOPs apart
    gpu = dm.predicted_fused_speedup
    assert gpu([one, many], "cuda") < gpu([one, few], "cuda")
    # on a CPU, models differing at a place with weights are never predicted to gain
    assert dm.predicted_fused_speedup([one, few], "cpu") <= 1.0
