"""Which parts of a group switch RNG streams (engine/worker_side/group_forward.py ``Streams``).

A group swaps a trial's streams in only around what may draw random numbers: the cells
``plan.may_draw_random`` cannot prove draw-free, and the trainer's steps unless the trainer
says they draw nothing (``Trainer.steps_draw_random``). The references: a user's module that
draws in any way the analysis can see (a torch random function, a tensor's random method,
dropout inside it, Python's or NumPy's generator during its trace, a branch only taken in
eval mode, an untraceable forward) is found to draw; a draw-free adapter is not; a grouped
job whose trainer's steps draw equals each trial alone bit for bit, streams in its checkpoint
included; and the adapters group, whose cells and steps draw nothing, switches no stream.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

import retiarii as rt
from model_spaces import adapters
from model_spaces._mobile import mobilenetv2
from retiarii.engine.worker_side import training_group as grouped
from retiarii.engine.worker_side.group_candidates import plan_group
from retiarii.engine.worker_side.training_group import TrainingGroup
from retiarii.engine.trainers.trainer import ClassifierTrainer, Trainer, TrialRun
from retiarii.optim.plan import _traced_may_draw, may_draw_random


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(x + self.lin(x)).flatten(1) * 0.5


class TorchNoise(Residual):
    def forward(self, x):
        return x + torch.randn_like(x)


class MethodNoise(Residual):
    def forward(self, x):
        return x * x.new_empty(x.shape).bernoulli_(0.5)


class InnerDropout(Residual):
    def __init__(self):
        super().__init__()
        self.drop = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2))

    def forward(self, x):
        return self.drop(x)


class PythonCoin(Residual):
    def forward(self, x):  # drawn while tracing: no node, but the stream moves
        return x * 2 if random.random() < 0.5 else x


class NumpyScale(Residual):
    def forward(self, x):
        return x * float(np.random.rand())


class EvalNoise(Residual):
    def forward(self, x):
        return x if self.training else x + torch.rand_like(x)


class Untraceable(Residual):
    def forward(self, x):
        return x if x.sum() > 0 else -x  # data-dependent control flow


@pytest.mark.parametrize("cls, draws", [
    (Residual, False), (TorchNoise, True), (MethodNoise, True), (InnerDropout, True),
    (PythonCoin, True), (NumpyScale, True), (EvalNoise, True), (Untraceable, True)])
def test_a_users_module_is_traced_to_find_its_draws(cls, draws):
    with torch.device("meta"):
        module = cls()
    streams = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    assert _traced_may_draw(module) is draws
    # The analysis leaves the process's streams as they were... except what a module drew
    # while traced, which is the user's forward's own doing; it never draws itself.
    if cls not in (PythonCoin, NumpyScale):
        assert random.getstate() == streams[0]
        assert np.array_equal(np.random.get_state()[1], streams[1])
        assert torch.equal(torch.get_rng_state(), streams[2])


class NoisyAdapter(nn.Module):
    """The space's adapter with multiplicative noise: its cell must run in its trial's streams."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        return x + self.conv(x) * (1 + 0.1 * torch.randn_like(x))


def _space(adapter: type) -> rt.ModelSpace:
    """adapters.small() with ``adapter`` after the chosen block."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        stages = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 2, 1))
        net = adapters.AdapterNet(mobilenetv2(25, 1000, 3, 1, stages, 64), 10)
        slots = [adapter(block.body[-1][0].out_channels) for block in net.backbone.layers]
    return rt.ModelSpace(net, [rt.apply_mutator(adapters.block_ends(net),
                                                adapters.AdapterAfterBlock(slots))],
                         example_input=torch.randn(2, 3, 16, 16))


class Augmenting(ClassifierTrainer):
    """Weighs each batch's loss by a random factor (torch's and Python's generators): its
    steps draw. (A grouped job calls the model on the batch itself, so the noise goes here.)"""

    def training_step(self, model, batch, hparams):
        weight = 1 + 0.1 * torch.rand(()) + 0.1 * random.random()
        return weight * super().training_step(model, batch, hparams)


class _Counting(grouped.Streams):
    switches = 0

    def use(self, trial):
        if trial is not None and getattr(self.runs[trial], "_rng", None) is None:
            trial = None
        _Counting.switches += trial != self.current
        super().use(trial)


def _runs(space, trainer, blocks):
    return {f"m{i}": TrialRun(lambda b=b: space.build({"block": b}, check=False), trainer, {},
                              seed=i, trial_id=f"m{i}") for i, b in enumerate(blocks)}


@pytest.mark.parametrize("adapter, trainer, switch", [
    (adapters.Adapter, ClassifierTrainer, False),  # nothing draws: nothing switches
    (NoisyAdapter, ClassifierTrainer, True),  # the adapters' cells draw
    (adapters.Adapter, Augmenting, True)])  # the steps draw
def test_a_group_switches_streams_only_for_what_draws_and_equals_each_trial_alone(
        monkeypatch, adapter, trainer, switch):
    space, blocks = _space(adapter), (0, 3, 1)
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(80, 3, 16, 16, generator=g), torch.randint(0, 10, (80,), generator=g))
    trainer = trainer(dataset=data, batch_size=16, optimizer="sgd", lr=0.05, val_fraction=0.2)
    plan = plan_group({f"m{i}": space.replay({"block": b}) for i, b in enumerate(blocks)},
                      trainer.data_key({}), {f"m{i}": {} for i in range(3)}, batch_ops=True)
    runs = _runs(space, trainer, blocks)
    group = TrainingGroup(plan.restrict(list(runs)), runs, trainer)
    assert may_draw_random(space.replay({"block": 1}).graph) is (adapter is NoisyAdapter)
    cells = {c.name: c.random for c in group._group._cells}
    assert any(cells.values()) is (adapter is NoisyAdapter), cells
    monkeypatch.setattr(grouped, "Streams", _Counting)  # as training_group names it
    _Counting.switches = 0
    got = group.train_epoch()
    assert (_Counting.switches > 0) is switch
    separate = _runs(space, trainer, blocks)
    alone = {t: run.train_epoch() for t, run in separate.items()}
    assert got.keys() == alone.keys()
    for t in alone:
        for name, value in alone[t].items():
            assert got[t][name] == pytest.approx(value, rel=1e-5), (t, name)
        # Each trial's streams moved exactly as alone: the next draws are the same.
        with runs[t]._own_rng():
            mine = (torch.rand(3), random.random(), np.random.rand())
        with separate[t]._own_rng():
            theirs = (torch.rand(3), random.random(), np.random.rand())
        assert torch.equal(mine[0], theirs[0]) and mine[1:] == theirs[1:], t


def test_trainers_say_whether_their_steps_draw():
    assert ClassifierTrainer().steps_draw_random() is False

    class Declared(Augmenting):  # says so (wrongly here): believed
        def steps_draw_random(self):
            return False

    assert Augmenting().steps_draw_random() is True
    assert Declared().steps_draw_random() is False
    assert Trainer.steps_draw_random(Augmenting()) is True  # the base's default
