"""A frozen trunk whose BatchNorms train in train mode (``requires_grad=False``, running
statistics updated) is shared exactly: a grouped job of heads on it equals each model trained
alone bit for bit on CPU (metrics at every step, every checkpoint tensor, running statistics
included) across segments; models whose statistics differ fall back to their own copies and
still equal; dropout in the trunk is never shared; a whole search with ``optimize=True`` equals
``optimize=False`` and its plans rows show the trunk shared (docs/optimization.md, "Frozen
parameters")."""
import os
import re

import pytest
import torch
from torch import nn

import retiarii as rt
from engine_helpers import InProcessExecutor
from retiarii.engine.storage import checkpoint as ckpt
from retiarii.engine.jobs.job import Job, JobFinished, TrialResult, TrialTask
from retiarii.engine.worker_side.dedicated_group import DedicatedGroup, dedicated_modules
from retiarii.engine.worker_side.training_group import TrainingGroup
from retiarii.engine.jobs.contract import GroupOrder
from retiarii.engine.storage.plans_table import PlanTable
from retiarii.engine.storage.store import Store
from retiarii.engine.worker_side.worker import WorkerContext, _open_task, _units, run_job
from retiarii.optim.build import GroupError, build_group
from retiarii.optim.cse import cse
from retiarii.optim.plan import PlanModel, Role, build_plan
from retiarii.optim.state import state_digests, with_states


class Trunk(nn.Module):
    """A frozen conv trunk with train-mode BatchNorms (frozen the usual way) and a head."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        layers = [nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))  # draws in train mode: each model's own
        layers += [nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                   nn.AdaptiveAvgPool2d(2), nn.Flatten()]
        self.trunk = nn.Sequential(*layers)
        self.head = nn.Linear(32, 10)
        self.trunk.requires_grad_(False)

    def forward(self, x):
        return self.head(self.trunk(x))


def _heads():
    return {"lin": nn.Linear(32, 10),
            "mlp": nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 10)),
            "bn": nn.Sequential(nn.Linear(32, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                nn.Linear(16, 10)),
            "drop": nn.Sequential(nn.Linear(32, 16), nn.Dropout(0.3), nn.ReLU(),
                                  nn.Linear(16, 10))}


def _space(dropout=0.0):
    torch.manual_seed(0)  # the trunk's frozen values: the same in every process
    base = Trunk(dropout)
    with torch.no_grad():  # "pretrained" statistics, not the defaults: copied to every model
        for m in base.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return rt.ModelSpace(base, [rt.apply_mutator("head", rt.mutators.OperatorMutator(
        _heads(), label="h"))], example_input=torch.randn(2, 1, 8, 8))


SPACE = _space()
DROP_SPACE = _space(dropout=0.2)
TRAINER = {"class": "retiarii.engine.trainers.trainer:ClassifierTrainer",
           "config": {"batch_size": 128, "epochs": 2, "lr": 3e-3, "lr_schedule": "cosine"}}
HEAD = {"a": "lin", "b": "mlp", "c": "bn", "d": "drop"}


def _task(trial, tmp, start=0, stop=2, space="SPACE", checkpoint_in=None, tag=""):
    spec = {"space": f"{os.path.abspath(__file__)}:{space}", "sample": {"h/head": HEAD[trial]},
            "trainer": TRAINER, "hparams": {}, "seed": 1 + "abcd".index(trial)}
    return TrialTask(trial, spec, start, stop, checkpoint_in, str(tmp / f"{tag}{trial}-{stop}.pt"))


def _run(job):
    events = []
    run_job(job, events.append)
    assert isinstance(events[-1], JobFinished), events[-1]
    return {(e.trial_id, e.step): e.metrics for e in events if isinstance(e, TrialResult)}


def _alone(tasks):
    out = {}
    for task in tasks:
        out.update(_run(Job(f"alone-{task.trial_id}", [task])))
    return out


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _group(tasks, meta=None, kind=TrainingGroup):
    """The TrainingGroup the worker builds for ``tasks`` (to read what it shares)."""
    units = _units(Job("g", tasks, meta=meta or {"group": True}), tasks,
                   {t.trial_id: _open_task(t, WorkerContext()) for t in tasks}, WorkerContext())
    assert [type(u) for u in units] == [kind], units
    return units[0]


def _shared_bn_holders(group):
    """For each shared frozen BatchNorm of the group's plan: its holders."""
    plan = group._group.plan
    return [plan.nodes[k].holders for k in plan.nodes if k in plan.shared
            and plan.nodes[k].stateful]


