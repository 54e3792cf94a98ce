"""The engine hosts one-shot searches: jobs per segment, units, the store, resume, the CLI.

The reference for every run is the strategy driven by hand in this process, without an engine
(``setup`` once, then ``run_segment`` for each segment): the engine rebuilds the strategy in a
worker for every segment from the last unit, so equality (bit for bit on CPU) shows that a
unit holds everything the next segment reads. A driver killed at any of its writes, or
between segments, and resumed, and a worker killed in the middle of a segment, give that same
search: the same models recorded once each, the same final weights.
"""
from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch

import retiarii as rt
from engine_helpers import InProcessExecutor
from one_shot_helpers import PerArchitecture, space, trainer
from one_shot_helpers import strategy as file_strategy
from retiarii.cli import main
from retiarii.engine import LocalExecutor
from retiarii.engine.storage import checkpoint
from retiarii.engine.driver.one_shot_host import OneShotRun
from retiarii.engine.storage.segments_table import SegmentTable
from retiarii.engine.storage.store import Store
from retiarii.strategies.one_shot.base import SegmentContext

EPOCHS, PER_SEGMENT = 3, 2


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _by_hand(strategy=None, device=torch.device("cpu"),
             trainer=trainer) -> tuple[list, list, dict, dict]:
    """The search without an engine: (models per segment, strategy metrics per segment,
    selected sample, the selected architecture's weights)."""
    if strategy is None:
        strategy = PerArchitecture(epochs=EPOCHS, models_per_segment=PER_SEGMENT)
    checkpoint.seed_rng(0)  # the experiment's seed, as the worker seeds it
    strategy.setup(space, trainer, {}, device)
    models, metrics = [], []
    for segment in range(strategy.num_segments()):
        result = strategy.run_segment(SegmentContext(segment, trainer, {}, device))
        models += [(segment + 1, m.sample, m.metrics) for m in result.models]
        metrics.append(result.metrics)
    selected = strategy.selected()
    weights = {k: v.detach().cpu() for k, v in strategy.export_state(selected).items()}
    return models, metrics, selected, weights


REFERENCE = None


def _reference():
    global REFERENCE
    if REFERENCE is None:
        REFERENCE = _by_hand()
    return REFERENCE


def _experiment(path, executor=None, **kwargs) -> rt.Experiment:
    strategy = PerArchitecture(epochs=EPOCHS, models_per_segment=PER_SEGMENT, **kwargs)
    return rt.Experiment(space, strategy, trainer, store=str(path), workers=1, seed=0,
                         executor=executor if executor is not None else InProcessExecutor())


@pytest.fixture(scope="module")
def local():
    """One worker process with one thread, as the reference runs (a matmul's float rounding
    depends on the threads that share it)."""
    with LocalExecutor(1, [], threads_per_worker=1) as executor:
        yield executor


def _outcome(path) -> dict:
    """What a search recorded, in a form two runs are compared by."""
    with Store(path) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        table = SegmentTable(store)
        rows = table.rows()
        result = table.result()
        weights = None
        if rows and result is not None:
            unit = checkpoint.load(store.checkpoint_file(rows[-1]["unit"]))
            weights = unit["export"]["weights"]
        return {"models": [(m["segment"], m["sample"], m["metrics"]) for m in table.evaluated()],
                "segments": [(r["segment"], r["metrics"], r["selected"]) for r in rows],
                "result": None if result is None else result["sample"], "weights": weights,
                "status": store.get_experiment()["status"]}


def _assert_equals_reference(got: dict, where: str = "", reference=None) -> None:
    models, metrics, selected, weights = reference or _reference()
    assert got["models"] == models, where  # once each, in order, same metrics bit for bit
    assert [m for _, m, _ in got["segments"]] == metrics, where
    assert got["result"] == selected and got["status"] == "done", where
    assert got["weights"].keys() == weights.keys(), where
    for name, value in weights.items():
        assert torch.equal(got["weights"][name], value), (where, name)


# ---- a search through Experiment, local worker processes, the CLI's export --------------------


