"""The GPU paths, proved on a GPU: run with ``pytest -m gpu`` (skipped by default, and skipped
with the reason when torch sees no CUDA device).

- LocalExecutor gives each worker its own ``CUDA_VISIBLE_DEVICES`` (one slot per GPU by
  default) and a real experiment trains its models on the GPU to finite metrics;
- a trial paused and resumed on the GPU equals one never paused (exactly, with deterministic
  kernels; within rtol 1e-5 with the defaults the engine runs with), and a checkpoint written
  on the GPU resumes on the CPU and back;
- a grouped job on the GPU gives every trial the metrics and weights of training it alone
  (rtol 1e-5), with dropout and train-mode BatchNorm in the heads; a group's own tensor
  constants live on the models' GPU;
- a real CUDA out-of-memory fails only its trial, as the environment's fault, and the worker
  trains its next job;
- in deterministic mode (``Experiment(deterministic=True)``) a search run twice gives
  identical metrics, and the layouts that do not fuse (apart, CSE, batching) agree with
  separate training within rtol 1e-5 (fused ones within the fused tolerance, 1e-4).

Every equality test here runs in deterministic mode (the autouse fixture below, and
``"deterministic": true`` in the specs of jobs that train in worker processes), except the
one that asks for ``engine_defaults``: it checks the engine's defaults within a tolerance.
tests/test_deterministic.py runs the bodies of the deterministic-mode tests on the CPU.

Worker processes import this file by reference (its path), so what they build is defined at
module level here.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import retiarii as rt
import test_grouped_jobs as grouped_jobs
from retiarii import determinism
from engine_helpers import DeviceReportingTrainer, TinyCNN
from exp_space import space as MLP_SPACE
from retiarii.engine.storage import checkpoint as ckpt
from retiarii.engine.jobs.job import (
    FailureKind, Job, JobFailed, JobFinished, JobStarted, TrialCheckpointed, TrialResult, TrialTask,
)
from retiarii.engine.executors.local import LocalExecutor
from retiarii.engine.worker_side.training_group import TrainingGroup
from retiarii.engine.storage.store import Store
from retiarii.engine.trainers.trainer import ClassifierTrainer
from retiarii.engine.trainers.trial_training import TrialRun
from retiarii.engine.worker_side.worker import WorkerContext, _open_task, _units, classify_error
from retiarii.optim import build_group, build_plan, cse
from retiarii.optim.plan import PlanModel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: torch.cuda.is_available() is False")]

HERE = Path(__file__).resolve().parent
TIMEOUT = 300  # seconds for any one event: a fresh worker imports torch and starts CUDA
RTOL, ATOL = 1e-5, 1e-6  # where GPU results are compared with a tolerance (stated per test)


def _ref(attr: str) -> str:
    return f"{os.path.abspath(__file__)}:{attr}"


@pytest.fixture(autouse=True)
def deterministic_mode(request):
    """Every test trains in deterministic mode in this process (conftest.py gives it cuBLAS's
    reproducible workspace before CUDA starts), unless it asks for ``engine_defaults``."""
    if "engine_defaults" in request.fixturenames:
        yield
        return
    with determinism.deterministic(True):
        yield


@pytest.fixture
def engine_defaults():
    """Asked for by a test of the engine's defaults: no deterministic mode."""


# ---- helpers ---------------------------------------------------------------------------------


def _drain(ex: LocalExecutor, *job_ids: str) -> dict[str, list]:
    """job id -> its events up to its terminal one, for every job of ``job_ids``."""
    events: dict[str, list] = {job_id: [] for job_id in job_ids}
    running = set(job_ids)
    while running:
        event = ex.next_event(timeout=TIMEOUT)
        assert event is not None, f"no event in {TIMEOUT} s"
        if event.job_id in events:
            events[event.job_id].append(event)
            if isinstance(event, (JobFinished, JobFailed)):
                running.discard(event.job_id)
    return events


