"""A grouped job (``Job.meta["group"]``) equals running each of its tasks alone with run_job:
the same TrialResult metrics at every step and the same checkpoint (every tensor equal), bit
for bit on CPU, with dropout and train-mode BatchNorm in the models' own parts; a trial that
fails fails alone; tasks that cannot share a data pipeline run separately."""
import os

import torch
import retiarii as rt
from torch import nn

from retiarii.engine.storage import checkpoint as ckpt
from retiarii.engine.jobs.job import (
    Job, JobFailed, JobFinished, TrialCheckpointed, TrialResult, TrialTask,
)
from retiarii.engine.executors.local import LocalExecutor
from retiarii.engine.worker_side.group_candidates import GroupCandidate, group_tasks, plan_group
from retiarii.engine.worker_side.training_group import TrainingGroup
from retiarii.engine.trainers.trainer import ClassifierTrainer
from retiarii.engine.worker_side.worker import WorkerContext, _units, run_job
from retiarii.engine.jobs.contract import GroupOrder

import test_optim_build as _optim_build


# The frozen-trunk space of the group-module tests (a frozen conv trunk, three heads); its
# frozen values come from a fixed seed, the same in every process that imports it.
SPACE = _optim_build.SPACE


class DieTrainer(ClassifierTrainer):
    """Raises in the ``die_at``-th training_step of a trial that asks (a bad batch, say)."""

    calls: dict = {}

    def training_step(self, model, batch, hparams):
        if "die_at" in hparams:
            n = self.calls[hparams["tag"]] = self.calls.get(hparams["tag"], 0) + 1
            if n == hparams["die_at"]:
                raise RuntimeError("boom in training_step")
        return super().training_step(model, batch, hparams)


class CloneTrainer(ClassifierTrainer):
    """Calls the model on a copy of the batch: cannot share one forward per batch."""

    def training_step(self, model, batch, hparams):
        x, y = batch
        return nn.functional.cross_entropy(model(x.clone()), y)


CLONE = CloneTrainer(batch_size=128, epochs=2)
DIE = DieTrainer(batch_size=128, epochs=2, lr=3e-3, lr_schedule="cosine")
TRAINER = {"class": "retiarii.engine.trainers.trainer:ClassifierTrainer",
           "config": {"batch_size": 128, "epochs": 2, "lr": 3e-3, "lr_schedule": "cosine"}}
HEAD = {"a": "drop", "b": "bn", "c": "lin", "d": "drop"}  # d: a's model, another seed
SEED = {"a": 1, "b": 2, "c": 3, "d": 4}


def _ref(attr):
    return f"{os.path.abspath(__file__)}:{attr}"


def _task(trial, tmp, start=0, stop=2, head=None, seed=None, hparams=None, trainer=TRAINER,
          checkpoint_in=None, tag=""):
    spec = {"space": _ref("SPACE"), "sample": {"h/head": head or HEAD[trial]},
            "trainer": trainer, "hparams": hparams or {}, "seed": seed or SEED[trial]}
    return TrialTask(trial, spec, start, stop, checkpoint_in,
                     str(tmp / f"{tag}{trial}-{stop}.pt"))


def _run(job):
    events = []
    run_job(job, events.append)
    return events


def _results(events):
    return {(e.trial_id, e.step): e.metrics for e in events if isinstance(e, TrialResult)}


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _alone(tasks):
    """The reference: every task in a job of its own (run_job, no grouping)."""
    results = {}
    for task in tasks:
        events = _run(Job(f"alone-{task.trial_id}", [task]))
        assert isinstance(events[-1], JobFinished), events[-1]
        results.update(_results(events))
    return results


def _same_checkpoint(path_a, path_b):
    a, b = ckpt.load(path_a), ckpt.load(path_b)
    return _same(a, b)


