"""PBT as a black-box service: mutation, tournaments, budget mode, exploit = exact donor
checkpoint + mutated config, lineage replay, garbage collection, crash and resume."""
from __future__ import annotations

import json
import math
import random

import pytest

from retiarii.engine.executors.simulated import SimulatedExecutor
from retiarii.engine.runner.trial_runner import MemoryJournal, TrialRunner, TrialState
from retiarii.engine.jobs.job import Job, TrialResult, TrialTask
from retiarii.strategies import PBT, Categorical, Continuous, Discrete, Integer

from engine_helpers import Crash, CrashingJournal


def res(t, value, metric="loss"):
    return {"training_iteration": t, metric: value}


SPACE = {"lr": Continuous(1e-4, 1.0, log=True), "layers": Integer(1, 8),
         "momentum": Discrete((0.0, 0.5, 0.9, 0.99)), "opt": Categorical(("sgd", "adam")),
         "wd": Continuous(0.0, 0.1, mutable=False), "batch": 32}


def model(spec, step, state):
    """Training whose best learning rate drifts down over time; the state is carried by
    checkpoints, so a child really continues its donor's training."""
    w = 0.0 if state is None else state
    target = -1.0 - step / 4.0
    w += math.exp(-(math.log10(spec["lr"]) - target) ** 2) * (1 + 0.01 * spec["layers"])
    return {"loss": 1.0 / (1.0 + w)}, w


def make_pbt(**kw):
    args = dict(metric="loss", mode="min", space=SPACE, population_size=4, steps_per_trial=2,
                max_generations=5, seed=11)
    args.update(kw)
    return PBT(**args)


def run_pbt(workers=2, journal=None, pbt=None, speeds=None, **kw):
    ex = SimulatedExecutor(workers, model=model, speeds=speeds)
    runner = TrialRunner(ex, pbt or make_pbt(**kw), journal)
    runner.run()
    return ex, runner


# ---- mutation ------------------------------------------------------------------------------


def test_mutation_rules():
    rng = random.Random(0)
    c = Continuous(0.01, 1.0)
    assert {round(c.mutate(0.5, rng), 9) for _ in range(50)} == {0.4, 0.6}
    assert {round(c.mutate(1.0, rng), 9) for _ in range(50)} == {0.8, 1.0}  # clipped
    assert all(1e-4 <= Continuous(1e-4, 1.0, log=True).sample(rng) <= 1.0 for _ in range(50))
    i = Integer(1, 10)
    assert {i.mutate(5, rng) for _ in range(50)} == {4, 6}
    assert {i.mutate(1, rng) for _ in range(50)} == {1, 2}  # 1*0.8 rounds to 1: moves to 0, clips
    d = Discrete((1, 2, 4, 8))
    assert {d.mutate(4, rng) for _ in range(50)} == {2, 8}
    assert {d.mutate(1, rng) for _ in range(20)} == {2}
    assert {d.mutate(8, rng) for _ in range(20)} == {4}
    assert {Categorical(("a", "b", "c")).mutate("a", rng) for _ in range(50)} == {"a", "b", "c"}
    pbt = make_pbt()
    cfg = pbt.sample_config()
    assert cfg["batch"] == 32 and set(cfg) == set(SPACE)
    for _ in range(20):
        child = pbt._mutate(cfg)
        assert child["wd"] == cfg["wd"] and child["batch"] == 32  # immutable and constant kept
        assert child["lr"] / cfg["lr"] in (pytest.approx(0.8), pytest.approx(1.2)) or \
            child["lr"] in (1e-4, 1.0)


# ---- reproduction --------------------------------------------------------------------------


def test_generation_zero_then_tournaments_hand_computed():
    pbt = PBT("acc", "max", {"lr": Continuous(0.1, 1.0)}, population_size=3, steps_per_trial=2,
              max_generations=2, seed=0)
    a, b, c = (pbt.next_spawn() for _ in range(3))
    assert a.parent is None and pbt.next_spawn() is None  # gen 0 full, nobody finished
    assert pbt.on_trial_result(a.trial_id, res(1, 0.1, "acc")).name == "CONTINUE"
    for s, v in [(a, 0.9), (b, 0.5), (c, 0.9)]:
        assert pbt.on_trial_result(s.trial_id, res(2, v, "acc")).name == "STOP"
    children = [pbt.next_spawn() for _ in range(3)]
    assert pbt.next_spawn() is None  # each trial initiates once; gen 2 is beyond max
    ids = {s.trial_id: s for s in (a, b, c)}
    for child, initiator in zip(children, (a, b, c)):
        assert pbt._trials[child.trial_id]["initiator"] == initiator.trial_id
        assert child.parent_step == 2 and pbt._trials[child.trial_id]["gen"] == 1
        # the initiator keeps its place on a tie; b (0.5) loses to either opponent
        if initiator is b:
            assert child.parent in (a.trial_id, c.trial_id)
        else:
            assert child.parent == initiator.trial_id
        parent_lr = ids[child.parent].config["lr"]
        assert child.config["lr"] == pytest.approx(min(1.0, parent_lr * 0.8)) or \
            child.config["lr"] == pytest.approx(min(1.0, parent_lr * 1.2))


