"""Dedicated devices (engine/dedicated.py): a group's shared frozen part computed on a device
of its own one batch ahead gives every model exactly what the same grouped job gives without
it (metrics at every step, checkpoints tensor for tensor: bit for bit on CPU), in a process
and in a thread, also when a trial fails mid-epoch and the group is rebuilt."""
from __future__ import annotations

import pytest
import torch

import test_grouped_jobs as g
from retiarii.engine.worker_side.dedicated_group import DedicatedGroup, EncoderWorker, dedicated_modules
from retiarii.engine.jobs.job import Job, JobFailed, JobFinished, JobProfiled
from retiarii.engine.worker_side.group_candidates import plan_group
from retiarii.engine.worker_side.worker import WorkerContext, _units
from retiarii.optim import build_group
from retiarii.engine.jobs.contract import GroupOrder


def _group_module():
    models = {t: g.SPACE.replay({"h/head": g.HEAD[t]}) for t in "ab"}
    plan = plan_group(models, "k", {t: {} for t in "ab"})
    return build_group(plan, {t: g.SPACE.build({"h/head": g.HEAD[t]}) for t in "ab"})


def test_patterns_name_modules_of_the_shared_cell_by_name_or_class():
    shared = _group_module().shared
    assert dedicated_modules(shared, ["conv"]) == ["conv"]
    assert dedicated_modules(shared, ["Conv2d"]) == ["conv"]
    assert dedicated_modules(shared, ["c*"]) == ["conv"]
    assert dedicated_modules(shared, ["encoder", "Linear"]) == []


# a process costs a fresh interpreter importing torch (~5 s idle, 20 s on a loaded machine)
DEVICES = ["thread", pytest.param("process", marks=pytest.mark.slow)]