def test_grouped_job_equals_each_task_alone(tmp_path):
    grouped = [_task(t, tmp_path, tag="g-") for t in HEAD]
    alone = [_task(t, tmp_path, tag="s-") for t in HEAD]
    units = _units(Job("g", grouped, meta={"group": True}), grouped,
                   {t.trial_id: _open(t) for t in grouped}, WorkerContext())
    assert [type(u) for u in units] == [TrainingGroup] and units[0].trials == tuple(HEAD)

    events = _run(Job("g", grouped, meta={"group": True}))
    assert isinstance(events[-1], JobFinished)
    assert [e.trial_id for e in events if isinstance(e, TrialCheckpointed)] == list(HEAD)
    got, expected = _results(events), _alone(alone)
    assert sorted(got) == sorted(expected) == sorted((t, s) for t in HEAD for s in (1, 2))
    assert got == expected  # exact floats: train_loss, val_loss, val_acc
    for g, s in zip(grouped, alone):
        assert _same_checkpoint(g.checkpoint_out, s.checkpoint_out), g.trial_id


def test_grouped_segments_resume_like_one_segment_alone(tmp_path):
    """Step 1 grouped, checkpoint, step 2 grouped from the checkpoints == steps 1-2 alone."""
    first = [_task(t, tmp_path, stop=1, tag="g-") for t in "abc"]
    assert isinstance(_run(Job("g1", first, meta={"group": True}))[-1], JobFinished)
    second = [_task(t, tmp_path, start=1, stop=2, tag="g-", checkpoint_in=f.checkpoint_out)
              for t, f in zip("abc", first)]
    events = _run(Job("g2", second, meta={"group": True}))
    assert isinstance(events[-1], JobFinished)
    alone = [_task(t, tmp_path, tag="s-") for t in "abc"]
    expected = _alone(alone)
    assert _results(events) == {k: v for k, v in expected.items() if k[1] == 2}
    for g, s in zip(second, alone):
        assert _same_checkpoint(g.checkpoint_out, s.checkpoint_out), g.trial_id


def _open(task):
    from retiarii.engine.worker_side.worker import _open_task
    return _open_task(task, WorkerContext())


def test_a_nan_trial_fails_alone_and_the_others_are_unchanged(tmp_path):
    tasks = [_task(t, tmp_path, tag="g-") for t in "abc"]
    tasks.append(_task("n", tmp_path, head="lin", seed=5, hparams={"lr": 1e36}, tag="g-"))
    events = _run(Job("g", tasks, meta={"group": True}))
    end = events[-1]
    assert isinstance(end, JobFailed) and end.trial_id == "n" and "training loss is" in end.error
    assert not any(e.trial_id == "n" for e in events if isinstance(e, TrialResult))
    assert [e.trial_id for e in events if isinstance(e, TrialCheckpointed)] == list("abc")
    alone = [_task(t, tmp_path, tag="s-") for t in "abc"]
    assert _results(events) == _alone(alone)
    for g, s in zip(tasks, alone):
        assert _same_checkpoint(g.checkpoint_out, s.checkpoint_out), g.trial_id


def test_an_error_mid_epoch_fails_that_trial_alone(tmp_path):
    """b raises in its 5th batch: the group is rebuilt without it in the middle of the epoch,
    and a and c end exactly as alone."""
    DieTrainer.calls.clear()
    tasks = [_task(t, tmp_path, trainer=_ref("DIE"), tag="g-",
                   hparams={"die_at": 5, "tag": "b"} if t == "b" else None) for t in "abc"]
    events = _run(Job("g", tasks, meta={"group": True}))
    end = events[-1]
    assert isinstance(end, JobFailed) and end.trial_id == "b" and "boom" in end.error
    alone = [_task(t, tmp_path, trainer=_ref("DIE"), tag="s-") for t in "ac"]
    assert _results(events) == _alone(alone)
    for g, s in zip([tasks[0], tasks[2]], alone):
        assert _same_checkpoint(g.checkpoint_out, s.checkpoint_out), g.trial_id