def _close(a, b, exact: bool, where: str = "") -> None:
    """Assert that two nested states are equal: every tensor ``torch.equal`` when ``exact``,
    else floating tensors and floats within RTOL/ATOL (integers, RNG states and the rest
    exactly: the same number of draws gives the same state)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        a, b = a.cpu(), b.cpu()
        if exact or not a.is_floating_point():
            assert torch.equal(a, b), where
        else:
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=where)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _close(a[k], b[k], exact, f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, exact, f"{where}[{i}]")
    elif isinstance(a, float) and not exact:
        assert math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL), (where, a, b)
    else:
        assert a == b, (where, a, b)


def _tensors(state):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from _tensors(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from _tensors(v)


# ---- 1. LocalExecutor: one slot per GPU, each worker on its own device ------------------------


class DeviceTrainer(DeviceReportingTrainer):
    """Also reports where the model trained: ``on_cuda`` (1.0 when its parameters and the
    batch are on a GPU) and ``gpus_seen`` (the GPUs its worker process sees)."""

    def validation_step(self, model, batch):
        x, _ = batch
        on_cuda = next(model.parameters()).is_cuda and x.is_cuda
        return {**super().validation_step(model, batch), "on_cuda": float(on_cuda),
                "gpus_seen": float(torch.cuda.device_count())}


DEVICE_TRAINER = DeviceTrainer(dataset="digits", epochs=2, batch_size=128, lr=0.01, seed=1)


def test_local_executor_has_one_slot_per_gpu_each_with_its_own_device():
    gpus = torch.cuda.device_count()
    with LocalExecutor(heartbeat_interval=0.5) as ex:
        assert ex.num_slots == gpus
        assert sorted(slot.device for slot in ex._slots) == sorted(ex.devices)
        assert len(set(ex.devices)) == gpus
        jobs = [Job(f"j{i}", [TrialTask(f"t{i}", {
            "space": _ref("OOM_SPACE"), "sample": {}, "trainer": _ref("DEVICE_TRAINER"),
            "seed": i}, 0, 1)]) for i in range(gpus)]
        for job in jobs:
            ex.submit(job)
        seen = {}
        for events in _drain(ex, *(job.job_id for job in jobs)).values():
            assert isinstance(events[-1], JobFinished), events[-1]
            (result,) = [e for e in events if isinstance(e, TrialResult)]
            assert result.metrics["on_cuda"] == 1.0 and result.metrics["gpus_seen"] == 1.0
            worker = next(e.worker for e in events if isinstance(e, JobStarted))
            seen[worker] = result.metrics["visible_device"]
    # every worker sees one GPU, its own (the ids the executor gave its slots)
    slots = {slot.name: slot.device for slot in ex._slots}
    for worker, visible in seen.items():
        assert str(int(visible)) == slots[worker], (worker, visible, slots)


def test_cpu_only_workers_do_not_see_the_gpus():
    """devices=[]: the worker's CUDA_VISIBLE_DEVICES is empty, so it trains on the CPU."""
    with LocalExecutor(num_workers=1, devices=[], heartbeat_interval=0.5) as ex:
        ex.submit(Job("cpu", [TrialTask("c", {"space": _ref("OOM_SPACE"), "sample": {},
                                              "trainer": _ref("DEVICE_TRAINER")}, 0, 1)]))
        events = _drain(ex, "cpu")["cpu"]
    assert isinstance(events[-1], JobFinished), events[-1]
    (result,) = [e for e in events if isinstance(e, TrialResult)]
    assert result.metrics["on_cuda"] == 0.0 and result.metrics["gpus_seen"] == 0.0
    assert result.metrics["visible_device"] == -1.0  # set, and empty


