"""Deterministic mode (retiarii/determinism.py) reaches every process that trains, and only
the jobs that ask for it.

Every kind of process that trains records the switches it ran with
(``determinism.settings()``) into its metrics: local worker processes (multi-trial and
one-shot segments), the driver when an executor runs jobs in it, mixed-parallel rank
processes, a dedicated module's process or thread, and (slow) Ray actors. A search run twice
in the mode gives identical metrics; resume keeps the mode (API, ``retiarii resume`` of
``run`` and ``nas run`` stores) and refuses to change it; a bad value is refused naming it.
On the CPU the mode changes no result of these models (the same kernels run). The GPU side
is in tests/test_gpu.py (``pytest -m gpu``), whose bodies this file runs on the CPU.

This file is also a space file for ``retiarii run`` (module-level ``space`` and ``trainer``)
and workers load it by reference (its path).
"""
from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from torch import nn

import retiarii as rt
import test_gpu
from engine_helpers import InProcessExecutor
from exp_space import space
from one_shot_helpers import PerArchitecture
from one_shot_helpers import space as one_shot_space
from retiarii import determinism
from retiarii.cli import main
from retiarii.engine.worker_side.dedicated_group import EncoderWorker
from retiarii.engine.jobs.job import FailureKind, Job, JobFailed, JobStarted, TrialTask
from retiarii.engine.executors.local import LocalExecutor
from retiarii.engine.storage.segments_table import SegmentTable
from retiarii.engine.storage.store import Store
from retiarii.engine.trainers.trainer import ClassifierTrainer
from retiarii.engine.worker_side.worker import run_job
from retiarii.engine.executors.local_ranks import spawn

HERE = os.path.abspath(__file__)
SWITCHES = ("deterministic_algorithms", "cudnn_deterministic", "cudnn_benchmark", "tf32",
            "cublas_workspace")
ON = {"deterministic_algorithms": 1.0, "cudnn_deterministic": 1.0, "cudnn_benchmark": 0.0,
      "tf32": 0.0, "cublas_workspace": 1.0}


class ProbingTrainer(ClassifierTrainer):
    """Adds the switches its process trains with (``determinism.settings()``) to the
    validation metrics of every epoch."""

    def validation_step(self, model, batch):
        return {**super().validation_step(model, batch), **determinism.settings()}


trainer = ProbingTrainer(dataset="digits", epochs=2, batch_size=256, lr=0.03, seed=1)


class ProbingOneShot(PerArchitecture):
    """A one-shot strategy whose segment metrics carry the switches of the worker."""

    def run_segment(self, ctx):
        result = super().run_segment(ctx)
        result.metrics.update(determinism.settings())
        return result


def _curves(db) -> dict:
    """(sample, metric) -> learning curve, for every trial of the store's last experiment."""
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        out = {}
        for trial in store.trials():
            sample = json.dumps(trial["spec"]["choices"], sort_keys=True)
            for metric in ("train_loss", "val_loss", "val_acc", *SWITCHES):
                out[sample, metric] = store.learning_curve(trial["id"], metric)
        return out


def _config(db) -> dict:
    """The stored config of the store's last experiment."""
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        return store.get_experiment()["config"]


def _reported(curves: dict) -> set:
    """Every (switch, value) any epoch of any trial reported."""
    return {(m, v) for (_, m), c in curves.items() if m in SWITCHES for _, v in c}


def _search(db, executor, deterministic: bool, max_models: int = 2) -> dict:
    rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=str(db), workers=1,
                  max_models=max_models, seed=0, executor=executor, optimize=True, fuse=False,
                  deterministic=deterministic).run()
    return _curves(db)


@pytest.fixture(scope="module")
def local():
    with LocalExecutor(num_workers=1, heartbeat_interval=0.5) as ex:
        assert ex.wait_ready(timeout=300)
        yield ex


@pytest.fixture(scope="module")
def searches(local, tmp_path_factory):
    """Three searches of 2 models on one warm worker: deterministic, deterministic again,
    then with the defaults; and the worker's pid before and after."""
    folder = tmp_path_factory.mktemp("searches")
    pids = local.worker_pids()
    out = {name: _search(folder / f"{name}.db", local, on)
           for name, on in (("first", True), ("second", True), ("off", False))}
    assert local.worker_pids() == pids, "the worker was restarted"
    return out


# ---- the switches themselves ---------------------------------------------------------------


