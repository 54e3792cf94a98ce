"""MOASHA and Scalarized: promotion by non-dominated rank and crowding by hand, stop-based
decisions by hand, costs read from the trial's config, saved state = uninterrupted, and an
experiment of two objectives early-stopped end to end."""
import math

import pytest

import retiarii as rt
from engine_helpers import InProcessExecutor
from exp_space import space
from retiarii.engine.storage.store import Store
from retiarii.scalarization import MnasNetReward
from retiarii.strategies import ASHA, MOASHA, Decision, HyperTrick, MedianStopping, Scalarized
from retiarii.strategies.schedulers.moasha import nsga_order


def _at(t, **metrics):
    return {"training_iteration": t, **metrics}


def test_nsga_order_by_hand():
    # front {a, b, c, d}: b and d its ends; a's crowding 3/4 + 5/8 beats c's 1/2 + 1/2
    assert nsga_order([(2.0, 2.0), (0.0, 4.0), (1.0, 2.5), (4.0, 0.0), (3.0, 3.0)]) == \
        [1, 3, 0, 2, 4]
    # a NaN objective ranks after everything; two of them keep arrival order
    assert nsga_order([(math.nan, 1.0), (5.0, 5.0), (1.0, math.nan)]) == [1, 0, 2]


# a (0.9, 9 ms), b (0.85, 8 ms), c (0.5, 1 ms), d (0.4, 2 ms): a, b, c form the front (d is
# dominated by c); rf=2 keeps floor(4/2) = 2: a and c, the front's ends. ASHA on accuracy
# alone would keep a and b.
RUNG = [("a", 0.9, 9.0), ("b", 0.85, 8.0), ("c", 0.5, 1.0), ("d", 0.4, 2.0)]


def _fill(s, costs_in_config=True):
    for t, acc, ms in RUNG:
        s.on_trial_add(t, {"costs": {"ms": ms}} if costs_in_config else {})
        result = _at(1, acc=acc) if costs_in_config else _at(1, acc=acc, ms=ms)
        assert s.on_trial_result(t, result) is Decision.PAUSE


@pytest.mark.parametrize("costs_in_config", [True, False])
def test_promotion_by_rank_then_crowding_by_hand(costs_in_config):
    s = MOASHA(["acc", "ms"], ["max", "min"], grace_period=1, max_t=4, reduction_factor=2)
    _fill(s, costs_in_config)
    waiting = ["e", "a", "b", "c", "d"]  # e: a new trial
    assert s.choose_trial_to_run(waiting) == "a"
    assert s.choose_trial_to_run(waiting) == "c"
    assert s.choose_trial_to_run(waiting) == "e"  # b and d stay paused
    asha = ASHA("acc", "max", grace_period=1, max_t=4, reduction_factor=2, promotion=True)
    for t, acc, _ in RUNG:
        asha.on_trial_result(t, _at(1, acc=acc))
    assert [asha.choose_trial_to_run(waiting) for _ in range(2)] == ["a", "b"]
    # at the next rung (2) a and c are recorded; floor(2/2) = 1: a (first of two ends)
    for t in ("a", "c"):
        assert s.on_trial_result(t, _at(2, acc=0.95 if t == "a" else 0.6)) is Decision.PAUSE
    assert s.choose_trial_to_run(["b", "d", "a", "c"]) == "a"
    assert s.on_trial_result("a", _at(4, acc=0.96)) is Decision.STOP  # max_t: complete


def test_stop_based_by_hand():
    s = MOASHA(["acc", "ms"], ["max", "min"], grace_period=1, max_t=4, reduction_factor=2,
               promotion=False)
    decisions = []
    for t, acc, ms in RUNG:
        s.on_trial_add(t, {"costs": {"ms": ms}})
        decisions.append(s.on_trial_result(t, _at(1, acc=acc)).name)
    # a alone: top ceil(1/2)=1; b: {a, b} both on the front, ends: a first, b within
    # ceil(2/2)=1? no -> STOP; c: a, c ends of {a, b, c}: top 2 -> CONTINUE; d: dominated
    assert decisions == ["CONTINUE", "STOP", "CONTINUE", "STOP"]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="for one metric use ASHA"):
        MOASHA("acc")
    with pytest.raises(ValueError, match="one mode per metric"):
        MOASHA(["acc", "ms"], ["max"])
    with pytest.raises(ValueError, match="mode='max'"):
        Scalarized(MedianStopping("r", "min"), MnasNetReward("acc", "ms", target=1.0))


def _drive(s, events):
    out = []
    for kind, *args in events:
        if kind == "add":
            s.on_trial_add(args[0], {"costs": {"ms": args[1]}})
        elif kind == "res":
            out.append(s.on_trial_result(args[0], _at(args[1], acc=args[2])).name)
        else:
            out.append(s.choose_trial_to_run(args[0]))
    return out