def test_the_trunk_is_frozen_and_starts_from_the_base_statistics():
    graph = SPACE.bases[0][0]
    assert graph["trunk.1"].op.spec["frozen"] is True  # a BatchNorm whose weights do not train
    model = SPACE.build({"h/head": "lin"})
    bn = model.get_submodule("trunk.1")
    assert not bn.weight.requires_grad and not bn.bias.requires_grad
    assert not torch.equal(bn.running_var, torch.ones(8))  # the base's statistics, copied
    plan = cse(build_plan([PlanModel(t, SPACE.replay({"h/head": h}), "d")
                           for t, h in HEAD.items()])).plan
    shared = [plan.nodes[k] for k in plan.shared]
    assert sum(n.stateful and n.role is Role.FROZEN for n in shared) == 2  # both BatchNorms
    assert plan.executions() == 9 + 4 * 2  # the trunk's 9 nodes once; a head and an output each


def test_models_whose_statistics_differ_get_their_own_copies():
    samples = {t: {"h/head": h} for t, h in HEAD.items()}
    models = {t: SPACE.build(s) for t, s in samples.items()}
    with torch.no_grad():
        models["c"].get_submodule("trunk.1").running_mean.add_(0.25)  # c: other statistics
    plan = cse(build_plan([PlanModel(t, SPACE.replay(s), "d") for t, s in samples.items()])).plan
    result = with_states(plan, state_digests(plan, models))
    assert result.modified
    first_bn = [result.plan.nodes[k] for k in result.plan.shared
                if result.plan.nodes[k].name == "trunk.1"]
    assert [n.holders for n in first_bn] == [("a", "b", "d")]  # c's BatchNorm is its own
    conv = [k for k in result.plan.shared if result.plan.nodes[k].name == "trunk.0"]
    assert len(conv) == 1 and result.plan.nodes[conv[0]].holders == tuple(HEAD)
    again = with_states(result.plan, state_digests(result.plan, models))
    assert not again.modified and again.plan is result.plan  # idempotent


def test_a_grouped_job_equals_each_model_alone_across_two_segments(tmp_path):
    """Epoch 1 grouped, checkpoints, epoch 2 grouped from them == epochs 1-2 alone: metrics
    at every step and every checkpoint tensor, the trunk's running statistics included."""
    first = [_task(t, tmp_path, stop=1, tag="g-") for t in HEAD]
    group = _group(first)
    assert _shared_bn_holders(group) == [tuple(HEAD)] * 2  # the whole trunk, once
    got = _run(Job("g1", first, meta={"group": True}))
    second = [_task(t, tmp_path, start=1, stop=2, tag="g-", checkpoint_in=f.checkpoint_out)
              for t, f in zip(HEAD, first)]
    assert _shared_bn_holders(_group(second)) == [tuple(HEAD)] * 2  # equal again: shared
    got.update(_run(Job("g2", second, meta={"group": True})))
    alone = [_task(t, tmp_path, tag="s-") for t in HEAD]
    assert got == _alone(alone)  # exact floats at steps 1 and 2
    for g, s in zip(second, alone):
        mine, ref = ckpt.load(g.checkpoint_out), ckpt.load(s.checkpoint_out)
        assert _same(mine, ref), g.trial_id
        stats = mine["model"]["trunk.4.running_mean"]  # trained: not the base's any more
        assert not torch.equal(stats, SPACE.build({"h/head": "lin"}).get_submodule("trunk.4").running_mean)


