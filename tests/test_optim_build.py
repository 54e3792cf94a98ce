"""Training N models through one GroupModule equals training each alone: the same loss at
every step and the same checkpoint (weights, optimizer, LR scheduler, RNG streams), bit for
bit on CPU, with dropout and train-mode BatchNorm in the models' own parts."""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import retiarii as rt
from retiarii.engine.trainers.trainer import ClassifierTrainer
from retiarii.engine.trainers.trial_training import TrialRun, _to_device
from retiarii.optim.build import GroupError, build_group
from retiarii.optim.cse import cse
from retiarii.optim.plan import PlanModel, build_plan


class Frozen(nn.Module):
    """A frozen convolutional trunk (conv, relu, pool) and a trainable head the space swaps."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.act = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.head = nn.Linear(32, 10)
        self.conv.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.flatten(self.pool(self.act(self.conv(x))), 1))


HEADS = {
    "lin": nn.Linear(32, 10),
    "drop": nn.Sequential(nn.Linear(32, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 10)),
    "bn": nn.Sequential(nn.Linear(32, 16), nn.BatchNorm1d(16), nn.ReLU(inplace=True),
                        nn.Linear(16, 10)),
}

torch.manual_seed(0)
SPACE = rt.ModelSpace(Frozen(), [rt.apply_mutator("head", rt.mutators.OperatorMutator(
    HEADS, label="h"))], example_input=torch.randn(2, 1, 8, 8))
TRIALS = {"a": "drop", "b": "bn", "c": "lin", "d": "drop"}  # d: a's model, another seed
TRAINER = ClassifierTrainer(batch_size=128, epochs=2, lr=3e-3, lr_schedule="cosine")


def _run(trial, seed):
    sample = {"h/head": TRIALS[trial]}
    return TrialRun(lambda: SPACE.build(sample, check=False), TRAINER, seed=seed,
                    trial_id=trial)


def _plan(trials):
    key = TRAINER.data_key({})
    return cse(build_plan([PlanModel(t, SPACE.replay({"h/head": TRIALS[t]}), key)
                           for t in trials])).plan


def _merged_epoch(runs, group, losses):
    """One epoch of every run through the group: what a multi-model job will do."""
    trials = list(runs)
    first = runs[trials[0]]
    for run in runs.values():  # what TrialRun.train_epoch does around its loop
        run.model.train()
    group.train()
    for batch in TRAINER.train_dataloader(first.hparams, first.epoch):  # one loader for all
        x, y = _to_device(batch, first.device)
        outs = group(x, rng={t: runs[t]._own_rng for t in trials})
        step = {t: F.cross_entropy(outs[t], y) for t in trials}
        for run in runs.values():
            run.optimizer.zero_grad(set_to_none=True)
        sum(step.values()).backward()  # grads of each model's weights come from its loss only
        for t in trials:
            runs[t].optimizer.step()
            losses[t].append(step[t].detach())
    for t in trials:
        runs[t].scheduler.step()
        runs[t].epoch += 1


def _alone_epoch(run, losses):
    """TrialRun.train_epoch's loop, recording every step's loss (the reference)."""
    with run._own_rng():
        run.model.train()
        for batch in TRAINER.train_dataloader(run.hparams, run.epoch):
            x, y = _to_device(batch, run.device)
            loss = F.cross_entropy(run.model(x), y)
            run.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            run.optimizer.step()
            losses.append(loss.detach())
        run.scheduler.step()
    run.epoch += 1


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_merged_training_equals_training_alone():
    seeds = {t: i + 1 for i, t in enumerate(TRIALS)}
    alone = {t: _run(t, seeds[t]) for t in TRIALS}
    alone_losses = {t: [] for t in TRIALS}
    for t, run in alone.items():
        for _ in range(2):
            _alone_epoch(run, alone_losses[t])

    merged = {t: _run(t, seeds[t]) for t in TRIALS}
    plan = _plan(TRIALS)
    assert plan.groups() == [tuple(TRIALS)]
    assert {plan.nodes[k].name for k in plan.shared} == {"x", "conv", "act", "pool", "flatten"}
    group = build_group(plan, {t: run.model for t, run in merged.items()})
    group.graph.lint()
    merged_losses = {t: [] for t in TRIALS}
    for _ in range(2):
        _merged_epoch(merged, group, merged_losses)

    for t in TRIALS:
        assert len(merged_losses[t]) == len(alone_losses[t]) == 2 * 12
        assert all(torch.equal(a, b) for a, b in zip(alone_losses[t], merged_losses[t])), t
        mine, ref = merged[t].state_dict(), alone[t].state_dict()
        assert list(group.state_dict_of(t)) == list(ref["model"])  # the layout of training alone
        for part in ("model", "optimizer", "lr_scheduler", "rng", "data_position"):
            assert _same(mine[part], ref[part]), (t, part)
        # validation through the trial's own model is unchanged too
        assert merged[t]._validate() == alone[t]._validate()
    # the frozen trunk is one object, with the base's values
    assert group.model("a").conv is group.model("b").conv
    assert not group.model("a").conv.weight.requires_grad


def test_a_checkpoint_written_alone_resumes_in_a_group(tmp_path):
    """b trained one epoch alone and checkpointed; its second epoch, in a group with c (also
    at epoch 1), equals its second epoch alone, and so does c's."""
    ref = {"b": _run("b", 7), "c": _run("c", 3)}
    for run in ref.values():
        _alone_epoch(run, [])
    ref["b"].save(str(tmp_path / "b.pt"))
    c = _run("c", 3)
    _alone_epoch(c, [])
    runs = {"b": TrialRun(lambda: SPACE.build({"h/head": "bn"}, check=False), TRAINER,
                          checkpoint=str(tmp_path / "b.pt"), trial_id="b"), "c": c}
    expected = {t: [] for t in ref}
    for t, run in ref.items():
        _alone_epoch(run, expected[t])
    got = {t: [] for t in ref}
    _merged_epoch(runs, build_group(_plan(["b", "c"]), {t: r.model for t, r in runs.items()}),
                  got)
    for t in ref:
        assert all(torch.equal(a, b) for a, b in zip(expected[t], got[t])), t
        assert _same(runs[t].state_dict()["model"], ref[t].state_dict()["model"])


