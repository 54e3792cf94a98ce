"""Fused grouped jobs (``Job.meta["fuse"]``): trials of one architecture in a grouped job train
as one fused model and equal each trial trained alone with run_job, within the fused kernels'
rounding: every metric within ``rel=1e-4`` and every checkpoint tensor within ``rtol=1e-4,
atol=1e-6`` after two epochs of 12 batches (measured: about 1e-6 relative), the RNG streams
and positions exactly. A trial failing inside a fused unit fails alone; other architectures of
the job train CSE-grouped as before."""
import pytest
import torch

from retiarii.engine import checkpoint as ckpt
from retiarii.engine.executors.base import Job, JobFailed, JobFinished, TrialCheckpointed
from retiarii.engine.fused import FusedGroup, fusable_sets
from retiarii.engine.grouped import TrainingGroup
from retiarii.engine.worker import WorkerContext, _units

import test_grouped_jobs as _g

RTOL, ATOL = 1e-4, 1e-6
# Three trials of one architecture (the "drop" head: dropout in each trial's own streams) with
# their own learning rates and seeds, and one of another (BatchNorm head).
HP = {"a": {"lr": 3e-3}, "d": {"lr": 1e-3}, "e": {"lr": 5e-3}, "b": {"lr": 2e-3}}
HEAD = {"a": "drop", "d": "drop", "e": "drop", "b": "bn"}
SEED = {"a": 1, "d": 4, "e": 5, "b": 2}


def _task(trial, tmp, opt="adam", tag="", **kw):
    return _g._task(trial, tmp, head=HEAD[trial], seed=SEED[trial],
                    hparams={**HP[trial], "optimizer": opt}, tag=tag, **kw)


def _job(tasks, fuse=True, **meta):
    return Job("f", tasks, meta={"group": True, "fuse": fuse, **meta})


def _close(a, b, what):
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, what
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=what)
        else:
            assert torch.equal(a, b), what
    elif isinstance(a, dict):
        assert list(a) == list(b), what  # the same keys in the same order: the alone layout
        for k in a:
            _close(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{what}[{i}]")
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=RTOL, abs=ATOL), what
    else:
        assert a == b, what


def _same_metrics(got, expected):
    assert sorted(got) == sorted(expected)
    for key, metrics in expected.items():
        assert got[key] == pytest.approx(metrics, rel=RTOL), key


def _checkpoints_close(fused_tasks, alone_tasks):
    for f, a in zip(fused_tasks, alone_tasks):
        mine, ref = ckpt.load(f.checkpoint_out), ckpt.load(a.checkpoint_out)
        assert _g._same(mine["rng"], ref["rng"]), f.trial_id  # the same draws, bit for bit
        _close(mine, ref, f.trial_id)


@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_fused_job_equals_each_task_alone(tmp_path, opt):
    fused = [_task(t, tmp_path, opt, tag="f-") for t in "ade"]
    units = _units(_job(fused), fused, {t.trial_id: _g._open(t) for t in fused}, WorkerContext())
    assert [type(u) for u in units] == [FusedGroup] and units[0].trials == ("a", "d", "e")

    events = _g._run(_job(fused))
    assert isinstance(events[-1], JobFinished), events[-1]
    assert [e.trial_id for e in events if isinstance(e, TrialCheckpointed)] == list("ade")
    alone = [_task(t, tmp_path, opt, tag="s-") for t in "ade"]
    _same_metrics(_g._results(events), _g._alone(alone))
    _checkpoints_close(fused, alone)


def test_fused_checkpoints_resume_alone(tmp_path):
    """Epoch 1 fused, then epoch 2 of each trial alone from its checkpoint == 2 epochs alone."""
    first = [_task(t, tmp_path, stop=1, tag="f-") for t in "ade"]
    assert isinstance(_g._run(_job(first))[-1], JobFinished)
    second = [_task(t, tmp_path, start=1, stop=2, tag="r-", checkpoint_in=f.checkpoint_out)
              for t, f in zip("ade", first)]
    resumed = _g._alone(second)
    alone = [_task(t, tmp_path, tag="s-") for t in "ade"]
    expected = _g._alone(alone)
    _same_metrics(resumed, {k: v for k, v in expected.items() if k[1] == 2})
    _checkpoints_close(second, alone)


