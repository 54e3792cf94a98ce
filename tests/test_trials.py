"""The trial lifecycle and the TrialRunner: transitions, reclaim-and-relaunch, pause/resume,
retries, journaling before effect, resume after a driver crash, and the seed chapter's
40-trial experiment in the simulator."""
from __future__ import annotations

import collections
import random

import pytest

from retiarii.engine.jobs.job import (
    Executor, FailureKind, JobFailed, JobFinished, JobStarted, TrialCheckpointed, TrialResult,
)
from retiarii.engine.executors.simulated import SimulatedExecutor
from retiarii.engine.runner.trial_runner import (
    IllegalTransition, MemoryJournal, Trial, TrialRunner, TrialState,
)
from retiarii.strategies import ASHA, Hyperband, HyperTrick, MedianStopping, Scheduler
from retiarii.strategies.schedulers.base import Decision

from engine_helpers import Crash, CrashingJournal

R, P, T, E, Q = (TrialState.RUNNING, TrialState.PAUSED, TrialState.TERMINATED,
                 TrialState.ERRORED, TrialState.PENDING)


def curve(spec, step):
    return {"loss": spec["a"] / step + spec.get("b", 0.0)}


class Scripted(Scheduler):
    """Returns decisions from a script {(trial, step): decision}; records every call."""

    def __init__(self, script=None):
        self.script, self.calls = dict(script or {}), []

    def on_trial_add(self, trial_id, config):
        self.calls.append(("add", trial_id))

    def on_trial_result(self, trial_id, result):
        self.calls.append(("result", trial_id, result["training_iteration"], result.get("loss")))
        return self.script.get((trial_id, result["training_iteration"]), Decision.CONTINUE)

    def on_trial_complete(self, trial_id, result):
        self.calls.append(("complete", trial_id))

    def on_trial_error(self, trial_id):
        self.calls.append(("error", trial_id))


def make(n, sched, workers=2, **kw):
    ex = SimulatedExecutor(workers, curve, step_time=kw.pop("step_time", 1.0),
                           failures=kw.pop("failures", None), speeds=kw.pop("speeds", None))
    runner = TrialRunner(ex, sched, kw.pop("journal", None), **kw)
    for i in range(n):
        runner.add_trial({"a": 1.0 + i}, trial_id=f"t{i}")
    return ex, runner


# ---- lifecycle -----------------------------------------------------------------------------


def test_transitions_allowed_and_refused():
    t = Trial("x", {})
    for new in (R, P, R, E, Q, R, T):
        t.move(new)
    with pytest.raises(IllegalTransition, match="'x' cannot go from TERMINATED to RUNNING"):
        t.move(R)
    for old, new in [(Q, P), (P, E), (Q, E), (E, R)]:
        with pytest.raises(IllegalTransition):
            Trial("y", {}, state=old).move(new)


# ---- the runner ----------------------------------------------------------------------------


def test_fifo_keeps_every_slot_busy():
    ex, runner = make(5, Scheduler(), workers=2, max_steps=3)
    assert runner.run()
    assert all(t.state is T and t.step == 3 for t in runner.trials.values())
    assert runner.steps_trained == 15 and ex.now() == 9.0  # ceil(5 * 3 / 2) steps of 1 s
    assert ex.busy_time == [9.0, 6.0]  # worker 0 never idles, worker 1 idles only at the end


def test_stop_and_pause_hand_the_worker_over_in_the_same_step():
    script = {("t0", 1): Decision.STOP, ("t1", 2): Decision.PAUSE}
    ex, runner = make(4, Scripted(script), workers=2, max_steps=3)
    assert runner.run()
    starts = {}
    for entry in runner.timeline:
        starts.setdefault(entry["trial_id"], entry["start"])
    assert starts["t2"] == 1.0  # t0 stopped at t=1 -> t2 on its worker at t=1
    assert starts["t3"] == 2.0  # t1 paused at t=2 -> t3 at once
    t1 = runner.trials["t1"]
    assert t1.state is T and t1.step == 3  # resumed after the pending trials, FIFO
    assert runner.trials["t0"].step == 1
    assert ex.busy_time == [sum(ex.busy_time) - ex.busy_time[1], ex.busy_time[1]]
    assert sum(ex.busy_time) == runner.steps_trained == 1 + 3 + 3 + 3