def test_groups_need_one_data_pipeline_and_equal_frozen_values():
    m = SPACE.replay({"h/head": "lin"})
    plan = cse(build_plan([PlanModel("a", m, "d1"), PlanModel("b", m, "d2")])).plan
    built = {t: SPACE.build({"h/head": "lin"}, check=False) for t in "ab"}
    with pytest.raises(GroupError, match="data pipeline"):
        build_group(plan, built)
    assert [build_group(plan.restrict([g]), built).trials for g in ("a", "b")] == [("a",), ("b",)]
    plan = cse(build_plan([PlanModel("a", m, "d"), PlanModel("b", m, "d")])).plan
    with torch.no_grad():
        built["b"].conv.weight.add_(1)
    with pytest.raises(GroupError, match="different values"):
        build_group(plan, built)


def test_in_place_parts_do_not_touch_what_others_read():
    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Linear(4, 4).requires_grad_(False)
            self.act = nn.ReLU(inplace=True)
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            y = self.stem(x)
            return self.head(self.act(y) + y)  # the in-place relu changes y for the add too

    torch.manual_seed(0)
    space = rt.ModelSpace(Skip(), [rt.apply_mutator("head", rt.mutators.OperatorMutator(
        [nn.Linear(4, 2), nn.Linear(4, 2, bias=False)], label="h"))],
        example_input=torch.randn(2, 4))
    models = list(space.enumerate())
    plan = cse(build_plan([PlanModel(str(i), m, "d") for i, m in enumerate(models)])).plan
    assert {plan.nodes[k].name for k in plan.shared} == {"x", "stem"}  # not the relu
    built = {str(i): space.build(m.sample, check=False) for i, m in enumerate(models)}
    x = torch.randn(3, 4)
    expected = {t: m(x) for t, m in built.items()}
    outs = build_group(plan, built)(x)
    assert all(torch.equal(outs[t], expected[t]) for t in built)


def test_merged_graph_is_ir():
    plan = _plan(["a", "c"])
    group = build_group(plan, {t: SPACE.build({"h/head": TRIALS[t]}, check=False)
                               for t in ("a", "c")})
    g = group.graph
    g.lint()
    assert [n.name for n in g.nodes if n.kind == "subgraph"] == ["shared", "part_0", "part_1"]
    shared = g["shared"].op.graph
    assert [n.op.describe() for n in shared.nodes] == \
        ["input", "Conv2d", "ReLU", "AdaptiveAvgPool2d", "flatten", "output"]
    assert rt.Graph.from_json(g.to_json()).to_json() == g.to_json()