def test_opponents_come_from_the_past_k_generations_only():
    pbt = PBT("acc", "max", {"lr": Continuous(0.1, 1.0)}, population_size=4, steps_per_trial=1,
              opponent_generations=2, seed=5)
    step = {}
    for n in range(60):  # run generations; gen-0 trial 'pbt-0001' is unbeatable
        spawn = pbt.next_spawn()
        start = spawn.parent_step or 0
        value = 100.0 if spawn.trial_id == "pbt-0001" else random.Random(n).random()
        pbt.on_trial_result(spawn.trial_id, res(start + 1, value, "acc"))
        step[spawn.trial_id] = start + 1
    gens = {t: r["gen"] for t, r in pbt._trials.items()}
    for t, r in pbt._trials.items():
        if r["parent"] is not None:
            g = gens[r["initiator"]]
            assert g - 1 <= gens[r["parent"]] <= g, t
    assert max(gens.values()) >= 4
    assert all(r["parent"] != "pbt-0001" for r in pbt._trials.values() if r["gen"] >= 3)


def test_budget_mode_waits_for_whole_generations():
    def drive(budget):
        pbt = PBT("acc", "max", {"lr": Continuous(0.1, 1.0)}, population_size=3,
                  steps_per_trial=1, budget_mode=budget, seed=2)
        g0 = [pbt.next_spawn() for _ in range(3)]
        pbt.on_trial_result(g0[0].trial_id, res(1, 0.5, "acc"))
        child = pbt.next_spawn()  # gen 0 is whole: its first finisher reproduces
        pbt.on_trial_result(child.trial_id, res(2, 0.6, "acc"))
        return pbt.next_spawn()  # the gen-1 child has finished; gen 1 holds 1 of 3 trials

    assert drive(budget=False) is not None  # asynchronous: gen 2 starts at once
    assert drive(budget=True) is None  # budget mode: gen 1 must first hold 3 trials


def test_budget_mode_run_on_fewer_workers_keeps_generations_whole():
    ex, runner = run_pbt(workers=1, budget_mode=True, population_size=5)
    pbt = runner.scheduler
    gens = [r["gen"] for r in pbt._trials.values()]
    assert gens == sorted(gens)  # synchronized evolution on one worker
    assert all(gens.count(g) == 5 for g in range(5))
    initiators = [r["initiator"] for r in pbt._trials.values() if r["initiator"]]
    assert len(initiators) == len(set(initiators)) == 20  # everyone reproduces once


# ---- exploit = exact donor checkpoint + mutated config ----------------------------------------


def test_exploit_copies_exact_donor_checkpoint_and_mutated_config():
    journal = MemoryJournal()
    ex, runner = run_pbt(workers=3, speeds=[1.0, 0.5, 2.0], journal=journal)
    pbt = runner.scheduler
    first_result = {}
    for kind, p in journal.records():
        if kind == "result":
            first_result.setdefault(p["trial_id"], p)
    first_job = {}
    for h in ex.history:
        first_job.setdefault(h["tasks"][0]["trial_id"], h["tasks"][0])
    children = [t for t, r in pbt._trials.items() if r["parent"] is not None]
    assert len(children) == 16
    for child in children:
        rec, task = pbt._trials[child], first_job[child]
        parent = runner.trials[rec["parent"]]
        donor = parent.checkpoints[rec["parent_step"]]
        assert donor == runner.trials[child].donor  # by name, inside the checkpoint folder
        assert task["checkpoint_in"] == runner.folder.path(donor)
        donor = task["checkpoint_in"]
        assert ex.checkpoints[donor]["trial_id"] == rec["parent"]
        assert ex.checkpoints[donor]["step"] == rec["parent_step"] == task["start_step"]
        assert task["spec"] == rec["config"] == runner.trials[child].config
        pcfg = pbt._trials[rec["parent"]]["config"]
        assert rec["config"]["wd"] == pcfg["wd"] and rec["config"]["batch"] == pcfg["batch"]
        assert rec["config"]["momentum"] != pcfg["momentum"]  # discrete always moves
        # the child really starts from the donor's weights
        metrics, _ = model(task["spec"], task["start_step"] + 1, ex.checkpoints[donor]["state"])
        assert first_result[child]["step"] == task["start_step"] + 1
        assert first_result[child]["metrics"]["loss"] == metrics["loss"]
        trial = runner.trials[child]
        assert trial.state is TrialState.TERMINATED and trial.step == task["start_step"] + 2
        assert rec["fitness"] == [-trial.last_result["loss"]]