def test_paused_and_resumed_trial_follows_the_uninterrupted_trajectory():
    def model(spec, step, state):
        w = (state or 1.0) * spec["decay"]  # weights carried by the checkpoint
        return {"loss": w}, w

    def run(script):
        sched = Scripted(script)
        ex = SimulatedExecutor(1, model=model)
        runner = TrialRunner(ex, sched, max_steps=5)
        runner.add_trial({"decay": 0.5}, trial_id="a")
        runner.add_trial({"decay": 0.9}, trial_id="b")
        runner.run()
        return {t: [c[2:] for c in sched.calls if c[:2] == ("result", t)] for t in "ab"}, sched

    plain, _ = run({})
    paused, sched = run({("a", 2): Decision.PAUSE, ("b", 1): Decision.PAUSE})
    assert paused == plain
    a_steps = [c[2] for c in sched.calls if c[:2] == ("result", "a")]
    assert a_steps == [1, 2, 3, 4, 5]  # every step reported once


def test_mid_segment_stop_cancels_and_mid_segment_pause_rolls_back():
    script = {("t0", 2): Decision.STOP, ("t1", 4): Decision.PAUSE}
    ex, runner = make(2, Scripted(script), workers=2, segment=3, max_steps=6)
    assert runner.run()
    t0, t1 = runner.trials["t0"], runner.trials["t1"]
    assert t0.state is T and t0.step == 2
    (t0_job,) = [h for h in ex.history if h["tasks"][0]["trial_id"] == "t0"]
    assert t0_job["cancelled"] and t0_job["end"] == 2.0  # step 3 was never trained
    # t1 paused at step 4 of the segment 3..6: it resumes from its step-3 checkpoint, redoes
    # step 4 without reporting it again, then continues to 6
    assert t1.state is T and t1.step == 6 and sorted(t1.checkpoints) == [3, 6]
    tasks = [(h["tasks"][0]["start_step"], h["tasks"][0]["stop_step"]) for h in ex.history
             if h["tasks"][0]["trial_id"] == "t1"]
    assert tasks == [(0, 3), (3, 6), (3, 6)]
    results = [c for c in runner.scheduler.calls if c[:2] == ("result", "t1")]
    assert [c[2] for c in results] == [1, 2, 3, 4, 5, 6]
    assert runner.steps_trained == 2 + 6 + 1


def test_environment_failures_are_retried_then_stop_the_run_resumably():
    def failures(task, step, attempt):
        if task.trial_id == "t0" and step == 2 and attempt < 2:
            return ("disk hiccup", False, FailureKind.ENVIRONMENT)
        if task.trial_id == "t1" and step == 1 and broken:
            return ("worker died", True)
        return None

    broken = True
    journal = MemoryJournal()
    sched = Scripted()
    ex, runner = make(3, sched, workers=1, max_steps=3, failures=failures, max_failures=2,
                      journal=journal)
    assert not runner.run()  # stopped: t1's worker keeps dying
    t0, t1, t2 = runner.trials["t0"], runner.trials["t1"], runner.trials["t2"]
    assert t0.state is T and t0.step == 3 and t0.attempts == 2
    starts = [h["tasks"][0]["start_step"] for h in ex.history if h["tasks"][0]["trial_id"] == "t0"]
    assert starts == [0, 1, 1, 1, 2]  # each retry restarts at the step-1 checkpoint
    assert t1.state is E and t1.attempts == 3 and "worker died" in t1.error
    assert "t1" in runner.stop_reason and "worker died" in runner.stop_reason
    assert t2.state is Q  # never started, not terminated: the run is resumable
    assert ("error", "t1") not in sched.calls  # not failed for good
    reasons = [p["reason"] for k, p in journal.records()
               if k == "transition" and p["trial_id"] == "t1"]
    assert reasons[-1].startswith("worker lost")
    # the environment is fixed: resume retries t1 and runs t2
    broken = False
    ex2 = SimulatedExecutor(1, curve, failures=failures, checkpoints=ex.checkpoints)
    resumed = TrialRunner.resume(ex2, Scripted(), journal, max_steps=3, max_failures=2)
    assert resumed.run()
    assert {t: tr.state for t, tr in resumed.trials.items()} == {"t0": T, "t1": T, "t2": T}