def test_statistics_that_differ_fall_back_and_still_equal_alone(tmp_path):
    """One model resumes with other running statistics (an exploit copied another trial's
    checkpoint, say): its trunk is its own from the first BatchNorm on, the others share."""
    first = [_task(t, tmp_path, stop=1, tag="g-") for t in HEAD]
    _run(Job("g1", first, meta={"group": True}))
    state = ckpt.load(first[2].checkpoint_out)  # c's
    state["model"]["trunk.1.running_var"] = state["model"]["trunk.1.running_var"] * 1.5
    state["model"]["trunk.1.num_batches_tracked"] += 7
    ckpt.save(first[2].checkpoint_out, state)
    second = [_task(t, tmp_path, start=1, stop=2, tag="g2-", checkpoint_in=f.checkpoint_out)
              for t, f in zip(HEAD, first)]
    group = _group(second)
    assert _shared_bn_holders(group) == [("a", "b", "d")] * 2
    got = _run(Job("g2", second, meta={"group": True}))
    alone = [_task(t, tmp_path, start=1, stop=2, tag="s2-", checkpoint_in=f.checkpoint_out)
             for t, f in zip(HEAD, first)]
    assert got == _alone(alone)
    for g, s in zip(second, alone):
        assert _same(ckpt.load(g.checkpoint_out), ckpt.load(s.checkpoint_out)), g.trial_id


def test_dropout_in_a_frozen_trunk_is_never_shared(tmp_path):
    tasks = [_task(t, tmp_path, space="DROP_SPACE", tag="g-") for t in "abc"]
    plan = _group(tasks)._group.plan
    names = {plan.nodes[k].name for k in plan.shared}
    assert {"trunk.0", "trunk.1", "trunk.2"} <= names  # conv, BatchNorm, ReLU before it
    assert not names & {"trunk.3", "trunk.4", "trunk.5"}  # the dropout and all after it
    got = _run(Job("g", tasks, meta={"group": True}))
    alone = [_task(t, tmp_path, space="DROP_SPACE", tag="s-") for t in "abc"]
    assert got == _alone(alone)
    for g, s in zip(tasks, alone):
        assert _same(ckpt.load(g.checkpoint_out), ckpt.load(s.checkpoint_out)), g.trial_id


def test_a_shared_part_with_statistics_is_never_computed_ahead(tmp_path):
    """A dedicated device would compute the trunk a batch ahead in a copy, whose statistics
    the models would never see: such a group computes it in place, and equals alone."""
    tasks = [_task(t, tmp_path, stop=1, tag="d-") for t in "abc"]
    meta = {"group": GroupOrder(dedicated=("trunk.*",), dedicated_device="thread", profile=())}
    group = _group(tasks, meta, DedicatedGroup)
    assert group.dedicated == [] and group._group.holds_state
    assert dedicated_modules(group._group.shared, ["trunk.*"])  # which the patterns name
    group.drop(group.trials)
    got = _run(Job("d", tasks, meta=meta))
    alone = [_task(t, tmp_path, stop=1, tag="s-") for t in "abc"]
    assert got == _alone(alone)
    for g, s in zip(tasks, alone):
        assert _same(ckpt.load(g.checkpoint_out), ckpt.load(s.checkpoint_out)), g.trial_id


def _search(tmp_path, name, optimize, **kwargs):
    db = tmp_path / f"{name}.db"
    exp = rt.Experiment(SPACE, rt.strategies.GridSearch(), rt.Trainer(
        dataset="digits", epochs=2, batch_size=128), store=str(db), executor=InProcessExecutor(),
        seed=0, max_models=4, optimize=optimize, **kwargs)
    exp.run()
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        curves = {}
        for t in store.trials():
            curves[str(sorted(t["spec"]["choices"].items()))] = (t["state"], {
                m: store.learning_curve(t["id"], m) for m in ("train_loss", "val_loss", "val_acc")})
        return curves, PlanTable(store).rows()