# ---- lineage, replay, garbage collection ---------------------------------------------------


def replay(chain):
    """Retrain a lineage from scratch, on a fresh executor, and return the last metrics."""
    ex = SimulatedExecutor(1, model=model)
    ckpt, last = None, None
    for i, entry in enumerate(chain):
        out = f"replay/{i}"
        ex.submit(Job(f"r{i}", [TrialTask(entry["trial_id"], entry["config"],
                                          entry["start_step"], entry["stop_step"], ckpt, out)]))
        last = [e for e in iter(ex.next_event, None) if isinstance(e, TrialResult)][-1]
        ckpt = out
    return last


def test_training_replay_of_the_final_trial_reproduces_it():
    ex, runner = run_pbt(workers=2)
    pbt = runner.scheduler
    best = pbt.best_trial()
    chain = pbt.lineage(best)
    assert chain[-1]["trial_id"] == best and chain[0]["parent"] is None
    assert [e["generation"] for e in chain] == list(range(len(chain)))
    for prev, nxt in zip(chain, chain[1:]):
        assert nxt["parent"] == prev["trial_id"] and nxt["start_step"] == prev["stop_step"]
    last = replay(chain)
    assert last.metrics["loss"] == runner.trials[best].last_result["loss"]
    assert last.step == runner.trials[best].step
    finals = [t for t, r in pbt._trials.items() if r["gen"] == 4]
    plan = pbt.replay_plan(finals)
    seen = set()
    for entry in plan:  # topological: parents first
        assert entry["parent"] is None or entry["parent"] in seen
        seen.add(entry["trial_id"])
    assert set(finals) <= seen


def test_garbage_collection_hand_computed():
    pbt = PBT("acc", "max", {"lr": 0.1}, population_size=2, steps_per_trial=2,
              opponent_generations=1, seed=0)
    a, b = pbt.next_spawn(), pbt.next_spawn()
    pbt.on_trial_result(a.trial_id, res(2, 0.9, "acc"))
    pbt.on_trial_result(b.trial_id, res(2, 0.5, "acc"))
    c, d = pbt.next_spawn(), pbt.next_spawn()  # a beats b either way: both children of a@2
    assert (c.parent, c.parent_step, d.parent, d.parent_step) == (a.trial_id, 2, a.trial_id, 2)
    pbt.on_trial_result(c.trial_id, res(4, 0.95, "acc"))
    assert pbt.pinned() == {c.trial_id: (a.trial_id, 2), d.trial_id: (a.trial_id, 2)}
    ck = [(a.trial_id, 1, "a1"), (a.trial_id, 2, "a2"), (b.trial_id, 1, "b1"),
          (b.trial_id, 2, "b2"), (c.trial_id, 3, "c3"), (c.trial_id, 4, "c4")]
    states = {a.trial_id: "TERMINATED", b.trial_id: TrialState.TERMINATED,
              c.trial_id: "TERMINATED", d.trial_id: "PENDING"}
    # d (pending) needs its pinned donor a2; c can still win a tournament of gen 1 (c4); the
    # best trial c keeps its final c4 and its lineage's donor a2
    assert pbt.deletable_checkpoints(ck, states) == {"a1", "b1", "b2", "c3"}
    # with k = 2, generation-0 finals can still be picked as parents
    pbt.k = 2
    assert pbt.deletable_checkpoints(ck, states) == {"a1", "b1", "c3"}
    pbt.k = 1
    # a paused trial keeps its latest own checkpoint; an unknown trial keeps its latest
    states[c.trial_id] = "PAUSED"
    ck2 = ck[:-1] + [("stranger", 7, "s7"), ("stranger", 9, "s9")]
    states["stranger"] = "TERMINATED"
    assert pbt.deletable_checkpoints(ck2, states, keep_lineage_of=[]) == {"a1", "b1", "b2", "s7"}


