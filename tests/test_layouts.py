"""Choosing a layout per group key and device (issue #13 item 3): the decision on hand-made
measurements (``cost.choose_layout``), and in a search under ``optimize="auto"``: the first
job of a group key measures the layouts (its measurement injected here, so the choice does not
depend on this machine's timing), later jobs and a resumed search apply the choice without
measuring again, a layout measured slower over a segment is reverted, and the results are
those of training each model alone (fused: within the tolerance of tests/test_fused_jobs.py,
``rel=1e-4`` on every metric; unfused: bit for bit)."""
from __future__ import annotations


from dataclasses import replace

import pytest

import retiarii as rt
from engine_helpers import InProcessExecutor
from exp_space import cnn_space, lr_trainer, mlp_space
from retiarii.engine.worker_side import group_layouts as layouts, measuring_group as measuring
from retiarii.engine.worker_side import measuring_speedups as speedups
from retiarii.engine.jobs.job import JobFailed, JobFinished, JobProfiled, JobStarted
from retiarii.engine.storage.plans_table import PlanTable
from retiarii.engine.jobs.reports import PlanRecord
from retiarii.engine.storage.store import Store
from retiarii.optim.cost import Layout, choose_layout, describe, probe_speedups
from retiarii.engine.jobs.contract import GroupOrder, HeldLayout

import test_fused_jobs as f
import test_optimize as o

S, C, B, F = Layout.SEPARATE, Layout.CSE, Layout.BATCHING, Layout.FUSED


# ---- the decision (hand-made measurements) --------------------------------------------------


def test_the_fastest_layout_over_the_margin_is_chosen():
    assert choose_layout({C: 1.3, F: 2.4}).order == (F, C, S, B)  # B unmeasured: last
    assert choose_layout({C: 1.3, B: 1.5, F: 0.64}).order == (B, C, S, F)
    assert choose_layout({C: 0.9, F: 0.64}).order == (S, C, F, B)  # not faster: as measured
    # a merged layout must beat apart by the margin (1.1): 1.05 is apart, 1.1 is kept
    assert choose_layout({C: 1.05}).layout is S and choose_layout({C: 1.1}).layout is C
    assert choose_layout({F: 1.05, C: 1.02}).layout is S
    assert choose_layout({C: 1.05}, margin=1.0).layout is C


def test_ties_keep_the_simpler_layout():
    assert choose_layout({C: 1.5, B: 1.5}).layout is C  # batching pays concatenations
    assert choose_layout({C: 2.0, F: 2.0}).layout is C  # CSE is bit for bit, fusion rounds
    assert choose_layout({C: 1.5, B: 1.5, F: 1.5}).order[:3] == (C, B, F)
    assert choose_layout({C: 1.1, F: 1.1}, margin=1.1).layout is C


def test_missing_measurements_and_reverted_layouts():
    # nothing measured: merged, as an unmeasured group always was
    assert choose_layout({}).order == (C, S, B, F)
    assert choose_layout({C: None, F: None}).order == (C, S, B, F)
    # measured layouts first, the others after in the Layout order
    assert choose_layout({F: 2.0}).order == (F, S, C, B)
    assert choose_layout({F: None, B: 1.4}).order == (B, S, C, F)
    # a layout reverted over a segment is never chosen again; separate always remains
    assert choose_layout({C: 1.3, F: 2.4}, reverted=[F]).order == (C, S, B)
    assert choose_layout({}, reverted=[C]).order == (S, B, F)
    assert choose_layout({C: 1.3}, reverted=[C, B, F, S]).order == (S,)


def test_what_the_plans_table_and_status_show():
    choice = choose_layout({C: 1.3, F: 2.4})
    assert choice.reason == "fused 2.40x (cse 1.30x)"
    assert choose_layout({C: 1.02, F: 0.64}).reason == "separate: cse 1.02x, fused 0.64x"
    assert choose_layout({C: 1.3, F: 2.4}, reverted=[F]).reason == "cse 1.30x (fused 2.40x reverted)"
    assert describe("cse", {"cse": 1.3, "fused": 2.4}, ["fused"]) == \
        "cse 1.30x (fused 2.40x reverted)"
    assert describe("cse", {}) == "cse (not measured)"