def test_a_search_of_heads_on_the_trunk_equals_optimize_false(tmp_path):
    off, _ = _search(tmp_path, "off", False)
    on, rows = _search(tmp_path, "on", True, fuse=False, batching=False)
    assert len(on) == 4 and on == off  # bit for bit, every step of every model
    # the default: the layout measured on the real batches (the trunk timed alone through the
    # group's shared cell); four architectures, so nothing fuses and every layout is exact
    auto, auto_rows = _search(tmp_path, "auto", "auto")
    assert auto == off and auto_rows
    assert any(u.get("decision") for r in auto_rows for u in r["units"]), auto_rows
    merged = [r for r in rows if r["status"] == "merged"]
    assert merged and {t for r in merged for t in r["trials"]} and all(
        len(r["trials"]) == 4 for r in merged)
    # the trunk (input, 2 convs, 2 BatchNorms, 2 ReLUs, pool, flatten) computed once
    assert all(u["shared_nodes"] == 9 for r in merged for u in r["units"])


def test_a_trunk_worth_sharing_takes_cse_unmeasured_bit_for_bit(tmp_path, monkeypatch):
    """The default's group of heads on a frozen trunk whose CSE gains at least CSE_TAKE
    (device_model.cse_floor: the trunk once, against what a group costs) trains in CSE
    without timing a batch or profiling a model alone (measuring it had cost workloads (b)
    and (d) a tenth of their search), says so in the plans table, and trains bit for bit as
    unoptimized; with the floor's threshold out of reach it measures as before."""
    from retiarii.engine.worker_side import group_layouts as layouts
    from retiarii.engine.worker_side.training_group import TrainingGroup

    off, _ = _search(tmp_path, "off", False)
    measured = []
    for name in ("_live_plans", "probe"):
        real = getattr(layouts, name)
        monkeypatch.setattr(layouts, name, lambda *a, _real=real, _name=name, **k: (
            measured.append(_name), _real(*a, **k))[1])
    profiled = []
    real_profile = TrainingGroup._profile
    monkeypatch.setattr(TrainingGroup, "_profile", lambda self, *a, **k: (
        profiled.append(1), real_profile(self, *a, **k))[1])
    monkeypatch.setattr(layouts, "CSE_TAKE", 0.5)  # this small trunk's floor: about 0.76
    auto, rows = _search(tmp_path, "auto", "auto")
    assert auto == off and measured == [] and profiled == []
    units = [u for r in rows if r["status"] == "merged" for u in r["units"]]
    assert units and all(u["layout"] == "cse" for u in units)
    line = [p for u in units for p in u["choice"]["predicted"] if "cse at least" in p]
    assert line and re.fullmatch(r"4 models: cse at least \d+\.\d\dx \(at or over 0\.5x: "
                                 r"frozen layers computed once, one loader\): cse, not measured",
                                 line[0]), line
    monkeypatch.setattr(layouts, "CSE_TAKE", 1e9)
    again, _ = _search(tmp_path, "measured", "auto")
    assert again == off and measured


class Tied(nn.Module):
    """One frozen BatchNorm at two places: after the frozen layer (shared) and after the
    head (each model's own)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 6).requires_grad_(False)
        self.bn = nn.BatchNorm1d(6).requires_grad_(False)
        self.head = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(self.bn(self.head(self.bn(self.stem(x)))))


def test_a_batchnorm_tied_across_the_divergence_is_refused():
    torch.manual_seed(0)
    space = rt.ModelSpace(Tied(), [rt.apply_mutator("head", rt.mutators.OperatorMutator(
        {"a": nn.Linear(6, 6), "b": nn.Sequential(nn.Linear(6, 6), nn.Tanh())}, label="h"))],
        example_input=torch.randn(2, 6))
    samples = {"t0": {"h/head": "a"}, "t1": {"h/head": "b"}}
    plan = cse(build_plan([PlanModel(t, space.replay(s), "d") for t, s in samples.items()])).plan
    assert any(plan.nodes[k].stateful for k in plan.shared)  # the first call: shareable
    with pytest.raises(GroupError, match="untie it"):
        build_group(plan, {t: space.build(s) for t, s in samples.items()})