def test_gc_never_removes_what_the_run_still_needs():
    """Delete what GC allows after every event of a real run: the run must still finish."""
    ex = SimulatedExecutor(2, model=model)
    runner = TrialRunner(ex, make_pbt(), None)
    deleted = set()
    while not runner.run(max_events=5):
        for name in runner.scheduler.deletable_checkpoints(runner.checkpoints(),
                                                           runner.states()):
            ex.checkpoints.pop(runner.folder.path(name), None)
            deleted.add(name)
    assert all(t.state is TrialState.TERMINATED for t in runner.trials.values())
    assert len(deleted) > 20
    assert replay(runner.scheduler.lineage(runner.scheduler.best_trial()))  # still replayable


# ---- the driver dies mid-PBT ----------------------------------------------------------------




def lineage_is_intact(ex, runner):
    pbt = runner.scheduler
    for t, r in pbt._trials.items():
        if r["status"] == "failed":
            continue
        trial = runner.trials[t]
        assert trial.state is TrialState.TERMINATED and trial.step == r["stop"], t
        assert r["fitness"] == [-trial.last_result["loss"]], t
        if r["parent"] is not None:
            donor = ex.checkpoints.get(trial.donor) if trial.donor else None
            assert trial.parent == r["parent"] and trial.parent_step == r["parent_step"], t
            assert donor is None or (donor["trial_id"], donor["step"]) == (r["parent"],
                                                                             r["parent_step"])
    gens = [r["gen"] for r in pbt._trials.values() if r["status"] == "done"]
    assert all(gens.count(g) == 4 for g in range(5)) and len(gens) == 20


def _pbt_view(runner):
    # The population as the scheduler holds it (through JSON, as a resumed one would), and the
    # state it saves.
    population = json.loads(json.dumps(runner.scheduler._trials))
    trials = {t: (tr.state, tr.step, tr.last_result["loss"]) for t, tr in runner.trials.items()}
    return population, runner.scheduler.state_dict(), trials


@pytest.mark.parametrize("workers", [1, 3])
def test_kill_driver_mid_pbt_and_resume_lineage_intact(workers):
    _, full = run_pbt(workers=workers)
    for kill_after in (10, 55, 130):
        journal = MemoryJournal()
        ex = SimulatedExecutor(workers, model=model)
        runner = TrialRunner(ex, make_pbt(), journal)
        assert not runner.run(max_events=kill_after)
        ex2 = SimulatedExecutor(workers, model=model, checkpoints=ex.checkpoints)
        resumed = TrialRunner.resume(ex2, make_pbt(), journal)
        assert resumed.run()
        lineage_is_intact(ex2, resumed)
        if workers == 1:  # one worker: the order of events cannot change, nor the outcome
            assert _pbt_view(resumed) == _pbt_view(full)


def _crash_and_resume(every):
    probe = CrashingJournal()
    run_pbt(workers=1, journal=probe)
    total = probe.writes
    _, full = run_pbt(workers=1)
    for crash_at in range(1, total + 1, every):
        journal = CrashingJournal(crash_at)
        ex = SimulatedExecutor(1, model=model)
        runner = TrialRunner(ex, make_pbt(), journal)
        with pytest.raises(Crash):
            runner.run()
        journal.crash_at = None
        ex2 = SimulatedExecutor(1, model=model, checkpoints=ex.checkpoints)
        resumed = TrialRunner.resume(ex2, make_pbt(), journal)
        assert resumed.run()
        lineage_is_intact(ex2, resumed)
        assert _pbt_view(resumed) == _pbt_view(full), crash_at


def test_crash_at_a_third_of_the_journal_writes_then_resume():
    _crash_and_resume(every=3)


@pytest.mark.slow
def test_crash_at_every_journal_write_then_resume():
    _crash_and_resume(every=1)  # each crash window of every handler


def test_runner_refuses_a_child_with_nothing_to_train():
    ex = SimulatedExecutor(1, model=model)
    runner = TrialRunner(ex, make_pbt(), None, max_steps=4)  # generation 2 would start at 4
    with pytest.raises(ValueError, match="max_steps=4 leaves it nothing to train"):
        runner.run()