def test_probe_speedups_by_hand():
    # apart: 0.2 + 0.3 + 2 * 0.1 = 0.7; merged: the layout's step + one load
    got = probe_speedups({"a": 0.2, "b": 0.3}, {C: 0.4, F: 0.1}, 0.1)
    assert got == {C: pytest.approx(0.7 / 0.5), F: pytest.approx(0.7 / 0.2)}
    assert probe_speedups({"a": 0.1}, {C: 0.0}, 0.0) == {}  # nothing measured: no ratio
    # a loader that makes a batch in 0.03 s on its own (JPEGs decoded by a DataLoader worker):
    # each of 4 models alone (0.01 s steps) waits for it; the group's 0.04 s step hides it
    alone = {t: 0.01 for t in "abcd"}
    assert probe_speedups(alone, {C: 0.04}, 0.0, produce_s=0.03) == {C: pytest.approx(3.0)}
    assert probe_speedups(alone, {C: 0.04}, 0.0) == {C: pytest.approx(1.0)}  # as it looked


def test_a_segment_judged_with_its_loaders_pace_by_hand():
    from retiarii.optim.cost import merged_speedup

    unit = {"trials": ["a", "b"], "merged": True, "batches": 10, "load_s": 0.1,
            "compute_s": 0.5, "setup_s": 0.0}
    alone = {"a": 0.02, "b": 0.02}
    # apart: 2 x (10 x 0.02 + 0.1) = 0.6 over 0.1 + 0.5
    assert merged_speedup(unit, alone) == pytest.approx(1.0)
    # apart waits 10 x 0.05 s per model for its own loader: 2 x 0.5 = 1.0 over 0.6
    assert merged_speedup({**unit, "produce_s": 0.05}, alone) == pytest.approx(1.0 / 0.6)


def test_a_jobs_loader_starts_count_in_the_estimate_by_hand():
    # 4 models of 0.01 s steps, a 0.05 s group step, no wait for batches: apart 0.04 s per
    # batch looks faster (0.8x) until each job's loader starts count: 0.01 s per batch (say
    # 0.14 s per epoch over 14 batches), paid by each model alone and once by the group:
    # apart 4 x (0.01 + 0.01) = 0.08, merged 0.05 + 0.01 = 0.06
    alone = {t: 0.01 for t in "abcd"}
    assert probe_speedups(alone, {C: 0.05}, 0.0) == {C: pytest.approx(0.8)}
    assert probe_speedups(alone, {C: 0.05}, 0.0, start_s=0.01) == {C: pytest.approx(0.08 / 0.06)}
    # the same over a segment: 10 batches, starts 10 x 0.01 = 0.1 per job
    from retiarii.optim.cost import merged_speedup

    unit = {"trials": ["a", "b"], "merged": True, "batches": 10, "load_s": 0.1,
            "compute_s": 0.5, "setup_s": 0.0, "start_s": 0.01}
    # apart: 2 x (10 x 0.02 + 0.1 + 0.1) = 0.8; merged: 0.1 + 0.5 + 0.1 = 0.7
    assert merged_speedup(unit, {"a": 0.02, "b": 0.02}) == pytest.approx(0.8 / 0.7)


def test_loader_starts_read_with_a_fake_clock():
    from retiarii.engine.worker_side.auto_layout import batches_in, loader_starts

    now = [0.0]

    class Trainer:  # a validation loader whose start and first batch take 0.3 s
        def val_dataloader(self, hparams):
            now[0] += 0.3
            yield "batch"

        def train_dataloader(self, hparams, epoch):
            return [1] * 10

    class Run:
        hparams: dict = {}

    trainer, run = Trainer(), Run()
    assert batches_in(trainer, run) == 10
    # the validation loader 0.3 s; the training loader's start 0.3 - 0.1 (a batch's making)
    assert loader_starts(trainer, run, 10, 0.1, clock=lambda: now[0]) == pytest.approx(0.05)
    assert loader_starts(trainer, run, None, 0.1, clock=lambda: now[0]) == 0.0  # unknown length

    class Broken(Trainer):
        def val_dataloader(self, hparams):
            raise OSError("no validation folder")

    assert loader_starts(Broken(), run, 10, 0.1, clock=lambda: now[0]) == 0.0