def test_environment_failures_count_in_a_row_only():
    def failures(task, step, attempt):  # one hiccup in each of steps 2, 3 and 4
        if step in (2, 3, 4) and task.start_step == step - 1 and not seen.get(step):
            seen[step] = True
            return ("out of memory", False, FailureKind.ENVIRONMENT)
        return None

    seen = {}
    ex, runner = make(1, Scripted(), workers=1, max_steps=5, failures=failures, max_failures=1)
    assert runner.run() and runner.stop_reason is None  # progress in between resets the count
    assert runner.trials["t0"].state is T and runner.trials["t0"].attempts == 3


def test_a_model_failure_fails_at_once_unless_retries_are_asked():
    def failures(task, step, attempt):
        return "loss is nan" if task.trial_id == "t0" and step == 2 and attempt < 1 else None

    sched = Scripted()
    ex, runner = make(2, sched, workers=1, max_steps=3, failures=failures, max_failures=5)
    assert runner.run()
    t0 = runner.trials["t0"]
    assert t0.state is E and t0.attempts == 1 and ("error", "t0") in sched.calls
    assert runner.trials["t1"].state is T
    ex, runner = make(2, Scripted(), workers=1, max_steps=3, failures=failures, model_retries=1)
    assert runner.run()
    assert runner.trials["t0"].state is T and runner.trials["t0"].attempts == 1


class OrderChecking(MemoryJournal):
    """Asserts that each transition is journaled while the trial still has its old state."""

    def __init__(self):
        super().__init__()
        self.runner = None

    def transition(self, trial_id, old, new, reason):
        assert self.runner.trials[trial_id].state is old, (trial_id, old, new)
        super().transition(trial_id, old, new, reason)


def test_journal_is_written_before_each_transition():
    journal = OrderChecking()
    ex = SimulatedExecutor(2, curve)
    runner = TrialRunner(ex, ASHA("loss", "min", 1, 4, 2, promotion=True), journal, max_steps=4)
    journal.runner = runner
    for i in range(6):
        runner.add_trial({"a": 1.0 + (i * 7) % 5}, trial_id=f"t{i}")
    runner.run()
    kinds = collections.Counter(k for k, _ in journal.records())
    assert kinds["trial_added"] == 6 and kinds["transition"] > 12 and kinds["checkpoint"] > 6
    states = collections.defaultdict(list)
    for k, p in journal.records():
        if k == "transition":
            states[p["trial_id"]].append((p["old"], p["new"]))
    for trial_id, moves in states.items():  # the journal alone retells every life
        assert moves[0][0] == "PENDING"
        assert all(a[1] == b[0] for a, b in zip(moves, moves[1:]))
        assert moves[-1][1] == runner.trials[trial_id].state.value


def test_budget_pauses_running_trials_and_a_second_run_continues():
    ex, runner = make(3, Scheduler(), workers=2, max_steps=4, max_total_steps=5)
    assert runner.run()
    assert runner.steps_trained == 6  # the last two segments in flight finish
    assert [t.state for t in runner.trials.values()] == [P, P, Q]
    runner.max_total_steps = None
    assert runner.run()
    assert all(t.state is T and t.step == 4 for t in runner.trials.values())


def test_bad_scheduler_answers_are_named():
    class Chooser(Scheduler):
        def choose_trial_to_run(self, candidates):
            return "ghost"

    class Stringly(Scheduler):
        def on_trial_result(self, trial_id, result):
            return "STOP"

    with pytest.raises(ValueError, match="Chooser.choose_trial_to_run returned 'ghost'"):
        make(1, Chooser(), max_steps=1)[1].run()
    with pytest.raises(TypeError, match="Stringly.on_trial_result returned 'STOP'"):
        make(1, Stringly(), max_steps=1)[1].run()