def test_the_block_sets_every_switch_and_puts_the_previous_ones_back():
    before = determinism.settings()
    assert before["deterministic_algorithms"] == 0.0 and not determinism.enabled()
    with determinism.deterministic(True):
        assert determinism.settings() == ON and determinism.enabled()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] in (":4096:8", ":16:8")
    after = determinism.settings()
    assert {k: after[k] for k in SWITCHES[:4]} == {k: before[k] for k in SWITCHES[:4]}
    with pytest.raises(KeyError):  # also when the block raises
        with determinism.deterministic(True):
            raise KeyError("x")
    assert not determinism.enabled()
    with determinism.deterministic(False):  # off: nothing changes
        assert determinism.settings()["deterministic_algorithms"] == 0.0
    # a user who turned cuDNN benchmarking on gets it back after a deterministic job
    torch.backends.cudnn.benchmark = True
    try:
        with determinism.deterministic(True):
            assert not torch.backends.cudnn.benchmark
        assert torch.backends.cudnn.benchmark
    finally:
        torch.backends.cudnn.benchmark = False


@pytest.mark.parametrize("shape,out,channels_last", [
    ((2, 3, 10, 7), (4, 3), False), ((3, 9, 9), (2, 5), False), ((2, 4, 7, 7), (2, 2), True),
    ((2, 3, 8, 8), (4, 4), False), ((1, 2, 5, 6, 7), (2, 3, 4), False)])