# ---- in a search ----------------------------------------------------------------------------


class Measured(o.Recording):
    """Reports each merged unit's segment at ``speedup`` of its models apart (and, fused, of
    them grouped unfused) with a step-time ``spread``, keeping what the worker said of its
    layout; interrupts the driver when a job starts after ``stop_after`` ended. ``speedup``
    may be a list: one per job, in turn."""

    def __init__(self, speedup=2.0, stop_after=None, spread=0.01):
        super().__init__()
        self.speedup, self.stop_after, self.done = speedup, stop_after, 0
        self.spread = spread  # the segments' measured noise (0.01: a quiet machine)
        self.profiled = 0  # grouped jobs reported so far

    def next_event(self, timeout=None):
        event = super().next_event(timeout)
        if isinstance(event, JobProfiled):
            speedup = self.speedup
            if isinstance(speedup, (list, tuple)):
                speedup = speedup[min(self.profiled, len(speedup) - 1)]
            self.profiled += 1
            units = []
            for unit in event.units:
                if unit.merged:
                    n = len(unit.trials)
                    unit = replace(unit, batches=1, load_s=0.0, setup_s=0.0,
                                   compute_s=0.1 * n / speedup, spread=self.spread, step_s=None,
                                   alone_s={t: 0.1 for t in unit.trials})
                units.append(unit)
            return JobProfiled(event.job_id, tuple(units))
        if isinstance(event, (JobFinished, JobFailed)):
            self.done += 1
        if isinstance(event, JobStarted) and self.stop_after is not None \
                and self.done >= self.stop_after:
            raise KeyboardInterrupt
        return event


@pytest.fixture
def probes(monkeypatch):
    """Replaces the worker's measurement of the layouts by ``probes.speedups`` (on copies:
    ``layouts.probe``; on the first batches: ``MeasuringGroup._speedups``); counts calls."""

    class Probes:
        speedups: dict = {}
        calls = 0

    def fake(ids, models, runs, trainer, data_key, candidates, fusable, alone_s):
        Probes.calls += 1
        return {k: v for k, v in Probes.speedups.items() if k in candidates}, {}

    def fake_live(group, batch):
        Probes.calls += 1
        candidates = {S, *group._plans} | ({F} if group._fusable else set())
        return {k: v for k, v in Probes.speedups.items() if k in candidates}

    monkeypatch.setattr(layouts, "probe", fake)
    monkeypatch.setattr(measuring.MeasuringGroup, "_speedups", fake_live)
    return Probes


def _search(tmp_path, name, space, executor, **kw):
    """A search; under optimize="auto" its layouts are chosen by measurement
    (``fuse="measure"``, ``batching="measure"``): what these tests check. The default
    (the device model) is checked in tests/test_reproducible.py."""
    if kw.get("optimize", "auto") == "auto":
        kw.setdefault("fuse", "measure")
        kw.setdefault("batching", "measure")
    db = tmp_path / f"{name}.db"
    exp = rt.Experiment(space, rt.strategies.Random(seed=0), lr_trainer, store=str(db),
                        executor=executor, seed=0, max_models=4, **kw)
    return db, exp


def _units(db):
    return [u for r in o._plans(db) for u in r["units"]]