EVENTS = [("add", f"t{i}", float(i % 5)) for i in range(8)] + \
    [("res", f"t{i}", 1, 0.5 + 0.05 * i) for i in range(8)] + \
    [("run", [f"t{i}" for i in range(8)])] * 3 + \
    [("res", "t7", 2, 0.9), ("res", "t4", 2, 0.8), ("run", ["t0", "t4", "t7"])] * 2


@pytest.mark.parametrize("brackets", [1, 2])
def test_saved_state_continues_as_uninterrupted(brackets):
    def make():
        return MOASHA(["acc", "ms"], ["max", "min"], grace_period=1, max_t=8,
                      reduction_factor=2, brackets=brackets, seed=3)

    whole = _drive(make(), EVENTS)
    first = make()
    head = _drive(first, EVENTS[:12])
    second = make()
    second.load_state_dict(first.state_dict())
    assert head + _drive(second, EVENTS[12:]) == whole
    with pytest.raises(ValueError, match="same arguments"):
        MOASHA(["acc", "x"], ["max", "min"]).load_state_dict(first.state_dict())


def test_scalarized_hypertrick_and_state():
    reward = MnasNetReward("acc", "ms", target=2.0, alpha=0.0, beta=-1.0)

    def make():
        return Scalarized(HyperTrick("reward", "max", num_workers=4, num_phases=2,
                                     phase_length=1, eviction_rate=0.5), reward)

    s = make()
    for t, acc, ms in [("a", 0.9, 1.0), ("b", 0.8, 1.0), ("c", 0.95, 8.0)]:
        s.on_trial_add(t, {"costs": {"ms": ms}})
    state = s.state_dict()
    assert state["costs"] == {"a": {"ms": 1.0}, "b": {"ms": 1.0}, "c": {"ms": 8.0}}
    restored = make()
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    other = Scalarized(HyperTrick("reward", "max", num_workers=4, num_phases=2),
                       MnasNetReward("acc", "ms", target=3.0))
    with pytest.raises(ValueError, match="same scalarization"):
        other.load_state_dict(state)


def test_experiment_with_moasha_stops_by_rank_and_reads_costs(tmp_path):
    trainer = rt.Trainer(dataset="digits", epochs=3, batch_size=256,
                         lr=rt.ValueChoice([0.01, 0.03, 0.1], label="lr"))
    db = tmp_path / "mo.db"
    scheduler = MOASHA(["val_acc", "params"], ["max", "min"], grace_period=1, max_t=3,
                       reduction_factor=3)
    rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=str(db), workers=1,
                  max_models=6, executor=InProcessExecutor(), optimize=False,
                  scheduler=scheduler, metric=["val_acc", "params"], mode=["max", "min"]).run()
    points = [p for rungs in scheduler._brackets for rung in rungs.recorded
              for p in rung.values()]
    # params (not reported by the trainer) came from the trial's measured costs
    assert points and all(not math.isnan(p[1]) and p[1] > 0 for p in points)
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        steps = dict(store.db.execute(
            "SELECT trial_id, max(step) FROM metrics GROUP BY trial_id").fetchall())
    # 6 models recorded at epoch 1; one worker promotes as soon as a rung's top floor(n/3)
    # holds an unpromoted trial (after 3 results, then after 6): 1 or 2 promoted to the end
    rung1 = scheduler._brackets[0].milestones.index(1)
    assert len(steps) == 6 == len(scheduler._brackets[0].recorded[rung1])
    finished = {t for t, step in steps.items() if step == 3}
    assert 1 <= len(finished) <= 2 and set(steps.values()) == {1, 3}
    assert finished == scheduler._brackets[0].promoted[rung1]


def test_a_scheduler_of_one_metric_is_refused_for_several_objectives(tmp_path):
    with pytest.raises(rt.engine.experiment.ExperimentError, match="use 'moasha'"):
        rt.Experiment(space, rt.strategies.Random(seed=0), rt.Trainer(dataset="digits"),
                      store=str(tmp_path / "x.db"), scheduler="asha",
                      metric=["val_acc", "params"], mode=["max", "min"])


def test_cli_moasha_by_name(tmp_path, capsys):
    from retiarii.cli import main

    base = ["run", "tests/exp_space.py", "--strategy", "random", "--metric", "val_acc,params",
            "--mode", "max,min", "--workers", "1", "--max-models", "3"]
    assert main([*base, "--scheduler", "moasha", "--store", str(tmp_path / "a.db")]) == 0
    with Store(tmp_path / "a.db") as store:
        store.use_experiment(store.experiments()[-1]["id"])
        state = store.load_scheduler_state()["scheduler"]
    assert state["kind"] == "MOASHA" and state["metrics"] == ["val_acc", "params"]
    assert all(e[3]["params"] > 0 for e in state["log"] if e[0] == "add")  # costs read
    assert main([*base, "--scheduler", "asha", "--store", str(tmp_path / "b.db")]) == 2
    assert "use 'moasha'" in capsys.readouterr().err