def test_our_adaptive_pooling_backward_is_pytorchs(shape, out, channels_last):
    """The deterministic kernel that replaces adaptive average pooling's backward on a GPU
    in the mode (PyTorch's raises there) gives PyTorch's gradient: windows that overlap and
    windows of unequal sizes (10 -> 4), an input without a batch, a channels-last one, 3-d."""
    pool = torch.nn.functional.adaptive_avg_pool3d if len(out) == 3 else \
        torch.nn.functional.adaptive_avg_pool2d
    x = torch.randn(shape, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    g = torch.randn(pool(x, out).shape, dtype=torch.float64)
    want, = torch.autograd.grad(pool(x, out), x, g)
    got = determinism._adaptive_pool_backward(g, x.detach(), len(out))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    assert got.is_contiguous(memory_format=torch.channels_last) == channels_last


def test_the_mode_routes_adaptive_pooling_through_our_kernel_and_gives_it_back(monkeypatch):
    """Registered for the block (here for the CPU's key, as the mode does for CUDA's), nested
    blocks sharing it, and PyTorch's own kernel back after the last."""
    calls = []
    real = determinism._adaptive_pool_backward
    monkeypatch.setattr(determinism, "_adaptive_pool_backward",
                        lambda g, x, dims: (calls.append(dims), real(g, x, dims))[1])
    x = torch.randn(2, 3, 10, 7, requires_grad=True)

    def grad():
        return torch.autograd.grad(torch.nn.functional.adaptive_avg_pool2d(x, (4, 3)).sum(), x)[0]

    native = grad()
    with determinism._deterministic_kernels("CPU"):
        with determinism._deterministic_kernels("CPU"):
            torch.testing.assert_close(grad(), native)
        torch.testing.assert_close(grad(), native)
    assert calls == [2, 2] and not determinism._overrides
    assert torch.equal(grad(), native) and calls == [2, 2]  # PyTorch's again


def test_carry_takes_the_mode_of_the_process_that_made_it():
    probe = determinism.carry(determinism.settings)
    with determinism.deterministic(True):
        carried = pickle.loads(pickle.dumps(determinism.carry(determinism.settings)))
    assert probe() == determinism.settings() and carried() == ON  # called outside the block
    assert not determinism.enabled()


def test_a_bad_value_is_refused_naming_it(tmp_path):
    for bad in ("yes", 1, None):
        with pytest.raises(rt.ExperimentError, match=r"deterministic=.*give True or False"):
            rt.Experiment(space, rt.strategies.Random(seed=0), trainer,
                          store=str(tmp_path / "x.db"), deterministic=bad)
    # a spec made by hand: the job fails, naming the field, every trial the model's fault
    events = []
    spec = {"space": "exp_space:space", "sample": {}, "trainer": "x:y", "deterministic": "on"}
    run_job(Job("j", [TrialTask("a", spec, 0, 1), TrialTask("b", dict(spec), 0, 1)]),
            events.append)
    assert isinstance(events[0], JobStarted) and len(events) == 2
    end = events[-1]
    assert isinstance(end, JobFailed) and end.kind is FailureKind.MODEL
    assert "spec['deterministic']='on': give True or False" in end.error
    assert [t for t, _, _ in end.failures] == ["a", "b"]


def test_cuda_started_without_the_workspace_setting_is_the_environments_fault(monkeypatch):
    """PyTorch reads CUBLAS_WORKSPACE_CONFIG once: a process whose CUDA started without it
    cannot honour the mode, and says so (on this CPU machine: CUDA pretended started)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    monkeypatch.setattr(determinism, "_cuda_started", lambda torch: True)
    with pytest.raises(determinism.DeterminismError, match="CUBLAS_WORKSPACE_CONFIG=:4096:8"):
        with determinism.deterministic(True):
            pass
    assert not determinism.enabled()
    events = []
    spec = {"space": "exp_space:space", "sample": {}, "trainer": "x:y", "deterministic": True}
    run_job(Job("j", [TrialTask("a", spec, 0, 1)]), events.append)
    assert isinstance(events[-1], JobFailed) and events[-1].kind is FailureKind.ENVIRONMENT
    assert "before CUDA starts" in events[-1].error
    # before CUDA starts the setting is simply made
    monkeypatch.setattr(determinism, "_cuda_started", lambda torch: False)
    with determinism.deterministic(True):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


# ---- every process that trains -------------------------------------------------------------


def test_a_local_worker_trains_in_the_mode_and_only_the_jobs_that_ask(searches):
    assert _reported(searches["first"]) == set(ON.items())
    off = _reported(searches["off"])  # the same warm worker, after two deterministic searches
    assert ("deterministic_algorithms", 0.0) in off and ("cudnn_deterministic", 0.0) in off
    assert ("deterministic_algorithms", 1.0) not in off
    # every worker starts with cuBLAS's reproducible workspace, so any job may ask for the mode
    assert ("cublas_workspace", 1.0) in off


def test_a_search_run_twice_in_the_mode_gives_identical_metrics(searches):
    first, second = searches["first"], searches["second"]
    assert len(first) == 2 * (3 + len(SWITCHES)) and first == second
    # and on the CPU the mode changes no result of these models: the same kernels run
    for key, curve in first.items():
        if key[1] not in SWITCHES:
            assert searches["off"][key] == curve, key


def test_resume_keeps_the_mode_and_refuses_another(tmp_path, local):
    db = tmp_path / "r.db"
    _search(db, local, True, max_models=1)
    with pytest.raises(rt.ExperimentError, match=r"differs from the stored one in \['deterministic'\]"):
        rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=str(db), workers=1,
                      seed=0, executor=local, optimize=True, fuse=False).resume(max_models=2)
    rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=str(db), workers=1,
                  seed=0, executor=local, optimize=True, fuse=False,
                  deterministic=True).resume(max_models=2)
    curves = _curves(db)
    assert len({sample for sample, _ in curves}) == 2
    assert _reported(curves) == set(ON.items())


def test_a_one_shot_search_trains_its_segments_in_the_mode(tmp_path, local):
    db = tmp_path / "o.db"
    rt.Experiment(one_shot_space, ProbingOneShot(epochs=2), trainer, store=str(db), seed=0,
                  executor=local, deterministic=True).run()
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        assert store.get_experiment()["config"]["deterministic"] is True
        rows = SegmentTable(store).rows()
    assert len(rows) == 2
    for row in rows:
        assert {k: row["metrics"][k] for k in SWITCHES} == ON, row["metrics"]


@pytest.fixture
def in_process(monkeypatch):
    """`retiarii run` trains in this process, the driver's (the local worker is tested above)."""
    monkeypatch.setattr("retiarii.engine.executors.local.LocalExecutor.for_search",
                        classmethod(lambda cls, *args, **kwargs: InProcessExecutor()))


def test_cli_run_deterministic_and_resume_keeps_it(tmp_path, capsys, in_process):
    db = str(tmp_path / "cli.db")
    assert main(["run", HERE, "--store", db, "--max-models", "1", "--workers", "1",
                 "--optimize", "off", "--deterministic"]) == 0
    assert not determinism.enabled()  # the driver trained the jobs and is back to its own
    config = _config(db)
    assert config["deterministic"] is True and config["origin"]["cli"]["deterministic"] is True
    assert main(["resume", db, "--max-models", "2"]) == 0, capsys.readouterr().err
    curves = _curves(db)
    assert len({sample for sample, _ in curves}) == 2 and _reported(curves) == set(ON.items())
    # without the flag: the defaults, recorded as such
    other = str(tmp_path / "off.db")
    assert main(["run", HERE, "--store", other, "--max-models", "1", "--workers", "1",
                 "--optimize", "off"]) == 0
    assert ("deterministic_algorithms", 0.0) in _reported(_curves(other))
    assert "deterministic" not in _config(other)


def test_cli_nas_run_deterministic_and_resume_keeps_it(tmp_path, capsys, in_process):
    db = str(tmp_path / "nas.db")
    assert main(["nas", "run", "amoebanet", "--max-models", "1", "--epochs", "1",
                 "--retrain-epochs", "0", "--store", db, "--deterministic"]) == 0, \
        capsys.readouterr().err
    config = _config(db)
    assert config["deterministic"] is True and config["origin"]["nas"]["deterministic"] is True
    # resume rebuilds the row's experiment with the flag (else: "differs ... deterministic")
    assert main(["resume", db, "--max-models", "2"]) == 0, capsys.readouterr().err
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        assert len(store.trials()) == 2
        assert all(t["spec"]["deterministic"] is True for t in store.trials())


def test_the_retraining_of_a_deterministic_nas_run_is_deterministic_too(tmp_path):
    from retiarii import nas_retrain

    settings = {"name": "amoebanet", "preset": "small", "store": str(tmp_path / "r.db"),
                "search_experiment": 1, "model": 1, "sample": {}, "value": None,
                "retrain_epochs": 1, "workers": 1, "seed": 0}
    assert not nas_retrain.retrain_experiment(settings).deterministic
    assert nas_retrain.retrain_experiment({**settings, "deterministic": True}).deterministic


def _probe_rank(rank, world, group):
    return determinism.settings()


@pytest.mark.slow  # forkserver rank processes: ~20 s on 2 busy cores
def test_mixed_parallel_ranks_run_in_the_mode_of_the_job_that_starts_them():
    with determinism.deterministic(True):
        ranks = spawn(_probe_rank, 2, timeout=240)
    assert ranks == [ON, ON]
    off = spawn(_probe_rank, 2, timeout=240)
    assert all(r["deterministic_algorithms"] == 0.0 for r in off)


class SwitchProbe(nn.Module):
    """A dedicated module that returns the switches of the process or thread running it."""

    def forward(self, x):  # (B, 1) -> (B, 5)
        values = determinism.settings()
        return (x * 0 + torch.tensor([[values[s] for s in SWITCHES]]),)


@pytest.mark.parametrize("device", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_a_dedicated_module_runs_in_the_mode_of_its_job(device):
    with determinism.deterministic(True):
        worker = EncoderWorker(SwitchProbe(), device)
        try:
            worker.submit((torch.zeros(2, 1),))
            (out,) = worker.result()
        finally:
            worker.close()
    assert dict(zip(SWITCHES, out[0].tolist())) == ON


@pytest.mark.slow  # a private Ray instance: ~30 s to start here
def test_ray_actors_train_in_the_mode(tmp_path):
    ray = pytest.importorskip("ray", reason="Ray is not installed")
    from retiarii.engine.executors.ray import RayExecutor

    assert not ray.is_initialized()
    with RayExecutor(num_workers=1, num_cpus=1) as ex:
        curves = _search(tmp_path / "ray.db", ex, True)
    assert _reported(curves) == set(ON.items())
    # as on a local worker with the actor's one torch thread (reductions follow the count)
    with LocalExecutor(num_workers=1, devices=[], threads_per_worker=1) as local:
        assert curves == _search(tmp_path / "local.db", local, True)


# ---- the GPU tests' bodies, on the CPU -------------------------------------------------------


@pytest.mark.slow  # the demo's CNNs on one CPU worker, twice: ~50 s here
def test_the_gpu_search_twice_body_runs_on_the_cpu(tmp_path):
    test_gpu.search_twice_is_identical(tmp_path, devices=[], models=1)


def test_the_gpu_layout_bodies_run_on_the_cpu(tmp_path):
    with determinism.deterministic(True):
        test_gpu.layouts_agree_with_alone(tmp_path, rel=0.0)