def test_one_shot_search_on_local_workers_records_models_and_exports(tmp_path, capsys, local):
    path = tmp_path / "run.db"
    summary = _experiment(path, executor=local).run()
    got = _outcome(path)
    _assert_equals_reference(got)
    assert len(got["models"]) == EPOCHS * PER_SEGMENT
    assert summary["one_shot"]["segment"] == EPOCHS and summary["one_shot"]["models"] == 6
    values = [v for _, _, m in got["models"] for v in m.values()]
    assert summary["best"][0]["value"] == max(values)
    # only the last unit is kept: the earlier ones were deleted once the next was recorded
    units = sorted(os.listdir(tmp_path / "run.checkpoints" / "e1-one-shot"))
    assert units == ["step-000003"]
    out = tmp_path / "export"
    assert main(["export", str(path), "--out", str(out)]) == 0
    assert "weights inherited from the super-network" in capsys.readouterr().out
    (py,) = [f for f in os.listdir(out) if f.endswith(".py")]
    namespace: dict = {}
    exec(compile(open(out / py).read(), py, "exec"), namespace)
    model = namespace["Model" + py[len("model_"):-3]]()
    model.load_state_dict(torch.load(out / py.replace(".py", ".pt")))
    reference = space.build(_reference()[2])
    reference.load_state_dict(_reference()[3])
    x = torch.randn(5, 1, 8, 8)
    assert torch.equal(model(x), reference(x))  # the exported net is the selected one
    assert json.load(open(out / py.replace(".py", ".json")))["sample"] == _reference()[2]
    assert main(["status", str(path)]) == 0
    text = capsys.readouterr().out
    assert "segment 3 of 3, 6 models evaluated" in text
    assert f"selected architecture, result (model 7): {json.dumps(_reference()[2])}" in text


def test_worker_killed_mid_segment_reruns_it_from_the_last_unit(tmp_path, local):
    path = tmp_path / "run.db"
    marker = tmp_path / "died"
    exp = _experiment(path, executor=local, die_in_segment=1, die_marker=str(marker))
    exp.run()
    assert marker.exists()  # the worker did die in segment 2, and the search went on
    got = _outcome(path)
    # the config differs in the die_* arguments only, which change nothing the search reads
    _assert_equals_reference(got, "worker killed in segment 2")


# ---- a driver killed at every write, and between segments -------------------------------------


class Died(BaseException):
    """The driver is dead (BaseException: nothing in the engine may catch it)."""


# Every point where a driver can die: the store's writes, each write inside the commit of a
# segment (one model row at a time: inside the transaction), and the submission of a segment.
POINTS = [(Store, "add_experiment"), (Store, "set_experiment_status"), (Store, "flush"),
          (SegmentTable, "commit"), (SegmentTable, "_insert_model"),
          (SegmentTable, "record_result"), (SegmentTable, "clear_error"),
          (OneShotRun, "_submit")]


class _Killer:
    def __init__(self, die_at: int | None):
        self.die_at, self.count, self.dead = die_at, 0, False
        self.names: list[str] = []  # the points passed, in order

    def wrap(self, cls, name):
        original = getattr(cls, name)
        killer = self

        def point(self, *args, **kwargs):
            if killer.dead:
                raise Died(f"{name} after death")
            if name == "flush" and not self._buffer:
                return original(self, *args, **kwargs)
            killer.count += 1
            killer.names.append(f"{cls.__name__}.{name}")
            if killer.count == killer.die_at:
                killer.dead = True
                raise Died(f"killed at point {killer.count} ({cls.__name__}.{name})")
            return original(self, *args, **kwargs)

        return point


def _run_dying(path, die_at, monkeypatch, make=None, points=POINTS) -> tuple[bool, list[str]]:
    killer = _Killer(die_at)
    with monkeypatch.context() as m:
        for cls, name in points:
            m.setattr(cls, name, killer.wrap(cls, name))
        exp = (make or _experiment)(path)
        try:
            exp.run()
            died = False
        except Died:
            died = True
        finally:
            if exp.store is not None and exp.store.db is not None:
                exp.store.db.conn.close()  # what was not committed is lost, as in a dead process
                exp.store.db = None
            if exp._lock is not None:
                exp._lock.release()
    return died, killer.names


def _kill_and_resume(tmp_path, monkeypatch, pick) -> None:
    died, names = _run_dying(tmp_path / "count.db", None, monkeypatch)
    assert not died
    _assert_equals_reference(_outcome(tmp_path / "count.db"))
    # the points are really counted: 3 submissions, 3 commits, 6 models inside them
    assert [names.count(f"SegmentTable.{n}") for n in ("commit", "_insert_model")] == [3, 6]
    assert names.count("OneShotRun._submit") == 3
    total = len(names)
    for n in pick(names):
        path = tmp_path / f"kill-{n}.db"
        died, _ = _run_dying(path, n, monkeypatch)
        assert died, f"no death at point {n}"
        with Store(path) as store:
            started = bool(store.experiments())
        exp = _experiment(path)
        exp.resume() if started else exp.run()
        _assert_equals_reference(_outcome(path), f"driver killed at point {n} of {total} "
                                                 f"({names[n - 1]})")