def test_a_search_of_same_architecture_mlps_ends_up_fused(tmp_path, probes):
    probes.speedups = {F: 2.4, C: 1.2}  # as measured on a CPU (benchmarks/README.md)
    off_db, off = _search(tmp_path, "off", mlp_space, InProcessExecutor(), optimize=False)
    off.run()
    ex = Measured(2.4)
    db, exp = _search(tmp_path, "auto", mlp_space, ex)  # optimize="auto": fuse="auto"
    exp.run()
    grouped = [j for j in ex.submitted if j.meta.get("group")]
    assert grouped and all(j.meta["group"].fuse == "measure" for j in grouped)
    assert probes.calls == 1  # the first job measured; the others were told
    assert "layouts" not in grouped[0].meta
    assert all(j.meta["group"].layouts["cpu"].order[0] == "fused" for j in grouped[1:])
    units = [u for u in _units(db) if u.get("merged")]
    # the first job measures fused first on its real batches (one architecture, nothing
    # frozen shared), fused ahead of CSE's bound: fused on from its first batch, CSE never
    # measured; later jobs fuse
    assert units[0]["layout"] == "fused" and units[0]["choice"]["measured_on"] == "first batches"
    assert units[0]["choice"]["fused_from"] == "batch 0 of this segment"
    assert len(units) > 1 and all(u["fused"] and u["layout"] == "fused" for u in units[1:])
    assert all(u["decision"]["reason"] == "fused 2.40x (cse at most 1.20x)" for u in units)
    summary = exp.summary()["optimization"]
    assert summary["layouts"] == ["cpu: fused 2.40x (cse at most 1.20x)"]
    assert "fusion" in o._plans(db)[0]["passes"]
    f._curves_close(o._curves(db), o._curves(off_db))  # fused: within rel 1e-4


def test_a_real_search_of_one_architecture_measures_fused_first(tmp_path, capsys):
    """Nothing injected: a search over the learning rate of one MLP under
    ``optimize="auto"`` measures fused first on the first job's own models (whatever this
    machine then chooses), ``retiarii status`` shows the choice, and every curve is the
    unoptimized search's within fused tolerance."""
    from retiarii import cli

    off_db, off = _search(tmp_path, "off", mlp_space, InProcessExecutor(), optimize=False)
    off.run()
    db, exp = _search(tmp_path, "auto", mlp_space, InProcessExecutor())
    exp.run()
    units = [u for u in _units(db) if u.get("merged")]
    first = units[0]["choice"]
    assert first["measured_on"] == "first batches" and "fused" in first["steps_s"]
    assert cli.main(["status", str(db)]) == 0  # the choice in force (a revert may move it)
    reason = units[-1]["decision"]["reason"]
    assert f"layout chosen on first batches, cpu: {reason}" in capsys.readouterr().out
    f._curves_close(o._curves(db), o._curves(off_db))


def test_small_cnns_measured_slower_fused_do_not_fuse(tmp_path, probes):
    probes.speedups = {F: 0.64, C: 1.3}
    off_db, off = _search(tmp_path, "off", cnn_space, InProcessExecutor(), optimize=False)
    off.run()
    ex = Measured(1.3)
    db, exp = _search(tmp_path, "auto", cnn_space, ex)
    exp.run()
    units = _units(db)
    assert units and not any(u.get("fused") for u in units)
    assert all(u["layout"] == "cse" and u["decision"]["order"][0] == "cse" for u in units)
    assert exp.summary()["optimization"]["layouts"] == ["cpu: cse 1.30x (fused 0.64x)"]
    assert probes.calls == 2  # fused measured first (CSE's bound ranked first), then CSE
    # the first job's first batches trained fused (measured on the models): within fused
    # tolerance; every later batch CSE-grouped
    f._curves_close(o._curves(db), o._curves(off_db))


def test_measured_faster_apart_trains_them_apart(tmp_path, probes):
    probes.speedups = {F: 0.64, C: 1.02}
    ex = Measured()
    db, exp = _search(tmp_path, "apart", cnn_space, ex)
    exp.run()
    rows = o._plans(db)
    # the first job trained fused while it measured (one architecture: fused first; CSE's
    # bound under the margin: not measured), then jobs of one
    assert [r["status"] for r in rows] == ["merged"]
    reason = "separate: fused 0.64x, cse at most 1.02x"
    assert rows[0]["units"][0]["decision"]["reason"] == reason
    assert all(len(j.tasks) == 1 for j in ex.submitted[1:])
    assert exp.summary()["optimization"]["layouts"] == [f"cpu: {reason}"]