@pytest.mark.parametrize("device", DEVICES)
def test_the_encoder_worker_returns_what_the_cell_computes_in_order(device):
    shared = _group_module().shared
    xs = [torch.randn(5, 1, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    worker = EncoderWorker(shared, device)
    try:
        for x in xs:
            worker.submit((x,))
        got = [worker.result() for _ in xs]
    finally:
        worker.close()
    with torch.no_grad():
        for x, out in zip(xs, got):
            expected = tuple(shared(x))
            assert len(out) == len(expected)
            assert all(torch.equal(a, b) for a, b in zip(out, expected))


def test_a_bad_device_is_refused():
    with pytest.raises(ValueError, match="dedicated device 'gpu'"):
        EncoderWorker(_group_module().shared, "gpu")


@pytest.mark.parametrize("device", DEVICES)
def test_a_dedicated_group_trains_exactly_as_the_group_without_it(tmp_path, device):
    plain = [g._task(t, tmp_path, tag="p-") for t in "abc"]
    events = g._run(Job("p", plain, meta={"group": True}))
    assert isinstance(events[-1], JobFinished)
    tasks = [g._task(t, tmp_path, tag="d-") for t in "abc"]
    meta = {"group": GroupOrder(dedicated=("conv",), dedicated_device=device, profile=())}
    units = _units(Job("d", tasks, meta=meta), tasks, {t.trial_id: g._open(t) for t in tasks},
                   WorkerContext())
    assert [type(u) for u in units] == [DedicatedGroup] and units[0].dedicated == ["conv"]
    units[0].drop(units[0].trials)
    dedicated = g._run(Job("d", tasks, meta=meta))
    assert isinstance(dedicated[-1], JobFinished)
    assert g._results(dedicated) == g._results(events)  # exact floats, every step
    for a, b in zip(tasks, plain):
        assert g._same_checkpoint(a.checkpoint_out, b.checkpoint_out), a.trial_id
    report, = [e for e in dedicated if isinstance(e, JobProfiled)][0].units
    assert report.dedicated == ("conv",) and report.dedicated_device == device


def test_a_trial_failing_mid_epoch_rebuilds_the_dedicated_group_and_the_others_are_unchanged(
        tmp_path):
    g.DieTrainer.calls.clear()
    tasks = [g._task(t, tmp_path, trainer=g._ref("DIE"), tag="d-",
                     hparams={"die_at": 5, "tag": "dedicated-b"} if t == "b" else None)
             for t in "abc"]
    events = g._run(Job("d", tasks, meta={"group": GroupOrder(dedicated=("conv",),
                                                              dedicated_device="thread")}))
    end = events[-1]
    assert isinstance(end, JobFailed) and end.trial_id == "b" and "boom" in end.error
    alone = [g._task(t, tmp_path, trainer=g._ref("DIE"), tag="s-") for t in "ac"]
    assert g._results(events) == g._alone(alone)
    for a, b in zip([tasks[0], tasks[2]], alone):
        assert g._same_checkpoint(a.checkpoint_out, b.checkpoint_out), a.trial_id


def test_every_trial_failing_mid_epoch_ends_the_job_at_once(tmp_path):
    """Nothing waits on what was computed ahead once no trial is left."""
    g.DieTrainer.calls.clear()
    tasks = [g._task(t, tmp_path, trainer=g._ref("DIE"), tag="x-",
                     hparams={"die_at": 4, "tag": f"all-{t}"}) for t in "ab"]
    events = g._run(Job("x", tasks, meta={"group": GroupOrder(dedicated=("conv",),
                                                              dedicated_device="thread")}))
    end = events[-1]
    assert isinstance(end, JobFailed) and "boom" in end.error and end.trial_id is None


def test_a_group_whose_shared_cell_holds_no_dedicated_module_trains_as_before(tmp_path):
    tasks = [g._task(t, tmp_path, tag="n-") for t in "ab"]
    units = _units(Job("n", tasks, meta={"group": GroupOrder(dedicated=("encoder",))}), tasks,
                   {t.trial_id: g._open(t) for t in tasks}, WorkerContext())
    assert units[0].dedicated == [] and units[0]._worker is None
    units[0].drop(units[0].trials)


def test_a_search_with_a_dedicated_device_gives_the_results_of_training_alone(tmp_path):
    import json

    import retiarii as rt
    from engine_helpers import InProcessExecutor
    from retiarii.engine.storage.plans_table import PlanTable
    from retiarii.engine.storage.store import Store

    def curves(**kwargs):
        db = tmp_path / f"{len(kwargs)}.db"
        trainer = rt.Trainer(dataset="digits", epochs=2, batch_size=256)
        exp = rt.Experiment(g.SPACE, rt.strategies.Random(seed=0), trainer, store=str(db),
                            executor=InProcessExecutor(), seed=0, max_models=3, **kwargs)
        exp.run()
        with Store(db) as store:
            store.use_experiment(store.experiments()[-1]["id"])
            units = [u for row in PlanTable(store).rows() for u in row["units"]]
            return {json.dumps(t["spec"]["choices"], sort_keys=True):
                    [v for _, v in store.learning_curve(t["id"], "val_loss")]
                    for t in store.trials()}, units

    alone, _ = curves(optimize=False)
    assert len(alone) == 3
    dedicated, units = curves(optimize=True, dedicated=["conv"], dedicated_device="thread")
    assert dedicated == alone
    assert any(u.get("dedicated") == ["conv"] and u["merged"] for u in units)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dedicated="encoder"), "dedicated='encoder'"),
    (dict(dedicated=["encoder"], dedicated_device="tpu"), "dedicated_device='tpu'")])
def test_bad_dedicated_options_are_refused(tmp_path, kwargs, match):
    import retiarii as rt

    with pytest.raises(rt.engine.experiment.ExperimentError, match=match):
        rt.Experiment(g.SPACE, rt.strategies.Random(seed=0), rt.Trainer(dataset="digits"),
                      store=str(tmp_path / "x.db"), **kwargs)


@pytest.mark.gpu
def test_a_dedicated_side_stream_on_cuda_matches_the_cell():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    shared = _group_module().shared.to("cuda")
    x = torch.randn(64, 1, 8, 8, device="cuda")
    worker = EncoderWorker(shared, "cuda:0", "cuda")
    worker.submit((x,))
    out = worker.result()
    with torch.no_grad():
        expected = tuple(shared(x))
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(out, expected))
    assert all(a.device.type == "cuda" for a in out)