def test_a_nan_trial_fails_alone_in_a_fused_unit(tmp_path):
    """Trial x's learning rate makes it diverge: it fails alone (unfused, mid-run) and a, e
    train on fused with the results they have alone."""
    HP["x"], HEAD["x"], SEED["x"] = {"lr": 1e36}, "drop", 4
    try:
        fused = [_task(t, tmp_path, "sgd", tag="f-") for t in "axe"]
        events = _g._run(_job(fused))
        assert isinstance(events[-1], JobFailed) and events[-1].trial_id == "x"
        assert "diverged" in events[-1].error
        alone = [_task(t, tmp_path, "sgd", tag="s-") for t in "ae"]
        got = {k: v for k, v in _g._results(events).items() if k[0] != "x"}
        _same_metrics(got, _g._alone(alone))
        _checkpoints_close([f for f in fused if f.trial_id != "x"], alone)
    finally:
        for d in (HP, HEAD, SEED):
            del d["x"]


def test_a_trial_raising_mid_epoch_fails_alone(tmp_path):
    """A trial whose training_step raises at its 5th batch leaves the fused unit mid-epoch
    (its tensors unfused); the others are fused again and end as they do alone."""
    _g.DieTrainer.calls.clear()
    trainer = _g._ref("DIE")
    fused = [_g._task(t, tmp_path, head="drop", seed=SEED[t], trainer=trainer, tag="f-",
                      hparams={**HP[t], **({"die_at": 5, "tag": "f"} if t == "d" else {})})
             for t in "ade"]
    events = _g._run(_job(fused))
    assert isinstance(events[-1], JobFailed) and events[-1].trial_id == "d"
    alone = [_g._task(t, tmp_path, head="drop", seed=SEED[t], trainer=trainer, tag="s-",
                      hparams=HP[t]) for t in "ae"]
    got = {k: v for k, v in _g._results(events).items() if k[0] != "d"}
    _same_metrics(got, _g._alone(alone))
    _checkpoints_close([f for f in fused if f.trial_id != "d"], alone)


def test_mixed_architectures_fuse_the_same_shape_ones(tmp_path):
    """a, d, e fuse; b (another head) is left with nobody to group with and trains alone;
    with two other-architecture trials they train CSE-grouped."""
    tasks = [_task(t, tmp_path, tag="f-") for t in "adbe"]
    runs = {t.trial_id: _g._open(t) for t in tasks}
    units = _units(_job(tasks), tasks, runs, WorkerContext())
    assert [type(u).__name__ for u in units] == ["FusedGroup", "_Alone"]
    assert units[0].trials == ("a", "d", "e") and units[1].trials == ("b",)

    HP["c"], HEAD["c"], SEED["c"] = {"lr": 1e-3}, "lin", 3
    try:
        tasks = [_task(t, tmp_path, tag="g-") for t in "adbec"]
        units = _units(_job(tasks), tasks, {t.trial_id: _g._open(t) for t in tasks},
                       WorkerContext())
        assert [type(u) for u in units] == [FusedGroup, TrainingGroup]
        assert units[1].trials == ("b", "c")
        events = _g._run(_job(tasks))
        assert isinstance(events[-1], JobFinished)
        alone = [_task(t, tmp_path, tag="s-") for t in "adbec"]
        expected = _g._alone(alone)
        got = _g._results(events)
        _same_metrics(got, expected)
        for t in "bc":  # CSE-grouped: bit for bit as before
            assert {k: v for k, v in got.items() if k[0] == t} == \
                {k: v for k, v in expected.items() if k[0] == t}
    finally:
        for d in (HP, HEAD, SEED):
            del d["c"]


def test_fuse_off_and_unfused_trials_group_as_before(tmp_path):
    tasks = [_task(t, tmp_path) for t in "ade"]
    runs = {t.trial_id: _g._open(t) for t in tasks}
    assert [type(u) for u in _units(_job(tasks, fuse=False), tasks, runs, WorkerContext())] \
        == [TrainingGroup]
    runs = {t.trial_id: _g._open(t) for t in tasks}  # fresh: the group above adopted modules
    units = _units(_job(tasks, unfused=["d"]), tasks, runs, WorkerContext())
    assert [type(u).__name__ for u in units] == ["FusedGroup", "_Alone"]
    assert units[1].trials == ("d",)
    assert units[0].trials == ("a", "e")
    space = WorkerContext().space(tasks[0].spec["space"])
    models = {t: space.replay({"h/head": HEAD[t]}) for t in "adbe"}
    assert fusable_sets(models) == [("a", "d", "e")]
    assert fusable_sets(models, excluded="ae") == []


def test_fused_report_is_measured(tmp_path):
    tasks = [_task(t, tmp_path) for t in "ade"]
    events = _g._run(_job(tasks, fuse="auto", profile=["a", "d", "e"]))
    from retiarii.engine.executors.base import JobProfiled

    unit, = next(e for e in events if isinstance(e, JobProfiled)).units
    assert unit["fused"] is True and unit["merged"] is True and unit["batches"] == 24
    assert unit["compute_s"] > 0 and set(unit["alone_s"]) == {"a", "d", "e"}