def test_a_layout_measured_slower_over_a_segment_is_reverted(tmp_path, probes):
    probes.speedups = {F: 1.2, C: 2.4}
    ex = Measured(0.5)  # the segment: 0.5x of apart, beyond any noise
    db, exp = _search(tmp_path, "rev", mlp_space, ex)
    exp.run()
    first = _units(db)[0]
    assert first["layout"] == "cse" and first["decision"]["reverted"] == ["cse"]
    assert first["decision"]["order"][0] == "fused" and "beyond the noise" in first["verdict"]
    later = [j for j in ex.submitted[1:] if j.meta.get("group")]
    assert all(j.meta["group"].layouts["cpu"].order[0] == "fused" for j in later)
    assert probes.calls == 2  # fused first, then CSE (its bound ranked first): one job


def test_a_resumed_search_reuses_the_choices_without_measuring(tmp_path, probes):
    probes.speedups = {F: 2.4, C: 1.2}
    ex = Measured(2.4, stop_after=1)

    def exp():
        return _search(tmp_path, "resume", mlp_space, ex)

    db, first = exp()
    with pytest.raises(KeyboardInterrupt):
        first.run()
    assert probes.calls == 1
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        (key, devices), = PlanTable(store).layout_decisions().items()
    assert devices["cpu"].order[0] == "fused"
    ex.submitted.clear()
    ex.stop_after, ex.done = None, 0
    _, again = exp()
    again.resume()
    grouped = [j for j in ex.submitted if j.meta.get("group")]
    assert grouped and all(j.meta["group"].layouts["cpu"].order[0] == "fused" for j in grouped)
    assert probes.calls == 1  # not measured again
    assert all(u.get("fused") for u in _units(db)[1:] if u.get("merged"))  # after the first


# ---- in the worker --------------------------------------------------------------------------


def test_the_probe_measures_each_layout_and_changes_nothing_trained(tmp_path, monkeypatch):
    """A real measurement (copies of three same-architecture trials and one other, dropout in
    their streams): every candidate gets a speed-up, and with CSE applied whatever it measured,
    every metric and checkpoint equals a job that measured nothing, bit for bit."""
    import test_grouped_jobs as g
    from retiarii.engine.jobs.job import Job

    real = layouts.choose_layout
    monkeypatch.setattr(layouts, "choose_layout", lambda speedups: real(
        {**speedups, C: 99.0}))  # CSE, whatever was measured (on copies or first batches)
    monkeypatch.setattr(measuring, "choose_layout", layouts.choose_layout)
    monkeypatch.setattr(layouts, "ABORT", float("inf"))  # every layout timed, however slow
    monkeypatch.setattr(layouts, "ABORT_CPU", float("inf"))
    monkeypatch.setattr(speedups, "PER_MODEL_BOUND", 0.0)  # fusion measured, even for these
    probed = [f._task(t, tmp_path, tag="p-") for t in "adeb"]
    meta = {"group": GroupOrder(fuse="measure", passes={"batching": "measure"}, profile=tuple("adeb"))}
    events = g._run(Job("p", probed, meta=meta))
    assert isinstance(events[-1], JobFinished), events[-1]
    plain = [f._task(t, tmp_path, tag="c-") for t in "adeb"]
    reference = g._run(Job("c", plain, meta={"group": True}))
    assert g._same(g._results(events), g._results(reference))
    for a, b in zip(probed, plain):
        assert g._same_checkpoint(a.checkpoint_out, b.checkpoint_out), a.trial_id
    unit, = [u.to_json() for u in next(e for e in events if isinstance(e, JobProfiled)).units]
    assert unit["layout"] == "cse" and unit["choice"]["probed"] and unit["choice"]["device"] == "cpu"
    measured = unit["choice"]["speedups"]
    assert set(measured) >= {"separate", "fused"} and all(v > 0 for v in measured.values())
    assert set(unit["alone_s"]) == set("adeb")  # measured by the probe, not again