def test_an_experiment_trains_its_models_on_the_gpu(tmp_path):
    db = tmp_path / "gpu.db"
    gpus = torch.cuda.device_count()
    with LocalExecutor(heartbeat_interval=0.5) as ex:
        summary = rt.Experiment(MLP_SPACE, rt.strategies.Random(seed=0), DEVICE_TRAINER,
                                store=str(db), workers=gpus, max_models=3, seed=0,
                                executor=ex).run()
    assert summary["models"] == 3 and summary["trials"]["TERMINATED"] == 3
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        trials = store.trials()
        assert len(trials) == 3
        for trial in trials:
            for metric, expected in (("on_cuda", 1.0), ("gpus_seen", 1.0)):
                assert store.learning_curve(trial["id"], metric) == [(1, expected), (2, expected)]
            for metric in ("train_loss", "val_loss", "val_acc"):
                curve = store.learning_curve(trial["id"], metric)
                assert [s for s, _ in curve] == [1, 2]
                assert all(v is not None and math.isfinite(v) for _, v in curve), (metric, curve)
    assert 0.3 < summary["best"][0]["value"] <= 1.0  # digits learns something in 2 epochs


# ---- 2. TrialRun on the GPU: pause and resume, and a GPU checkpoint on the CPU --------------


class DropBN(nn.Module):
    """An MLP for digits with train-mode BatchNorm and dropout (GPU RNG draws to restore)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(),
                                 nn.Dropout(0.3), nn.Linear(64, 10))

    def forward(self, x):  # (B, 1, 8, 8) -> (B, 10)
        return self.net(x)


RESUME_TRAINER = ClassifierTrainer(dataset="digits", epochs=4, batch_size=64, lr=3e-3,
                                   lr_schedule="cosine", seed=2)


def _trajectories(folder: Path, device: str) -> dict:
    """Four epochs straight, and two + two resumed from a checkpoint in a new TrialRun:
    {"whole" | "parts": (metrics per epoch, final state)}."""
    run = TrialRun(DropBN, RESUME_TRAINER, seed=3, device=device, trial_id="t")
    whole = [run.train_epoch() for _ in range(4)]
    assert next(run.model.parameters()).device.type == device
    out = {"whole": (whole, run.state_dict())}
    first = TrialRun(DropBN, RESUME_TRAINER, seed=3, device=device, trial_id="t")
    parts = [first.train_epoch() for _ in range(2)]
    first.save(str(folder / "t-2.pt"))
    del first
    second = TrialRun(DropBN, RESUME_TRAINER, seed=3, device=device, trial_id="t",
                      checkpoint=str(folder / "t-2.pt"))
    assert second.step == 2
    parts += [second.train_epoch() for _ in range(2)]
    out["parts"] = (parts, second.state_dict())
    return out


def _deterministic_child(folder: str, device: str = "cuda") -> None:
    """Run in a fresh process by the test below: deterministic kernels must be chosen before
    CUDA starts (CUBLAS_WORKSPACE_CONFIG is in this process's environment)."""
    with determinism.deterministic(True):
        out = _trajectories(Path(folder), device)
    torch.save(out, os.path.join(folder, "trajectories.pt"))


def test_pause_and_resume_on_the_gpu_equals_never_pausing_with_deterministic_kernels(tmp_path):
    path = [str(HERE.parent), str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONPATH": os.pathsep.join(path)}
    code = f"import test_gpu; test_gpu._deterministic_child({str(tmp_path)!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(HERE),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = torch.load(tmp_path / "trajectories.pt", map_location="cpu", weights_only=False)
    whole, parts = out["whole"], out["parts"]
    assert whole[0] == parts[0]  # metrics of every epoch, bit for bit
    _close(whole[1], parts[1], exact=True)  # weights, Adam moments, scheduler, RNG streams


def test_pause_and_resume_on_the_gpu_with_the_engines_defaults(tmp_path, engine_defaults):
    """No deterministic mode (how the engine runs): equal within rtol 1e-5 / atol 1e-6 (in
    practice exactly: the same kernels run on the same shapes in the same order)."""
    out = _trajectories(tmp_path, "cuda")
    (whole, a), (parts, b) = out["whole"], out["parts"]
    _close(whole, parts, exact=False)
    _close(a, b, exact=False)
    assert all(math.isfinite(v) for m in whole for v in m.values())


def test_a_gpu_checkpoint_resumes_on_the_cpu_and_back(tmp_path):
    run = TrialRun(DropBN, RESUME_TRAINER, seed=3, device="cuda", trial_id="t")
    run.train_epoch()
    run.train_epoch()
    run.save(str(tmp_path / "gpu.pt"))
    state = ckpt.load(tmp_path / "gpu.pt")  # map_location="cpu" by default
    assert all(t.device.type == "cpu" for t in _tensors(state))
    assert state["rng"]["cuda"], "the GPU's RNG state is in the checkpoint"

    cpu = TrialRun(DropBN, RESUME_TRAINER, seed=99, device="cpu", trial_id="t",
                   checkpoint=str(tmp_path / "gpu.pt"))
    assert cpu.step == 2 and next(cpu.model.parameters()).device.type == "cpu"
    _close(run.model.state_dict(), cpu.model.state_dict(), exact=True)
    _close(run.optimizer.state_dict(), cpu.optimizer.state_dict(), exact=True)
    assert all(t.device.type == "cpu" for t in _tensors(cpu.optimizer.state_dict()["state"]))
    metrics = cpu.train_epoch()
    assert cpu.step == 3 and all(math.isfinite(v) for v in metrics.values())

    cpu.save(str(tmp_path / "cpu.pt"))  # and back onto the GPU
    back = TrialRun(DropBN, RESUME_TRAINER, seed=7, device="cuda", trial_id="t",
                    checkpoint=str(tmp_path / "cpu.pt"))
    assert next(back.model.parameters()).is_cuda
    _close(cpu.model.state_dict(), back.model.state_dict(), exact=True)
    metrics = back.train_epoch()
    assert back.step == 4 and all(math.isfinite(v) for v in metrics.values())


# ---- 3. Grouped jobs on the GPU ---------------------------------------------------------------


def _metrics_close(got: dict, expected: dict, rel: float, trainer) -> None:
    """Every metric within ``rel`` (and ATOL) of the reference; val_acc within one of the
    trainer's validation images."""
    validation = sum(len(y) for _, y in trainer.val_dataloader({}))
    assert got.keys() == expected.keys()
    for key, metrics in expected.items():
        assert got[key].keys() == metrics.keys(), key
        for name, value in metrics.items():
            if name == "val_acc":
                assert abs(got[key][name] - value) <= 1 / validation + 1e-9, (key, name)
            else:
                assert math.isclose(got[key][name], value, rel_tol=rel, abs_tol=ATOL), \
                    (key, name, got[key][name], value)


def test_a_grouped_job_on_the_gpu_equals_each_task_alone(tmp_path):
    """Four tasks over the frozen conv trunk of tests/test_grouped_jobs.py (dropout and
    train-mode BatchNorm in the heads, cosine LR, two epochs): each trial's metrics and final
    checkpoint equal training it alone within rtol 1e-5 / atol 1e-6, val_acc within one
    validation image."""
    heads = grouped_jobs.HEAD
    grouped = [grouped_jobs._task(t, tmp_path, tag="g-") for t in heads]
    alone = [grouped_jobs._task(t, tmp_path, tag="s-") for t in heads]
    runs = {t.trial_id: _open_task(t, WorkerContext()) for t in grouped}
    assert all(r.device.type == "cuda" and next(r.model.parameters()).is_cuda for r in runs.values())
    units = _units(Job("g", grouped, meta={"group": True}), grouped, runs, WorkerContext())
    assert [type(u) for u in units] == [TrainingGroup] and units[0].trials == tuple(heads)
    del runs, units

    events = grouped_jobs._run(Job("g", grouped, meta={"group": True}))
    assert isinstance(events[-1], JobFinished), events[-1]
    assert [e.trial_id for e in events if isinstance(e, TrialCheckpointed)] == list(heads)
    got, expected = grouped_jobs._results(events), grouped_jobs._alone(alone)
    assert sorted(got) == sorted(expected) == sorted((t, s) for t in heads for s in (1, 2))
    _metrics_close(got, expected, RTOL, WorkerContext().trainer(grouped_jobs.TRAINER))
    for g, s in zip(grouped, alone):
        _close(ckpt.load(g.checkpoint_out), ckpt.load(s.checkpoint_out), exact=False,
               where=g.trial_id)


class WithConstants(nn.Module):
    """A frozen stem, a non-persistent buffer and a tensor constant (a CONST node the group
    module makes itself, not adopted from a model), then a trainable head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 6).requires_grad_(False)
        self.register_buffer("mask", torch.ones(6), persistent=False)
        self.head = nn.Linear(6, 3)

    def forward(self, x):  # (B, 6) -> (B, 3)
        return self.head(self.stem(x) * self.mask + torch.tensor([1., 2., 3., 4., 5., 6.]))


def test_a_group_on_the_gpu_keeps_its_constants_on_the_gpu():
    torch.manual_seed(0)
    space = rt.ModelSpace(WithConstants(), [rt.apply_mutator("head", rt.mutators.OperatorMutator(
        {"a": nn.Linear(6, 3), "b": nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))},
        label="h"))], example_input=torch.randn(2, 6))
    plan = cse(build_plan([PlanModel(f"t{i}", m, "data") for i, m in
                           enumerate(space.enumerate())])).plan
    assert "_tensor_constant0" in {plan.nodes[k].name for k in plan.shared}
    models = {m.trial_id: space.build(m.model.sample, check=False).cuda() for m in plan.models}
    group = build_group(plan, models)
    assert all(b.is_cuda for b in group.buffers()) and all(p.is_cuda for p in group.parameters())
    x = torch.randn(5, 6, device="cuda")
    got = group(x)
    for trial, model in models.items():
        assert torch.equal(got[trial], model(x)), trial


# ---- 4. A real CUDA out-of-memory ---------------------------------------------------------------


class Greedy(TinyCNN):
    """Asks the GPU for twice its memory in every forward: a real CUDA out-of-memory."""

    def forward(self, x):
        too_much = 2 * torch.cuda.get_device_properties(x.device).total_memory
        torch.empty(too_much, dtype=torch.uint8, device=x.device)
        return super().forward(x)


class OomSpace:
    """``{"greedy": True}`` builds :class:`Greedy`; anything else a TinyCNN for digits."""

    def build(self, sample: dict) -> nn.Module:
        return Greedy() if sample.get("greedy") else TinyCNN(width=8, dropout=0.1)


OOM_SPACE = OomSpace()
OOM_TRAINER = {"class": "retiarii.engine.trainers.trainer:ClassifierTrainer",
               "config": {"dataset": "digits", "epochs": 2, "batch_size": 128, "lr": 3e-3}}


def test_a_real_cuda_out_of_memory_is_the_environments_fault():
    too_much = 2 * torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(torch.cuda.OutOfMemoryError) as info:
        torch.empty(too_much, dtype=torch.uint8, device="cuda")
    assert classify_error(info.value) is FailureKind.ENVIRONMENT


def _oom_task(trial: str, folder: Path, greedy: bool = False, seed: int = 0) -> TrialTask:
    folder.mkdir(exist_ok=True)
    return TrialTask(trial, {"space": _ref("OOM_SPACE"), "sample": {"greedy": greedy},
                             "trainer": OOM_TRAINER, "seed": seed, "deterministic": True},
                     0, 2, None, str(folder / f"{trial}-2.pt"))


def test_a_cuda_out_of_memory_fails_only_its_trial_and_the_worker_trains_on(tmp_path):
    with LocalExecutor(num_workers=1, heartbeat_interval=0.5) as ex:
        assert ex.wait_ready(timeout=TIMEOUT)
        pids = ex.worker_pids()
        ex.submit(Job("j0", [_oom_task("ok1", tmp_path / "ref", seed=1),
                             _oom_task("ok2", tmp_path / "ref", seed=2)]))
        reference = _drain(ex, "j0")["j0"]
        ex.submit(Job("j1", [_oom_task("ok1", tmp_path, seed=1),
                             _oom_task("oom", tmp_path, greedy=True),
                             _oom_task("ok2", tmp_path, seed=2)]))
        first = _drain(ex, "j1")["j1"]
        ex.submit(Job("j2", [_oom_task("after", tmp_path, seed=3)]))
        second = _drain(ex, "j2")["j2"]
        assert ex.worker_pids() == pids, "the worker was restarted"
    end = first[-1]
    assert isinstance(end, JobFailed) and end.trial_id == "oom" and not end.worker_lost
    assert end.kind is FailureKind.ENVIRONMENT
    assert "OutOfMemoryError" in end.error and "out of memory" in end.error.lower()
    assert [e.trial_id for e in first if isinstance(e, TrialCheckpointed)] == ["ok1", "ok2"]
    results = [e for e in first if isinstance(e, TrialResult)]
    assert sorted((e.trial_id, e.step) for e in results) == \
        [("ok1", 1), ("ok1", 2), ("ok2", 1), ("ok2", 2)]
    assert all(math.isfinite(v) for e in results for v in e.metrics.values())
    # the others trained as in a job without the greedy trial (j0), in the same worker
    assert isinstance(reference[-1], JobFinished), reference[-1]
    _close({(e.trial_id, e.step): e.metrics for e in reference if isinstance(e, TrialResult)},
           {(e.trial_id, e.step): e.metrics for e in results}, exact=False)
    assert isinstance(second[-1], JobFinished), second[-1]
    assert [e.worker for e in reference + first + second if isinstance(e, JobStarted)] == \
        ["local-0"] * 3
    assert [e.step for e in second if isinstance(e, TrialResult)] == [1, 2]
    assert os.path.exists(tmp_path / "after-2.pt")



def test_one_architecture_measures_fused_first_on_the_gpu(tmp_path):
    """Four MLPs of one architecture under ``fuse="auto"`` on the GPU: the first batches
    train fused on the trials' own models (measured for real: fused decided against CSE's
    bound, or CSE measured next), and every metric is training alone's within fused
    tolerance (rel 1e-4; val_acc within one validation image); so is a weight penalty's
    (its gradients outside the fused forward folded into the fused step's), on small CNNs
    with BatchNorm."""
    import test_fused_jobs
    import test_measuring as m

    tasks = m._mlp_tasks(tmp_path, "m-", frozen=False)
    events, unit = m._measured_job(tasks)
    assert isinstance(events[-1], JobFinished), events[-1]
    choice = unit["choice"]
    assert choice["device"].startswith("cuda") and "fused" in choice["steps_s"]
    alone = grouped_jobs._alone(m._mlp_tasks(tmp_path, "a-", frozen=False))
    _metrics_close(grouped_jobs._results(events), alone, 1e-4,
                   WorkerContext().trainer(grouped_jobs.TRAINER))

    penalty = f"{os.path.abspath(test_fused_jobs.__file__)}:PENALTY"

    def tasks_of(tag):
        return m._mlp_tasks(tmp_path, tag, frozen=False, space="cnn_space", trainer=penalty)

    events, unit = m._measured_job(tasks_of("p-"))
    assert isinstance(events[-1], JobFinished), events[-1]
    assert "fused_failed" not in unit["choice"] and "fused" in unit["choice"]["steps_s"]
    _metrics_close(grouped_jobs._results(events), grouped_jobs._alone(tasks_of("q-")), 1e-4,
                   test_fused_jobs.PENALTY)


# ---- 5. Deterministic mode ----------------------------------------------------------------------


DEMO_TRAINER = ClassifierTrainer(dataset="digits", epochs=2, batch_size=64, seed=0)


def _all_curves(db) -> dict:
    """(model sample, metric) -> its learning curve, for every trial of the store."""
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        return {(str(sorted(t["spec"]["choices"].items())), m):
                store.learning_curve(t["id"], m)
                for t in store.trials() for m in ("train_loss", "val_loss", "val_acc")}


def search_twice_is_identical(tmp_path: Path, devices=None, models: int = 4) -> None:
    """The demo searched twice (``models`` models, ``optimize=False``, deterministic mode, a
    worker per GPU of ``devices``; ``[]``: one CPU worker): every metric of every epoch of
    every model equal, bit for bit. Without the mode, on an H200, two such runs were 13%
    apart (issue #27)."""
    curves = []
    for run in ("a", "b"):
        workers = max(1, len(devices) if devices is not None else torch.cuda.device_count())
        summary = rt.Experiment("retiarii.demo:space", rt.strategies.Random(seed=0),
                                DEMO_TRAINER, store=str(tmp_path / f"{run}.db"),
                                workers=workers, devices=devices, max_models=models, seed=0,
                                optimize=False, deterministic=True).run()
        assert summary["trials"]["TERMINATED"] == models, summary
        curves.append(_all_curves(tmp_path / f"{run}.db"))
    assert len(curves[0]) == 3 * models and curves[0] == curves[1]


def layouts_agree_with_alone(tmp_path: Path, rel: float = RTOL) -> None:
    """In this process (the caller picks the mode), three jobs against each task trained in
    a job of its own: several tasks apart in one job (no grouping), a CSE group (the frozen
    trunk of tests/test_grouped_jobs.py, dropout and train-mode BatchNorm in the heads) and
    a group whose frozen layers run batched (its adapters space). Every metric within
    ``rel`` (val_acc within one validation image), every checkpoint within ``rel`` (0.0:
    exactly)."""
    heads = grouped_jobs.HEAD
    adapters = {"p": ("ad", "id"), "q": ("id", "ad"), "r": ("ad", "ad")}

    def adapter_task(trial, tag):
        spec = {"space": f"{os.path.abspath(grouped_jobs.__file__)}:ADAPTERS",
                "sample": {f"s{d}/slots.{d}": c for d, c in enumerate(adapters[trial])},
                "trainer": grouped_jobs.TRAINER, "hparams": {}, "seed": ord(trial)}
        return TrialTask(trial, spec, 0, 2, None, str(tmp_path / f"{tag}{trial}.pt"))

    layouts = {
        "apart": ({}, lambda tag: [grouped_jobs._task(t, tmp_path, tag=tag) for t in heads]),
        "cse": ({"group": True}, lambda tag: [grouped_jobs._task(t, tmp_path, tag=tag)
                                              for t in heads]),
        "batching": ({"group": True, "batching": True},
                     lambda tag: [adapter_task(t, tag) for t in adapters]),
    }
    trainer = WorkerContext().trainer(grouped_jobs.TRAINER)
    for name, (meta, make) in layouts.items():
        together, alone = make(f"{name}-g-"), make(f"{name}-s-")
        events = grouped_jobs._run(Job(name, together, meta=meta))
        assert isinstance(events[-1], JobFinished), (name, events[-1])
        got, expected = grouped_jobs._results(events), grouped_jobs._alone(alone)
        if rel == 0.0:
            assert got == expected, name
        else:
            _metrics_close(got, expected, rel, trainer)
        for g, s in zip(together, alone):
            _close(ckpt.load(g.checkpoint_out), ckpt.load(s.checkpoint_out), exact=rel == 0.0,
                   where=f"{name}/{g.trial_id}")


def test_a_search_run_twice_on_the_gpu_gives_identical_metrics(tmp_path):
    search_twice_is_identical(tmp_path)


def test_layouts_that_do_not_fuse_agree_with_alone_on_the_gpu_in_deterministic_mode(tmp_path):
    """(The fused layout's agreement, within 1e-4, is the test above on one architecture.)"""
    layouts_agree_with_alone(tmp_path)