def test_ungroupable_tasks_run_separately(tmp_path):
    # c reads batches of another size: another data key, another pipeline
    tasks = [_task("a", tmp_path, tag="g-"), _task("b", tmp_path, tag="g-"),
             _task("c", tmp_path, hparams={"batch_size": 64}, tag="g-")]
    units = _units(Job("g", tasks, meta={"group": True}), tasks,
                   {t.trial_id: _open(t) for t in tasks}, WorkerContext())
    assert [u.trials for u in units] == [("a", "b"), ("c",)]
    assert type(units[0]) is TrainingGroup and type(units[1]) is not TrainingGroup
    # without the flag nothing groups: today's behaviour stays the default
    plain = _units(Job("p", tasks), tasks, {t.trial_id: _open(t) for t in tasks},
                   WorkerContext())
    assert [u.trials for u in plain] == [("a",), ("b",), ("c",)]
    events = _run(Job("g", tasks, meta={"group": True}))
    assert isinstance(events[-1], JobFinished)
    assert _results(events) == _alone([_task("a", tmp_path, tag="s-"),
                                       _task("b", tmp_path, tag="s-"),
                                       _task("c", tmp_path, hparams={"batch_size": 64},
                                             tag="s-")])


def test_group_tasks_is_a_pure_decision():
    def c(trial, data="d", position=(0, 0), steps=2, space="s", trainer="t"):
        return GroupCandidate(trial, space, trainer, data, position, steps)

    assert group_tasks([c("a"), c("b"), c("x", data=None), c("c"), c("y", data="e"),
                        c("z", position=(1, 0)), c("w", steps=0), c("v", trainer="u"),
                        c("e", data="e")]) == \
        [("a", "b", "c"), ("x",), ("y", "e"), ("z",), ("w",), ("v",)]
    assert group_tasks([]) == []


def test_local_executor_runs_a_grouped_job(tmp_path):
    tasks = [_task(t, tmp_path, stop=1, tag="g-") for t in "ab"]
    # one thread, as this process runs (conftest): a thread pool of another size sums the
    # validation reductions in another order, grouped or not
    with LocalExecutor(num_workers=1, heartbeat_interval=0.2, threads_per_worker=1) as ex:
        ex.submit(Job("g", tasks, meta={"group": True}))
        events = []
        while not events or not isinstance(events[-1], (JobFinished, JobFailed)):
            event = ex.next_event(timeout=120)
            assert event is not None, "no event in 120s"
            events.append(event)
    assert isinstance(events[-1], JobFinished), events[-1]
    assert _results(events) == _alone([_task(t, tmp_path, stop=1, tag="s-") for t in "ab"])
    for t in tasks:
        assert os.path.exists(t.checkpoint_out)


def test_an_error_in_a_models_own_part_fails_that_trial_alone(tmp_path):
    """b's head raises in its 3rd forward (inside the group's forward, while a's
    training_step runs): b fails, and a and c train their epoch exactly as alone."""
    tasks = [_task(t, tmp_path) for t in "abc"]
    runs = {t.trial_id: _open(t) for t in tasks}
    calls = []

    def boom(module, args):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("boom in b's head")

    runs["b"].model.head.register_forward_pre_hook(boom)
    plan = plan_group({t: SPACE.replay({"h/head": HEAD[t]}) for t in runs},
                      runs["a"].trainer.data_key({}), {t: {} for t in runs})
    group = TrainingGroup(plan, runs, runs["a"].trainer)
    outcome = group.train_epoch()
    assert isinstance(outcome["b"], ValueError) and group.trials == ("a", "c")
    for t in "ac":
        alone = _open(_task(t, tmp_path))
        assert outcome[t] == alone.train_epoch(), t
        assert _same(runs[t].state_dict(), alone.state_dict()), t