def test_a_given_choice_is_applied_without_measuring(tmp_path, monkeypatch):
    import test_grouped_jobs as g
    from retiarii.engine.jobs.job import Job

    monkeypatch.setattr(layouts, "probe", lambda *a: pytest.fail("measured again"))
    tasks = [f._task(t, tmp_path) for t in "adeb"]
    chosen = {"cpu": HeldLayout(order=("separate", "cse", "fused"), speedups={"fused": 0.6})}
    events = g._run(Job("s", tasks, meta={"group": GroupOrder(fuse="measure", profile=(),
                                                              layouts=chosen)}))
    assert isinstance(events[-1], JobFinished), events[-1]
    units = [u.to_json() for u in next(e for e in events if isinstance(e, JobProfiled)).units]
    assert [u["layout"] for u in units] == ["separate"] * 4 and not any(u["merged"] for u in units)
    assert g._same(g._results(events), g._alone([f._task(t, tmp_path, tag="s-") for t in "adeb"]))


@pytest.mark.slow
def test_the_auto_benchmark_runs_quick():
    """``benchmarks/auto.py --quick`` (about two minutes on a loaded 2-core CPU: slow)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "auto.py"), "--quick",
                          "--workload", "mlp"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "auto / best" in out.stdout and "metrics vs separate" in out.stdout
    # the MLPs of one architecture fuse by the device model's prediction, and the line says so
    assert "device model: fused" in out.stdout, out.stdout


def test_the_auto_benchmark_names_the_device_models_choice():
    """A unit the device model decided is never measured: the benchmark's line names the
    model's choice and prediction, not "not measured (cse)" (session 4 read a fused run as
    CSE from that label)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "benchmarks"))
    import auto

    device = {"units": [{"choice": {"device_chosen": ["fused"], "predicted": [
        "8 models: predicted 1.92x fused, fused"]}}]}
    measured = {"units": [{"choice": {}, "decision": {"reason": "fused 1.66x (cse 1.14x)"}}]}
    assert auto._chosen([device]) == "device model: fused (8 models: predicted 1.92x fused, fused)"
    assert auto._chosen([device, measured]) == "fused 1.66x (cse 1.14x)"
    assert auto._chosen([{"units": [{"choice": {}}]}]) == "not measured (cse)"


def test_one_alone_profile_per_architecture(tmp_path, monkeypatch):
    """Three trials of one architecture and one of another: two alone profiles, and every
    trial gets its architecture's time; a later job told the times per architecture (as the
    runner tells it) profiles none."""
    import test_grouped_jobs as g
    from retiarii.engine.worker_side import training_group as grouped
    from retiarii.engine.jobs.job import Job

    calls = []
    real = grouped.step_seconds
    monkeypatch.setattr(grouped, "step_seconds", lambda trainer, run, batch: (
        calls.append(run), real(trainer, run, batch))[1])
    tasks = [f._task(t, tmp_path) for t in "adeb"]
    events = g._run(Job("p", tasks, meta={"group": GroupOrder(profile=tuple("adeb"))}))
    unit, = [u.to_json() for u in next(e for e in events if isinstance(e, JobProfiled)).units]
    assert len(calls) == 2 and set(unit["alone_s"]) == set("adeb")
    assert unit["alone_s"]["a"] == unit["alone_s"]["d"] == unit["alone_s"]["e"]
    assert len(unit["alone_by_arch"]) == 2
    calls.clear()
    again = [f._task(t, tmp_path, tag="2-") for t in "adeb"]
    meta = {"group": GroupOrder(profile=tuple("adeb"), alone_by_arch={"cpu": unit["alone_by_arch"]})}
    profiled = next(e for e in g._run(Job("q", again, meta=meta)) if isinstance(e, JobProfiled))
    unit, = [u.to_json() for u in profiled.units]
    assert not calls and set(unit["alone_s"]) == set("adeb")