def test_driver_killed_at_every_point_then_resumed_equals_uninterrupted(tmp_path, monkeypatch):
    # Among them: between segments (at a submission), in the commit window (a segment's unit
    # written, its commit not begun) and inside a commit's transaction (at a model's row).
    _kill_and_resume(tmp_path, monkeypatch, lambda names: range(1, len(names) + 1))


# ---- failures and refused options ----------------------------------------------------------


def test_a_space_the_strategy_refuses_fails_the_experiment_with_its_reason(tmp_path, capsys):
    path = tmp_path / "bad.db"
    with pytest.raises(rt.ExperimentError, match="cannot search the choice 'act'"):
        _experiment(path, refuse="act").run()
    with Store(path) as store:
        store.use_experiment(1)
        assert store.get_experiment()["status"] == "failed"
        error = SegmentTable(store).error()
    assert error.startswith("ValueError: PerArchitecture cannot search the choice 'act'")
    assert main(["status", str(path)]) == 0
    assert "failed: ValueError: PerArchitecture cannot search" in capsys.readouterr().out
    assert main(["export", str(path), "--out", str(tmp_path / "x")]) == 2
    assert "has not selected its architecture yet" in capsys.readouterr().err


def test_darts_on_a_space_it_cannot_relax_fails_with_its_own_error(tmp_path):
    from one_shot_helpers import two_bases

    path = tmp_path / "darts.db"
    with pytest.raises(rt.ExperimentError, match="failed in segment 1: RelaxError: the space "
                                                 "has 2 base models"):
        rt.Experiment(two_bases, rt.strategies.DARTS(epochs=2), trainer, store=str(path),
                      executor=InProcessExecutor()).run()
    with Store(path) as store:
        store.use_experiment(1)
        assert store.get_experiment()["status"] == "failed"
        assert "use a one-shot strategy that samples whole" in SegmentTable(store).error()
        assert SegmentTable(store).rows() == []  # no segment ran, no model recorded


@pytest.mark.parametrize("option, value, match", [
    ("scheduler", rt.strategies.ASHA(metric="val_acc", mode="max", max_t=2), "scheduler="),
    ("max_models", 10, "max_models=10 does not apply"),
    ("optimize", True, "optimize=True does not apply"),
    ("fuse", "auto", "fuse='auto' does not apply"),
    ("batching", True, "batching=True does not apply"),
    ("model_retries", 2, "model_retries=2 does not apply"),
    ("optimize", "pack", "optimize='pack' does not apply"),
    ("packing", True, "packing=True does not apply"),
    ("dedicated", ["fc1"], r"dedicated=\['fc1'\] does not apply"),
])
def test_options_a_one_shot_search_cannot_honour_are_refused(tmp_path, option, value, match):
    with pytest.raises(rt.ExperimentError, match=match):
        rt.Experiment(space, PerArchitecture(), trainer, store=str(tmp_path / "x.db"),
                      **{option: value})


def test_a_searched_trainer_setting_is_held_and_the_simulator_refused(tmp_path):
    """Issue #28: a searched trainer setting is held at its first value during the search
    (the worker's hparams), said once when run() starts, before any worker does."""
    from retiarii.engine.driver.one_shot_host import HeldHyperParameters, OneShotRun

    searched = rt.Trainer(dataset="digits", lr=rt.ValueChoice([0.1, 0.01], label="lr"))
    exp = rt.Experiment(space, PerArchitecture(), searched, store=str(tmp_path / "x.db"))
    exp.store = type("S", (), {"experiment_id": 1})()
    # the spec every segment's worker gets holds lr at its first value
    assert OneShotRun(exp, None).spec["hparams"] == {"lr": 0.1}

    def started():
        raise RuntimeError("the store opens: what comes next starts workers")

    exp._open = started
    with pytest.warns(HeldHyperParameters, match=r"\['lr'\] are held at lr=0.1.*retrain") \
            as said, pytest.raises(RuntimeError, match="the store opens"):
        exp.run()
    assert len([w for w in said if w.category is HeldHyperParameters]) == 1
    with pytest.raises(rt.ExperimentError, match="SimulatedExecutor"):
        rt.Experiment(space, PerArchitecture(), trainer, store=str(tmp_path / "x.db"),
                      executor=rt.engine.SimulatedExecutor(1, curve=lambda spec, step: {}))
    exp = _experiment(tmp_path / "y.db")
    with pytest.raises(rt.ExperimentError, match="max_models=3 does not apply"):
        exp.run(max_models=3)