def test_a_trainer_that_does_not_call_the_model_on_the_batch_fails_clearly(tmp_path):
    tasks = [_task(t, tmp_path, trainer=_ref("CLONE"), stop=1) for t in "ab"]
    end = _run(Job("g", tasks, meta={"group": True}))[-1]
    assert isinstance(end, JobFailed) and end.trial_id is None
    for t in "ab":
        assert f"trial {t}: training_step called the model with tensors that are not " \
               "the batch's" in end.error
    assert isinstance(_run(Job("p", tasks))[-1], JobFinished)  # alone it trains


def test_validation_runs_the_shared_trunk_once_per_batch(tmp_path):
    """A group validates through the group module: the frozen trunk runs once per
    validation batch for all trials (alone: once per trial), and each trial's metrics are
    still exactly those of validating alone."""
    tasks = [_task(t, tmp_path) for t in "abc"]
    runs = {t.trial_id: _open(t) for t in tasks}
    plan = plan_group({t: SPACE.replay({"h/head": HEAD[t]}) for t in runs},
                      runs["a"].trainer.data_key({}), {t: {} for t in runs})
    group = TrainingGroup(plan, runs, runs["a"].trainer)
    trunk_calls = []
    shared = {id(r.model.conv) for r in runs.values()}
    assert len(shared) == 1  # one frozen conv object serves the three models
    runs["a"].model.conv.register_forward_hook(lambda *_: trunk_calls.append(1))
    metrics = group._validate()
    batches = len(runs["a"].trainer.val_dataloader({}))
    assert len(trunk_calls) == batches  # not 3 x batches
    for t in "abc":
        alone = _open(_task(t, tmp_path))
        assert metrics[t] == alone._validate(), t