class InlineExecutor(Executor):
    """A minimal synchronous executor, to show the runner relies on the interface only."""

    num_slots = 1

    def __init__(self):
        self.events, self.clock = [], 0.0  # (time, event), in order

    def submit(self, job):
        t = self.events[-1][0] if self.events else self.clock
        self.events.append((t, JobStarted(job.job_id, "inline")))
        for task in job.tasks:
            for step in range(task.start_step + 1, task.stop_step + 1):
                t += 1
                self.events.append((t, TrialResult(job.job_id, task.trial_id, step,
                                                   curve(task.spec, step), t)))
            self.events.append((t, TrialCheckpointed(job.job_id, task.trial_id,
                                                     task.stop_step, task.checkpoint_out)))
        self.events.append((t, JobFinished(job.job_id)))

    def next_event(self, timeout=None):
        if not self.events:
            return None
        self.clock, event = self.events.pop(0)
        return event

    def cancel(self, job_id):
        self.events = [(t, e) for t, e in self.events if e.job_id != job_id]
        self.events.append((self.clock, JobFailed(job_id, None, "cancelled")))

    def now(self):
        return self.clock


def test_runner_drives_any_executor():
    runner = TrialRunner(InlineExecutor(), MedianStopping("loss", "min", 1, 1), max_steps=3)
    runner.add_trial({"a": 1.0}, trial_id="good")
    runner.add_trial({"a": 5.0}, trial_id="bad")
    runner.run()
    assert runner.trials["good"].step == 3 and runner.trials["bad"].step == 1
    assert runner.trials["bad"].last_result["time_total_s"] == 1.0


# ---- resume after the driver dies ----------------------------------------------------------


def _outcome(runner):
    return {t: (tr.state.name, tr.step, round(tr.last_result["loss"], 9))
            for t, tr in runner.trials.items()}


@pytest.mark.parametrize("make_sched", [
    lambda: ASHA("loss", "min", 1, 8, 2),
    lambda: ASHA("loss", "min", 1, 8, 2, promotion=True),
    lambda: Hyperband("loss", "min", max_t=8, reduction_factor=2),
    lambda: MedianStopping("loss", "min", 2, 2, hard_stop=False),
    lambda: HyperTrick("loss", "min", num_workers=10, num_phases=4, eviction_rate=0.3,
                       phase_length=2),
])
def test_kill_driver_and_resume_gives_the_uninterrupted_outcome(make_sched):
    configs = [{"a": 1.0 + (i * 7) % 10 / 3, "b": (i * 3) % 4 / 10} for i in range(10)]

    def fresh(journal, checkpoints=None):
        ex = SimulatedExecutor(1, curve, checkpoints=checkpoints)
        return ex, TrialRunner(ex, make_sched(), journal, max_steps=8)

    ex, full = fresh(None)
    for i, c in enumerate(configs):
        full.add_trial(c, trial_id=f"t{i}")
    full.run()
    expected = _outcome(full)
    for kill_after in (3, 17, 40, 77):
        journal = MemoryJournal()
        ex, runner = fresh(journal)
        for i, c in enumerate(configs):
            runner.add_trial(c, trial_id=f"t{i}")
        if runner.run(max_events=kill_after):
            continue  # finished before the kill
        ex2 = SimulatedExecutor(1, curve, checkpoints=ex.checkpoints)  # the disk survives
        resumed = TrialRunner.resume(ex2, make_sched(), journal, max_steps=8)
        assert resumed.run()
        assert _outcome(resumed) == expected, kill_after