def test_weight_sharing_wraps_multi_trial_strategies_only(tmp_path, monkeypatch):
    with pytest.raises(rt.ExperimentError, match="already a one-shot strategy"):
        rt.Experiment(space, PerArchitecture(), trainer, store=str(tmp_path / "x.db"),
                      weight_sharing=True)
    with pytest.raises(rt.ExperimentError, match="weight_sharing='yes': give True, False, or a list"):
        rt.Experiment(space, rt.strategies.Random(seed=0), trainer,
                      store=str(tmp_path / "x.db"), weight_sharing="yes")
    monkeypatch.delattr(rt.strategies, "WeightSharing", raising=False)
    with pytest.raises(rt.ExperimentError, match="needs retiarii.strategies.WeightSharing"):
        rt.Experiment(space, rt.strategies.Random(seed=0), trainer,
                      store=str(tmp_path / "x.db"), weight_sharing=True)


def test_weight_sharing_runs_a_multi_trial_strategy_as_a_one_shot_search(tmp_path):
    two = rt.Trainer(dataset="digits", epochs=2, batch_size=128)  # two segments
    exp = rt.Experiment(space, rt.strategies.Random(seed=3, dedup=False), two,
                        store=str(tmp_path / "ws.db"), seed=0, executor=InProcessExecutor(),
                        weight_sharing=True)
    assert isinstance(exp.strategy, rt.strategies.WeightSharing)
    exp.run()
    by_hand = rt.strategies.WeightSharing(rt.strategies.Random(seed=3, dedup=False), segments=2)
    reference = _by_hand(by_hand)
    assert len(reference[0]) > 2  # models were evaluated in each segment
    _assert_equals_reference(_outcome(tmp_path / "ws.db"), "weight_sharing=True", reference)


def _spos_on_ranks(path) -> rt.Experiment:
    spos = rt.strategies.SPOS(train_segments=2, search_population=2, search_generations=1,
                              seed=1)
    return rt.Experiment(space, spos, trainer, store=str(path), seed=0,
                         executor=InProcessExecutor(), ranks=2)


@pytest.mark.slow  # rank processes (forkserver, torch.distributed): ~25 s on 2 busy cores
def test_segments_on_two_ranks_resume_as_uninterrupted(tmp_path, monkeypatch):
    _spos_on_ranks(tmp_path / "a.db").run()
    expected = _outcome(tmp_path / "a.db")
    assert expected["status"] == "done" and len(expected["segments"]) == 3
    assert expected["models"]  # the search segment evaluated models on the trained weights
    # dies at the second submission: between segments 1 and 2
    died, _ = _run_dying(tmp_path / "b.db", 2, monkeypatch, _spos_on_ranks,
                         [(OneShotRun, "_submit")])
    assert died
    _spos_on_ranks(tmp_path / "b.db").resume()
    got = _outcome(tmp_path / "b.db")
    assert got["models"] == expected["models"] and got["segments"] == expected["segments"]
    assert got["result"] == expected["result"]
    for name, value in expected["weights"].items():
        assert torch.equal(got["weights"][name], value), name
    with pytest.raises(rt.ExperimentError, match="differs from the stored one"):
        rt.Experiment(space, rt.strategies.SPOS(train_segments=2, search_population=2,
                                                search_generations=1, seed=1), trainer,
                      store=str(tmp_path / "b.db"), seed=0, executor=InProcessExecutor()).resume()


def test_ranks_apply_to_one_shot_searches_only(tmp_path):
    with pytest.raises(rt.ExperimentError, match="ranks=2 runs a one-shot segment"):
        rt.Experiment(space, rt.strategies.Random(seed=0), trainer,
                      store=str(tmp_path / "x.db"), ranks=2)
    with pytest.raises(rt.ExperimentError, match="ranks=0: give a number of ranks >= 1"):
        rt.Experiment(space, PerArchitecture(), trainer, store=str(tmp_path / "x.db"), ranks=0)


class Unrebuildable(PerArchitecture):
    """Takes a setting its config() leaves out: a worker could not rebuild it."""

    def __init__(self, width: list):
        super().__init__()
        self._width = width


def test_a_strategy_its_config_cannot_rebuild_is_refused_before_any_work(tmp_path):
    with pytest.raises(rt.ExperimentError, match="cannot be rebuilt from its class and config"):
        rt.Experiment(space, Unrebuildable([1]), trainer, store=str(tmp_path / "x.db"))
    assert not (tmp_path / "x.db").exists()