class AdapterTrunk(nn.Module):
    """A frozen conv trunk with an adapter slot after each conv (benchmarks/batching.py's
    shape, small)."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)])
        self.act = nn.ReLU()
        self.slots = nn.ModuleList([nn.Identity(), nn.Identity()])
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.head = nn.Linear(32, 10)
        self.convs.requires_grad_(False)

    def forward(self, x):
        for conv, slot in zip(self.convs, self.slots):
            x = slot(self.act(conv(x)))
        return self.head(torch.flatten(self.pool(x), 1))


torch.manual_seed(0)
ADAPTERS = rt.ModelSpace(AdapterTrunk(), [rt.apply_mutator(f"slots.{d}", rt.mutators.OperatorMutator(
    {"id": nn.Identity(), "ad": nn.Conv2d(8, 8, 1)}, label=f"s{d}")) for d in range(2)],
    example_input=torch.randn(2, 1, 8, 8))


def test_a_grouped_job_with_batched_frozen_layers_equals_each_task_alone(tmp_path):
    """Adapters after conv 0 (before the frozen conv 1) and after conv 1: conv 1 and its ReLU
    run batched, the gradient reaches the first adapter through them; exact on CPU."""
    samples = {"p": ("ad", "id"), "q": ("id", "ad"), "r": ("ad", "ad")}

    def task(trial, tag):
        spec = {"space": _ref("ADAPTERS"), "sample": {f"s{d}/slots.{d}": c for d, c in
                                                       enumerate(samples[trial])},
                "trainer": TRAINER, "hparams": {}, "seed": ord(trial)}
        return TrialTask(trial, spec, 0, 2, None, str(tmp_path / f"{tag}{trial}.pt"))

    grouped = [task(t, "g-") for t in samples]
    plan = plan_group({t: ADAPTERS.replay(dict(g.spec["sample"])) for t, g in zip(samples, grouped)},
                      "d", {t: {} for t in samples}, batch_ops=True)
    assert {plan.nodes[k].name for b in plan.batches for _, k in b} == {"convs.1", "act@1", "pool"}
    units = _units(Job("g", grouped, meta={"group": GroupOrder(passes={"batching": True})}), grouped,
                   {t.trial_id: _open(t) for t in grouped}, WorkerContext())
    assert [type(u) for u in units] == [TrainingGroup] and units[0].trials == tuple(samples)
    assert units[0]._plan.batches  # the job asked for the batching pass
    events = _run(Job("g", grouped, meta={"group": GroupOrder(passes={"batching": True})}))
    assert isinstance(events[-1], JobFinished)
    alone = [task(t, "s-") for t in samples]
    assert _results(events) == _alone(alone)  # exact floats
    for g, s in zip(grouped, alone):
        assert _same_checkpoint(g.checkpoint_out, s.checkpoint_out), g.trial_id


class _FrozenStats(nn.Module):
    """Overrides ``train``: its BatchNorm stays in eval mode (a user's frozen statistics)."""

    def __init__(self):
        super().__init__()
        self.bn, self.lin = nn.BatchNorm1d(4), nn.Linear(4, 4)

    def train(self, mode=True):
        super().train(mode)
        self.bn.eval()
        return self


def test_set_training_sets_every_module_as_module_train_does():
    from retiarii.engine.trainers.trial_training import set_training

    def make():
        return nn.Sequential(nn.Linear(4, 4), _FrozenStats(), nn.Sequential(nn.Dropout(0.1)))

    for mode in (True, False, True):
        ours, ref = make(), make()
        ours.train(not mode), ref.train(not mode)
        set_training(ours.modules(), mode)
        ref.train(mode)
        assert [m.training for m in ours.modules()] == [m.training for m in ref.modules()]
        assert ours[1].bn.training is False  # the override ran


def test_a_grouped_job_replays_each_model_once(tmp_path, monkeypatch):
    """The worker builds each model once and plans the group on the graph that build made
    (``TrialRun.ir``), not on a second replay of the sample; the job still equals each task
    alone (test above)."""
    replays = []
    original = rt.ModelSpace.replay

    def counting(self, sample):
        replays.append(dict(sample))
        return original(self, sample)

    monkeypatch.setattr(rt.ModelSpace, "replay", counting)
    grouped = [_task(t, tmp_path, tag="once-") for t in HEAD]
    events = _run(Job("g", grouped, meta={"group": True}))
    assert isinstance(events[-1], JobFinished)
    assert len(replays) == len(HEAD)  # one per model: its build
    runs = {t.trial_id: _open(t) for t in grouped}
    units = _units(Job("g", grouped, meta={"group": True}), grouped, runs, WorkerContext())
    plan_models = {m.trial_id: m.model for m in units[0]._plan.models}
    assert all(plan_models[t] is runs[t].ir for t in HEAD)


def test_a_grouped_job_waits_while_a_cost_is_measured(tmp_path, monkeypatch):
    """The group's batches (grouped, fused, dedicated and measuring groups share this loop)
    run under the machine's measurement lock: while a measurement holds it, the group's
    loader has handed out its first batch but no model steps; the steps follow its end."""
    import threading

    from retiarii.engine.jobs import measure_lock

    monkeypatch.setattr(measure_lock, "_MACHINE", measure_lock.MeasureLock(str(tmp_path)))
    tasks = [_task(t, tmp_path, stop=1) for t in "ab"]
    runs = {t.trial_id: _open(t) for t in tasks}
    plan = plan_group({t: SPACE.replay({"h/head": HEAD[t]}) for t in runs},
                      runs["a"].trainer.data_key({}), {t: {} for t in runs})
    group = TrainingGroup(plan, runs, runs["a"].trainer)
    events, loaded = [], threading.Event()
    loader = group.trainer.train_dataloader

    def watched(*args, **kwargs):
        for batch in loader(*args, **kwargs):
            loaded.set()
            yield batch

    monkeypatch.setattr(group.trainer, "train_dataloader", watched)
    runs["a"].model.head.register_forward_pre_hook(lambda m, a: events.append("step"))
    with measure_lock.MeasureLock(str(tmp_path)).measuring():
        thread = threading.Thread(target=group.train_epoch)
        thread.start()
        assert loaded.wait(120)
        thread.join(2.0)         # time it would take to step, were the batch not held
        assert thread.is_alive() and events == []
        events.append("measured")
    thread.join(300)
    assert events[0] == "measured" and events.count("step") > 1