def test_fuse_and_batching_follow_optimize_unless_given():
    from exp_space import space

    def exp(**kw):
        return rt.Experiment(space, rt.strategies.Random(), rt.Trainer(dataset="digits"), **kw)

    assert (exp().fuse, exp().batching) == ("auto", "auto")
    assert (exp(optimize=True).fuse, exp(optimize=True).batching) == (False, False)
    assert (exp(fuse=True, batching=False).fuse, exp(batching=True).batching) == (True, True)
    with pytest.raises(rt.ExperimentError, match="batching=2"):
        exp(batching=2)


def test_status_prints_the_layout_of_each_group_key():
    from retiarii.cli import optimization_line

    text = optimization_line({"jobs": {"merged": 3}, "merged_trials": 8,
                               "layouts": ["cpu: fused 2.40x (cse 1.30x)",
                                           "cpu: separate: cse 1.02x, fused 0.64x"]})
    assert "\n  layout chosen on first batches, cpu: fused 2.40x (cse 1.30x)" in text
    assert "\n  layout chosen on first batches, cpu: separate: cse 1.02x, fused 0.64x" in text


def test_status_gives_one_figure_per_run_with_what_was_shared_and_the_time_saved():
    """#28: one speed-up figure (whole segments), the time it saved, what was shared, and a
    job kept while slower said so (it used to read "0.156x" yet "merged" with no word)."""
    from retiarii.cli import optimization_line

    rows = [{"status": "merged", "speedup": 2.0, "seconds": 3.0, "trials": ["a", "b"],
             "alone": [], "reason": "", "packing": None,
             "units": [{"merged": True, "trials": ["a", "b"], "shared_nodes": 9}]},
            {"status": "merged", "speedup": 0.5, "seconds": 2.0, "trials": ["c", "d"],
             "alone": [], "reason": "", "packing": None,
             "units": [{"merged": True, "trials": ["c", "d"], "shared_nodes": 7}]}]
    table = PlanTable.__new__(PlanTable)
    table.records = lambda: [PlanRecord.from_json(r) for r in rows]  # through the codec
    table.fused_trials = lambda: set()  # no store: no trial marked fused by its checkpoint
    summary = table.summary()
    assert summary["saved_s"] == 3.0 * 1.0 + 2.0 * -0.5  # apart = speed-up x seconds
    assert summary["slower_kept"] == 1 and summary["shared"] == {"nodes": 8, "models": 2}
    text = optimization_line(summary)
    assert "ran at 1.25x the speed of their models apart (median of 2 jobs, 0.5x-2.0x)" in text
    assert "saving 2.0 s" in text and "1 of them slower than apart, kept until" in text
    assert "computed 8 nodes once for 2 models" in text


def test_a_layout_whose_warm_up_is_far_too_slow_is_not_timed(tmp_path, monkeypatch):
    import test_grouped_jobs as g
    from retiarii.engine.jobs.job import Job

    monkeypatch.setattr(layouts, "ABORT", 0.0)  # every warm-up is "far too slow"
    monkeypatch.setattr(layouts, "ABORT_CPU", 0.0)
    tasks = [f._task(t, tmp_path) for t in "adeb"]
    events = g._run(Job("p", tasks, meta={"group": GroupOrder(fuse="measure", profile=tuple("adeb"))}))
    assert isinstance(events[-1], JobFinished), events[-1]
    unit, = [u.to_json() for u in next(e for e in events if isinstance(e, JobProfiled)).units]
    # fused is not timed; CSE is, on the real batches (no copy to abort); the rest of the
    # segment trains in whichever of CSE and apart measured faster
    assert set(unit["choice"]["speedups"]) == {"separate", "cse"}
    assert unit["layout"] == unit["choice"]["order"][0]