def test_resume_of_a_finished_search_changes_nothing_and_max_time_stops_between_segments(
        tmp_path):
    path = tmp_path / "run.db"
    assert _experiment(path).run(max_time=0)["one_shot"]["segment"] == 0
    with Store(path) as store:
        store.use_experiment(1)
        assert store.get_experiment()["status"] == "stopped"
    _experiment(path).resume()
    before = _outcome(path)
    _assert_equals_reference(before)
    _experiment(path).resume()
    assert _outcome(path)["models"] == before["models"]
    with pytest.raises(rt.ExperimentError, match="differs from the stored one"):
        _experiment(path, batches=3).resume()


# ---- the command line ------------------------------------------------------------------------

HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "one_shot_helpers.py")


@pytest.fixture
def in_process(monkeypatch):
    """`retiarii run` trains in this process (the local executor is tested above)."""
    # the registry's "local" executor, as Experiment makes it
    monkeypatch.setattr("retiarii.engine.executors.local.LocalExecutor.for_search",
                        lambda *args, **kwargs: InProcessExecutor())


def test_cli_runs_status_resumes_and_exports_a_one_shot_search(tmp_path, capsys, in_process):
    db = str(tmp_path / "cli.db")
    # the file's `strategy` is one-shot: a model budget does not apply to it
    assert main(["run", HELPERS, "--store", db, "--max-models", "5"]) == 2
    assert "--max-models applies to multi-trial searches" in capsys.readouterr().err
    assert main(["run", HELPERS, "--store", db, "--scheduler", "asha"]) == 2
    assert "a one-shot search trains one super-network" in capsys.readouterr().err
    assert main(["run", HELPERS, "--store", db]) == 0
    out = capsys.readouterr()
    assert "segment 3/3, 6 models evaluated" in out.err  # the progress line per segment
    # the file's strategy has the reference's settings
    assert file_strategy.config() == PerArchitecture(epochs=EPOCHS,
                                                     models_per_segment=PER_SEGMENT).config()
    assert f"selected architecture: {json.dumps(_reference()[2])}" in out.out
    assert main(["status", db, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["status"] == "done" and status["one_shot"]["models"] == 6
    assert status["one_shot"]["selected"] == _reference()[2]
    assert main(["resume", db]) == 0  # a finished search: nothing runs again
    capsys.readouterr()
    _assert_equals_reference(_outcome(db))
    assert main(["export", db, "--out", str(tmp_path / "out")]) == 0
    assert os.path.exists(tmp_path / "out" / "model_7.pt")
    assert main(["plot", db, "--out", str(tmp_path / "plot.png")]) == 0
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_one_shot_strategy_names(tmp_path, capsys, in_process):
    db = str(tmp_path / "spos.db")
    code = main(["run", HELPERS, "--strategy", "spos", "--epochs", "2", "--store", db])
    if hasattr(rt.strategies, "SPOS"):
        assert code == 0, capsys.readouterr().err
        capsys.readouterr()
        assert main(["status", db, "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        search = status["one_shot"]
        # --epochs 2: two training segments, then SPOS's evolutionary search segment
        assert status["strategy"] == "SPOS" and search["segment"] == search["segments"] == 3
        assert status["status"] == "done" and search["models"] > 0
        assert search["selected"] in ({"act": "relu"}, {"act": "tanh"})
    else:
        assert code == 2
        assert "--strategy spos needs retiarii.strategies.SPOS" in capsys.readouterr().err


@pytest.mark.slow
def test_one_shot_search_on_ray_ships_units_and_equals_the_reference(tmp_path):
    ray = pytest.importorskip("ray", reason="Ray is not installed")
    from retiarii.engine.executors.ray import RayExecutor

    # shared_storage=False: each unit travels as bytes to the driver's run folder and back
    with RayExecutor(num_workers=1, num_cpus=1, shared_storage=False) as executor:
        _experiment(tmp_path / "ray.db", executor=executor).run()
    assert not ray.is_initialized()
    _assert_equals_reference(_outcome(tmp_path / "ray.db"), "on Ray")


@pytest.mark.slow  # a worker process and three searches: ~15 s on 2 busy cores
def test_the_benchmark_runs_quick():
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks", "one_shot_engine.py")
    out = subprocess.run([sys.executable, script, "--quick"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "cpu 2 segments: by hand" in out.stdout and "one_shot_engine-quick.csv" in out.stdout


@pytest.mark.gpu
def test_a_one_shot_search_on_the_gpu_equals_the_by_hand_search_on_the_gpu(tmp_path):
    """The worker sets the strategy up on its GPU, units go to disk from there and load back
    onto it; the search is the by-hand one on the same GPU (float tolerance: GPU kernels)."""
    assert torch.cuda.is_available()
    models, metrics, selected, weights = _by_hand(device=torch.device("cuda"))
    _experiment(tmp_path / "gpu.db").run()  # the in-process worker sees the GPU
    got = _outcome(tmp_path / "gpu.db")
    assert [(s, m) for s, m, _ in got["models"]] == [(s, m) for s, m, _ in models]
    for (_, _, a), (_, _, b) in zip(got["models"], models):
        assert a["val_acc"] == pytest.approx(b["val_acc"], abs=1e-3)
    assert got["result"] == selected and got["status"] == "done"
    for name, value in weights.items():
        assert got["weights"][name].device.type == "cpu"
        assert torch.allclose(got["weights"][name], value, atol=1e-5), name


def _segments_recorded(path: str) -> int:
    """Segments the store at ``path`` has recorded, read as a bystander (0 while the driver
    creates the file)."""
    import sqlite3

    if not os.path.exists(path):
        return 0
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            return db.execute("SELECT count(*) FROM segments").fetchone()[0]
    except sqlite3.OperationalError:  # locked, or the table not created yet
        return 0


@pytest.mark.slow  # three driver processes and their workers: ~60 s on 2 busy cores
def test_driver_process_sigkilled_mid_search_resumes_as_uninterrupted(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    driver = os.path.join(os.path.dirname(os.path.abspath(__file__)), "one_shot_driver.py")
    path = str(tmp_path / "killed.db")
    proc = subprocess.Popen([sys.executable, driver, path, "run"])
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # until segment 1 is recorded (test code may poll)
            if _segments_recorded(path):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the driver recorded no segment in 300 s")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert _outcome(path)["status"] == "running"  # killed: nothing said it ended
    subprocess.run([sys.executable, driver, path, "resume"], check=True, timeout=600)
    _assert_equals_reference(_outcome(path), "driver SIGKILLed after segment 1")


def test_cli_device_memory_splits_and_resumes_with_the_same_budget(tmp_path, capsys, in_process):
    db = str(tmp_path / "split.db")
    args = ["run", HELPERS, "--strategy", "spos", "--epochs", "1", "--store", db]
    assert main([*args, "--device-memory", "a lot"]) == 2
    assert "device_memory='a lot': give positive bytes" in capsys.readouterr().err
    assert main([*args, "--device-memory", "1MiB"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        assert store.get_experiment()["config"]["device_memory"] == 2 ** 20
    assert main(["resume", db]) == 0  # the stored flags give the same budget back
    capsys.readouterr()
    assert main(["status", db, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "done"


def test_cli_shared_annotates_the_operators_that_share_weights(tmp_path, capsys, in_process):
    db = str(tmp_path / "shared.db")
    assert main(["run", HELPERS, "--store", db, "--shared", "fc1"]) == 2
    assert "--shared annotates the operators" in capsys.readouterr().err
    args = ["run", HELPERS, "--strategy", "spos", "--epochs", "1", "--store", db]
    assert main([*args, "--shared", "fc9"]) == 2  # refused before any work
    assert "'fc9' matches no operator of the space" in capsys.readouterr().err
    assert main([*args, "--store", str(tmp_path / "ok.db"), "--shared", "fc1"]) == 0
    capsys.readouterr()
    with Store(str(tmp_path / "ok.db")) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        assert store.get_experiment()["config"]["strategy"]["config"]["shared"] == ["fc1"]


def test_the_one_shot_plot_puts_counts_on_their_own_axis():
    """#28: the plot drew controller_steps (50) on the accuracy axis, flattening it."""
    from retiarii.cli_one_shot import split_by_scale

    rows = [{"segment": k, "metrics": {"val_acc": 0.3 + k / 10, "loss": 2.3 - k / 10,
                                       "controller_steps": 50, "bad": float("nan")}}
            for k in (1, 2)]
    assert split_by_scale(rows, "val_acc") == (["loss", "val_acc"], ["controller_steps"])
    assert split_by_scale(rows, "controller_steps") == (
        ["controller_steps", "loss", "val_acc"], [])  # one scale when the metric is the count
    assert split_by_scale([], "val_acc") == ([], [])