@pytest.mark.parametrize("make_sched", [
    lambda: ASHA("loss", "min", 1, 8, 2, promotion=True),
    lambda: Hyperband("loss", "min", max_t=8, reduction_factor=2),
], ids=["asha-promotion", "hyperband"])
def test_crash_inside_a_handler_and_resume(make_sched):
    configs = [{"a": 1.0 + (i * 7) % 10 / 3, "b": (i * 3) % 4 / 10} for i in range(8)]

    def start(journal):
        ex = SimulatedExecutor(1, curve)
        runner = TrialRunner(ex, make_sched(), journal, max_steps=8)
        for i, c in enumerate(configs):
            runner.add_trial(c, trial_id=f"t{i}")
        return ex, runner

    probe = CrashingJournal()
    _, full = start(probe)
    full.run()
    for crash_at in range(len(configs) * 2 + 1, probe.writes, 4):  # after the trials exist
        journal = CrashingJournal(crash_at)
        ex, runner = start(journal)
        with pytest.raises(Crash):
            runner.run()
        journal.crash_at = None
        ex2 = SimulatedExecutor(1, curve, checkpoints=ex.checkpoints)
        resumed = TrialRunner.resume(ex2, make_sched(), journal, max_steps=8)
        assert resumed.run()
        assert _outcome(resumed) == _outcome(full), crash_at


# ---- the seed chapter's experiment -----------------------------------------------------------


def chapter_trials():
    """The chapter's 40 trials: random.seed(7), floor ~ U(0.15, 0.95), noise ~ U(0, 0.05)."""
    rng = random.Random(7)
    out = []
    for t in range(40):
        floor = rng.uniform(0.15, 0.95)
        out.append({"id": t, "floor": floor, "noise": rng.uniform(0.0, 0.05)})
    return out


def chapter_loss(spec, rung):
    """Falls from 1.2 toward the hidden floor over 6 rungs; noise drawn per (trial, rung)."""
    noise = random.Random(f"{spec['id']}/{rung}").uniform(-spec["noise"], spec["noise"])
    return {"loss": spec["floor"] + (1.2 - spec["floor"]) * (1 - rung / 6) ** 1.6 + noise}


def run_chapter(sched):
    ex = SimulatedExecutor(4, chapter_loss, step_time=5.0)  # 4 workers, 5 epochs per rung
    runner = TrialRunner(ex, sched, max_steps=6)
    for spec in chapter_trials():
        runner.add_trial(spec, trial_id=f"#{spec['id']}")
    runner.run()
    done = [t for t in runner.trials.values() if t.step == 6]
    best = min(done, key=lambda t: t.last_result["loss"])
    return {"epochs": 5 * runner.steps_trained, "wall": ex.now(), "best": best.trial_id,
            "completed": len(done)}


@pytest.mark.parametrize("sched", [
    MedianStopping("loss", "min", grace_period=2, min_samples_required=3),
    ASHA("loss", "min", grace_period=2, max_t=6, reduction_factor=3),
    ASHA("loss", "min", grace_period=2, max_t=6, reduction_factor=2, promotion=True),
], ids=["median", "asha", "asha-promotion"])
def test_seed_chapter_experiment_reclaims_compute_and_keeps_the_winner(sched):
    base = run_chapter(Scheduler())
    assert base == {"epochs": 1200, "wall": 300.0, "best": "#39", "completed": 40}
    ours = run_chapter(sched)
    assert ours["best"] == base["best"]  # the chapter's winner, trial #39
    assert 1 - ours["epochs"] / base["epochs"] >= 0.35
    assert ours["wall"] < base["wall"]


def test_the_timeline_keeps_the_latest_jobs_only(monkeypatch):
    """The driver's memory does not grow with every job of a long search: the timeline keeps
    the latest TIMELINE_JOBS finished jobs (the torture suite's long run found 0.5 KiB kept per
    job before)."""
    import retiarii.engine.runner.trial_runner as trials_module

    monkeypatch.setattr(trials_module, "TIMELINE_JOBS", 4)
    ex, runner = make(5, Scheduler(), workers=2, max_steps=3)
    assert runner.run()
    assert len(runner.timeline) == 4  # of 15 jobs, the last four
    ends = [e["end"] for e in runner.timeline]
    assert ends == sorted(ends) and ends[-1] == ex.now()
