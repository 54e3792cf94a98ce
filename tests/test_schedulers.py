"""Schedulers driven with plain numbers: hand-computed decisions, a contract suite every
scheduler passes (JSON state, restore mid-run), and differential tests against Ray Tune."""
from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import pytest

from retiarii.strategies import ASHA, HyperTrick, Hyperband, MedianStopping, PBT, Scheduler
from retiarii.strategies.schedulers import pbt
from retiarii.strategies.schedulers.asha import rung_milestones
from retiarii.strategies.schedulers.hyperband import bracket_plan
from retiarii.strategies.schedulers.hypertrick import (
    dcm_threshold, expected_completion_rate, min_completion_rate,
)
from retiarii.strategies.schedulers.base import Decision

C, P, S = Decision.CONTINUE, Decision.PAUSE, Decision.STOP


def res(t, value, metric="loss"):
    return {"training_iteration": t, metric: value}


# ---- median stopping ---------------------------------------------------------------------


def test_median_hand_computed_stream():
    s = MedianStopping("loss", "min", grace_period=2, min_samples_required=2)
    stream = [  # (trial, t, loss, expected, why)
        ("a", 1, 1.0, C), ("a", 2, 0.8, C), ("a", 3, 0.6, C),  # no peers yet
        ("b", 1, 2.0, C), ("b", 2, 1.0, C), ("b", 3, 0.9, C),  # one peer < min_samples
        ("c", 1, 0.5, C),  # t < grace
        ("c", 2, 1.2, C),  # means a .8, b 1.0 -> median .9; best is the pre-grace 0.5
        ("c", 3, 1.1, C),  # means over t in [2, 3]: a .7, b .95 -> .825; best .5
        ("d", 1, 3.0, C),
        ("d", 2, 0.9, C),  # means a .8, b 1.0, c 1.2 -> median 1.0; best .9
        ("d", 3, 0.95, C),  # means a .7, b .95, c 1.15 -> .95; best .9 (strict cutoff)
        ("e", 2, 0.96, S),  # means .8 .9 1.0 1.2 -> median .95 (even count: mean of middle)
    ]
    for trial, t, loss, expected in stream:
        assert s.on_trial_result(trial, res(t, loss)) == expected, (trial, t)


def test_median_tie_continues_and_peers_must_have_reached_t():
    s = MedianStopping("acc", "max", grace_period=1, min_samples_required=1)
    s.on_trial_result("a", res(1, 0.5, "acc"))
    assert s.on_trial_result("b", res(1, 0.5, "acc")) == C  # equal to the median: continue
    assert s.on_trial_result("c", res(1, 0.4, "acc")) == S
    # at t=5 no peer has a result at time >= 5: insufficient samples
    assert s.on_trial_result("a", res(5, 0.0, "acc")) == C


def test_median_nan_and_missing_and_soft_stop():
    s = MedianStopping("loss", "min", grace_period=1, min_samples_required=1, hard_stop=False)
    assert s.on_trial_result("a", res(1, math.nan)) == C  # a's mean is NaN: no finite peers
    assert s.on_trial_result("b", {"training_iteration": 1}) == C  # no metric: ignored
    assert s.on_trial_result("b", res(1, 0.7)) == C  # the NaN peer is dropped -> 0 samples
    assert s.on_trial_result("c", res(1, math.nan)) == P  # NaN best vs median 0.7: paused
    assert s.on_trial_result("c", res(2, 9.0)) == C  # resumed: runs FIFO, never judged again


# ---- ASHA --------------------------------------------------------------------------------


def test_asha_rungs_and_interpolated_cutoff():
    assert rung_milestones(1, 10, 2, 0) == [8, 4, 2, 1]
    assert rung_milestones(1, 10, 2, 1) == [8, 4, 2]
    assert rung_milestones(2, 6, 3, 0) == [6, 2]  # log(3)/log(3) + 1 = 2 rungs
    s = ASHA("acc", "max", grace_period=1, max_t=10, reduction_factor=2)
    # Ray's own example: cutoff of {2} is 2, then of {2, 4} the 50th percentile is 3
    assert [s.on_trial_result(t, res(1, v, "acc")) for t, v in [("1", 2), ("2", 4), ("3", 1)]] \
        == [C, C, S]
    s = ASHA("acc", "max", grace_period=1, max_t=100, reduction_factor=4)
    for i, v in enumerate([1, 2, 3, 4]):
        s.on_trial_result(f"r{i}", res(1, v, "acc"))
    # 75th percentile of [1, 2, 3, 4] with linear interpolation is 3.25; strict cutoff
    assert s.on_trial_result("x", res(1, 3.2, "acc")) == S
    # the cutoff now includes x: [1, 2, 3, 4, 3.2] -> 75th percentile 3.2
    assert s.on_trial_result("y", res(1, 3.2, "acc")) == C


def test_asha_min_mode_max_t_missing_rungs_and_nan():
    s = ASHA("loss", "min", grace_period=1, max_t=9, reduction_factor=3)  # rungs 9, 3, 1
    assert s.on_trial_result("a", res(1, 0.5)) == C
    assert s.on_trial_result("b", res(1, 0.7)) == S  # -0.7 < cutoff -0.5
    assert s.on_trial_result("c", res(1, math.nan)) == C  # NaN is never below a cutoff
    assert s.on_trial_result("d", res(1, 0.6)) == S  # nanpercentile ignores c's NaN
    # d skipped rung 3 before: a result at t=5 is judged at rung 3 (a missing rung)
    assert s.on_trial_result("e", res(5, 0.1)) == C
    assert s.on_trial_result("f", res(4, 0.2)) == S  # rung 3 holds only e: cutoff -0.1
    assert s.on_trial_result("f", res(9, 9.9)) == S  # max_t stops whatever the value


def test_asha_walks_down_to_an_unrecorded_rung_like_ray():
    s = ASHA("acc", "max", grace_period=1, max_t=100, reduction_factor=2)
    s.on_trial_result("a", res(8, 0.9, "acc"))  # recorded at rung 8 only
    s.on_trial_result("b", res(4, 0.2, "acc"))
    s.on_trial_result("c", res(4, 0.8, "acc"))
    # a's next result at 9: rung 8 already has it, so Ray records it at rung 4, judged there
    assert s.on_trial_result("a", res(9, 0.1, "acc")) == S  # 0.1 < median(0.2, 0.8)


def test_asha_promotion_pauses_and_promotes_top_fraction():
    s = ASHA("acc", "max", grace_period=1, max_t=4, reduction_factor=2, promotion=True)
    for t in "abcde":
        s.on_trial_add(t, {})
    for t, v in [("a", .1), ("b", .4), ("c", .3), ("d", .2)]:
        assert s.on_trial_result(t, res(1, v, "acc")) == P
    waiting = ["e", "a", "b", "c", "d"]  # e pending, the rest paused at rung 1
    assert s.choose_trial_to_run(waiting) == "b"  # top floor(4/2) = [b, c]
    assert s.choose_trial_to_run(["e", "a", "c", "d"]) == "c"
    assert s.choose_trial_to_run(["e", "a", "d"]) == "e"  # nobody else makes the cut: new trial
    assert s.choose_trial_to_run(["a", "d"]) is None
    assert s.on_trial_result("b", res(2, .5, "acc")) == P  # rung 2
    assert s.on_trial_result("c", res(2, .6, "acc")) == P
    assert s.choose_trial_to_run(["a", "d", "b", "c"]) == "c"  # rung 2 first: top 1 of 2
    assert s.on_trial_result("c", res(4, .7, "acc")) == S  # max_t completes it


# ---- Hyperband ---------------------------------------------------------------------------


def test_hyperband_plan():
    assert [bracket_plan(27, 3, s, 3) for s in (3, 2, 1, 0)] == [
        (27, [1, 3, 9, 27]), (12, [3, 9, 27]), (6, [9, 27]), (4, [27])]
    assert bracket_plan(6, 2, 2, 2) == (4, [2, 3, 6])  # round(1.5) = 2, round(3.0) = 3


def test_hyperband_synchronous_rounds_pause_then_promote():
    hb = Hyperband("loss", "min", max_t=4, reduction_factor=2)  # s=2: 4 trials at [1, 2, 4]
    for i in range(8):  # t0..t3 -> bracket s=2, t4..t6 -> s=1 ([2, 4]), t7 -> s=0 ([4])
        hb.on_trial_add(f"t{i}", {})
    # the 4th report closes round 0: the best 2 (t1 .1, t3 .2) go on; t3 reported, continues
    assert [hb.on_trial_result(f"t{i}", res(1, v)) for i, v in enumerate([.4, .1, .3, .2])] \
        == [P, P, P, C]
    assert hb.trials_to_stop() == ["t0", "t2"]
    assert hb.choose_trial_to_run(["t4", "t5", "t6", "t7", "t1"]) == "t1"  # promoted first
    assert hb.on_trial_result("t3", res(2, .5)) == P  # round 1 waits for t1
    assert hb.on_trial_result("t1", res(2, .05)) == C  # keep max(1, 2 // 2) = 1: t1
    assert hb.trials_to_stop() == ["t3"]
    assert hb.choose_trial_to_run(["t4", "t5", "t6", "t7"]) == "t4"
    assert hb.on_trial_result("t1", res(3, .04)) == C
    assert hb.on_trial_result("t1", res(4, .03)) == S  # max_t: complete
    assert hb.on_trial_result("t7", res(3, .9)) == C  # bracket s=0 just runs to max_t


def test_hyperband_bracket_size_is_successive_halving_of_a_population():
    sh = Hyperband("loss", "min", max_t=6, reduction_factor=2, brackets=1, bracket_size=5)
    for t in "abcde":
        sh.on_trial_add(t, {})
    sh.on_trial_add("f", {})  # opens the next bracket
    assert [sh.on_trial_result(t, res(2, v)) for t, v in zip("abcde", [5, 1, 4, 2, 3])] \
        == [P, P, P, P, S]  # milestone 2 closes on the 5th: keep floor(5 / 2) = 2 (b, d)
    assert sorted(sh.trials_to_stop()) == ["a", "c"]
    assert sh.choose_trial_to_run(["f", "a", "b", "c", "d"]) == "b"
    assert sh.choose_trial_to_run(["f", "a", "c", "d"]) == "d"
    assert sh.on_trial_result("b", res(3, 1)) == P  # milestone round(6 / 2) = 3
    assert sh.on_trial_result("d", res(3, 2)) == S
    assert sh.choose_trial_to_run(["f", "b"]) == "b"


def test_hyperband_underfilled_bracket_closes_when_nothing_else_runs():
    hb = Hyperband("acc", "max", max_t=4, reduction_factor=2, brackets=1)  # needs 4 trials
    for t in "abc":
        hb.on_trial_add(t, {})
    for t, v in [("a", .1), ("b", math.nan), ("c", .3)]:
        assert hb.on_trial_result(t, res(1, v, "acc")) == P
    # no more trials will come: the round closes with 3, keeping max(1, 3 // 2) = 1 (NaN last)
    assert hb.choose_trial_to_run(["a", "b", "c"]) == "c"
    assert sorted(hb.trials_to_stop()) == ["a", "b"]


def test_hyperband_ties_keep_arrival_order():
    hb = Hyperband("acc", "max", max_t=4, reduction_factor=2, brackets=1)
    for t in "abcd":
        hb.on_trial_add(t, {})
    # all equal: the first two to arrive (c, a) go on; b, the last, is stopped by its decision
    assert [hb.on_trial_result(t, res(1, 0.5, "acc")) for t in "cadb"] == [P, P, P, S]
    assert hb.trials_to_stop() == ["d"]
    assert hb.choose_trial_to_run(["a", "b", "c", "d"]) == "c"


def test_hyperband_error_unblocks_round():
    hb = Hyperband("acc", "max", max_t=4, reduction_factor=2, brackets=1)
    for t in "abcd":
        hb.on_trial_add(t, {})
    for t, v in [("a", .1), ("b", .2), ("c", .3)]:
        hb.on_trial_result(t, res(1, v, "acc"))
    hb.on_trial_error("d")  # the round no longer waits for d
    assert hb.choose_trial_to_run(["a", "b", "c"]) == "c"
    assert sorted(hb.trials_to_stop()) == ["a", "b"]


# ---- HyperTrick --------------------------------------------------------------------------


def test_hypertrick_paper_numbers():
    assert [dcm_threshold(16, 0.25, p) for p in range(3)] == [8, 6, 4]  # the toy of Fig. 2
    # Table 1: (min[alpha], E[alpha]) = (18.87%, 37.75%) for Np=10, (30.51%, 61.02%) for Np=5
    assert round(100 * min_completion_rate(10, .25), 2) == 18.87
    assert round(100 * expected_completion_rate(10, .25), 2) == 37.75
    assert round(100 * min_completion_rate(5, .25), 2) == 30.51
    assert round(100 * expected_completion_rate(5, .25), 2) == 61.02


def test_hypertrick_toy_third_phase():
    ht = HyperTrick("score", "max", num_workers=16, num_phases=4, eviction_rate=0.25)
    for w, v in enumerate([10, 20, 30, 40]):  # W0..W3 end phase 3 in data-collection mode
        assert ht.on_trial_result(f"W{w}", res(3, v, "score")) == C
    # W4 is the fifth: worker-selection mode; median of [10, 20, 30, 40, 5] is 20
    assert ht.on_trial_result("W4", res(3, 5, "score")) == S
    # W5: median of [10, 20, 30, 40, 5, 31] is 25 and 31 is in the top half
    assert ht.on_trial_result("W5", res(3, 31, "score")) == C
    assert ht.on_trial_result("W6", res(3, 20, "score")) == C  # median of the 7 is 20: not below
    assert ht.on_trial_result("W0", res(4, 1, "score")) == S  # all phases done: complete


def test_hypertrick_quantile_boundary_nan_and_w0_limit():
    ht = HyperTrick("loss", "min", num_workers=4, num_phases=3, eviction_rate=0.25)
    assert ht.dcm_threshold(0) == 2  # floor(4 * 0.5)
    assert ht.on_trial_result("a", res(1, math.nan)) == C  # DCM lets even NaN through
    assert ht.on_trial_result("b", res(1, 0.5)) == C
    assert ht.on_trial_result("c", res(1, math.nan)) == S  # WSM: NaN is stopped
    # finite values (negated) [-0.5, -0.4]: median -0.45; -0.4 is above it
    assert ht.on_trial_result("d", res(1, 0.4)) == C
    assert ht.on_trial_result("e", res(1, 0.45)) == C  # [-.5, -.4, -.45]: median -.45, not below
    assert ht.on_trial_result("a", res(1.5, 0.1)) == C  # mid-phase: not judged
    assert ht.choose_trial_to_run(["f", "a"]) == "a"  # W0 = 4 trials started already (a..e: 5)


# ---- a contract suite every scheduler passes -----------------------------------------------


def _factories():
    return {
        "fifo": lambda: Scheduler(),
        "median": lambda: MedianStopping("loss", "min", grace_period=2, min_samples_required=2),
        "median-soft": lambda: MedianStopping("loss", "min", 1, 2, hard_stop=False),
        "asha": lambda: ASHA("loss", "min", grace_period=1, max_t=8, reduction_factor=2),
        "asha-brackets": lambda: ASHA("loss", "min", 1, 8, 2, brackets=3, seed=1),
        "asha-promotion": lambda: ASHA("loss", "min", 1, 8, 2, promotion=True),
        "hyperband": lambda: Hyperband("loss", "min", max_t=8, reduction_factor=2),
        "hypertrick": lambda: HyperTrick("loss", "min", num_workers=12, num_phases=4,
                                         eviction_rate=0.25, phase_length=2),
        "pbt": lambda: PBT("loss", "min", {"lr": 0.1}, population_size=4, steps_per_trial=2,
                           seed=3),
    }


def _drive(sched, rng, steps, state_at=None, make=None, states=None):
    """Feed a random interleaving of results; optionally swap in a restored copy midway, and
    collect the state after every step into ``states``."""
    log, alive, clock = [], {}, {}
    n = 0
    for k in range(steps):
        if k == state_at:
            state = json.loads(json.dumps(sched.state_dict(), allow_nan=False))
            sched = make()
            sched.load_state_dict(state)
        spawn = sched.next_spawn()
        if spawn is not None:
            alive[spawn.trial_id] = True
            clock[spawn.trial_id] = spawn.parent_step or 0
            sched.on_trial_add(spawn.trial_id, spawn.config)
        if len(alive) < 6 and rng.random() < 0.4:
            tid = f"x{n}"
            n += 1
            sched.on_trial_add(tid, {})
            alive[tid], clock[tid] = True, 0
        live = sorted(t for t in alive if alive[t])
        if not live:
            continue
        tid = rng.choice(live)
        clock[tid] += 1
        value = rng.choice([math.nan, 0.5]) if rng.random() < 0.05 else rng.random()
        d = sched.on_trial_result(tid, res(clock[tid], value))
        assert isinstance(d, Decision)
        pick = sched.choose_trial_to_run(live)
        assert pick is None or pick in live
        stops = sched.trials_to_stop()
        log.append((tid, clock[tid], d.name, pick, tuple(stops)))
        if d is S:
            alive[tid] = False
            sched.on_trial_complete(tid, res(clock[tid], value))
        for t in stops:
            alive[t] = False
        if states is not None:
            states.append(json.loads(json.dumps(sched.state_dict(), allow_nan=False)))
    return log


@pytest.mark.parametrize("name", list(_factories()))
def test_contract_state_is_strict_json_and_restores_mid_run(name):
    make = _factories()[name]
    for seed in range(3):
        full = _drive(make(), random.Random(seed), 120)
        for cut in (1, 37, 90):
            resumed = _drive(make(), random.Random(seed), 120, state_at=cut, make=make)
            assert resumed == full, (name, seed, cut)


@pytest.mark.parametrize("name", ["median", "median-soft", "asha", "asha-brackets",
                                  "asha-promotion", "hyperband", "pbt"])
def test_growing_states_only_grow_at_the_end_of_their_append_only_lists(name):
    """What lets the store save the state after every decision in constant time (store.py)."""
    states = []
    _drive(_factories()[name](), random.Random(4), 150, states=states)
    assert states[-1]["append_only"] == ["log"] and len(states[-1]["log"]) > 20
    for before, after in zip(states, states[1:]):
        assert after["log"][:len(before["log"])] == before["log"]


@pytest.mark.parametrize("name", list(_factories()))
def test_contract_refuses_state_of_another_scheduler(name):
    other = ASHA("loss", "min") if name.startswith("median") else MedianStopping("loss", "min")
    with pytest.raises(ValueError, match="scheduler"):
        _factories()[name]().load_state_dict(other.state_dict())


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="mode"):
        MedianStopping("loss", "minimize")
    with pytest.raises(ValueError, match="grace_period"):
        ASHA("loss", "min", grace_period=10, max_t=5)
    with pytest.raises(ValueError, match="brackets"):
        Hyperband("loss", "min", max_t=8, reduction_factor=2, brackets=9)
    with pytest.raises(ValueError, match="eviction_rate"):
        HyperTrick("loss", "min", eviction_rate=1.5)
    with pytest.raises(ValueError, match="training_iteration"):
        Hyperband("loss", "min").on_trial_result("a", {"loss": 1.0})


# ---- differential tests against Ray Tune --------------------------------------------------

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


class _RayTrial:
    """The little of ray.tune.experiment.Trial the two schedulers read (hashable, trial_id)."""

    def __init__(self, trial_id):
        self.trial_id = trial_id

    def __repr__(self):
        return self.trial_id


class _NoWaiting:
    """A controller with no PENDING/PAUSED trial: Ray's median rule then never yields."""

    def get_live_trials(self):
        return []


def _ray_streams(seed, n_trials=12, max_t=12):
    """Asynchronous interleavings with ties (rounded values), NaNs, skipped steps, completions."""
    rng = random.Random(seed)
    t = {f"t{i}": 0 for i in range(n_trials)}
    events, done = [], set()
    while len(done) < n_trials:
        tid = rng.choice(sorted(set(t) - done))
        t[tid] += rng.choice([1, 1, 1, 2])
        if rng.random() < 0.05:
            value = math.nan
        else:
            value = round(rng.gauss(1.0 / t[tid], 0.3), 1)
        events.append(("result", tid, {"training_iteration": t[tid], "loss": value,
                                       "time_total_s": 1.5 * t[tid]}))
        if t[tid] >= max_t or rng.random() < 0.08:
            events.append(("complete", tid, events[-1][2]))
            done.add(tid)
    return events


def _compare(ours, theirs, events, stop_after_stop=True):
    trials, ctl, stopped = {}, _NoWaiting(), set()
    for kind, tid, result in events:
        if tid not in trials:
            trials[tid] = _RayTrial(tid)
            ours.on_trial_add(tid, {})
            theirs.on_trial_add(ctl, trials[tid])
        if tid in stopped and stop_after_stop:
            continue
        if kind == "result":
            a = ours.on_trial_result(tid, dict(result))
            b = theirs.on_trial_result(ctl, trials[tid], dict(result))
            assert a.value == b, (tid, result, a, b)
            if a is S:
                stopped.add(tid)
                ours.on_trial_complete(tid, dict(result))
                theirs.on_trial_complete(ctl, trials[tid], dict(result))
        else:
            ours.on_trial_complete(tid, dict(result))
            theirs.on_trial_complete(ctl, trials[tid], dict(result))
            stopped.add(tid)


@pytest.mark.parametrize("seed", range(40))
def test_median_stopping_decides_as_ray(seed):
    ray_sched = pytest.importorskip("ray.tune.schedulers", reason="Ray Tune is not installed")
    for mode, grace, samples, hard, attr in [("min", 2, 3, True, "training_iteration"),
                                             ("max", 1, 1, True, "training_iteration"),
                                             ("min", 3, 2, False, "time_total_s")]:
        ours = MedianStopping("loss", mode, grace, samples, hard_stop=hard, time_attr=attr)
        theirs = ray_sched.MedianStoppingRule(time_attr=attr, metric="loss", mode=mode,
                                              grace_period=grace, min_samples_required=samples,
                                              hard_stop=hard)
        _compare(ours, theirs, _ray_streams(seed), stop_after_stop=hard)


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")  # Ray's nanpercentile
@pytest.mark.parametrize("seed", range(40))
def test_asha_decides_as_ray(seed):
    ray_sched = pytest.importorskip("ray.tune.schedulers", reason="Ray Tune is not installed")
    for mode, grace, max_t, rf, brackets, last in [("min", 1, 12, 2, 1, True),
                                                   ("max", 2, 12, 3, 1, True),
                                                   ("min", 1, 9, 3, 1, False),
                                                   ("min", 1, 12, 2, 3, True)]:
        np.random.seed(seed)  # Ray draws brackets from the global RandomState
        theirs = ray_sched.AsyncHyperBandScheduler(metric="loss", mode=mode, grace_period=grace,
                                                   max_t=max_t, reduction_factor=rf,
                                                   brackets=brackets, stop_last_trials=last)
        ours = ASHA("loss", mode, grace, max_t, rf, brackets=brackets, stop_last_trials=last,
                    seed=seed)
        _compare(ours, theirs, _ray_streams(seed, max_t=max_t))


# ---- replaying saved event logs (scheduler.replay_log) ------------------------------------------


def test_replay_log_calls_one_handler_per_event_in_order():
    from retiarii.strategies.schedulers.base import replay_log

    seen = []
    replay_log([["a", 1, 2], ["b"], ["a", 3, 4]],
               {"a": lambda x, y: seen.append(("a", x, y)), "b": lambda: seen.append(("b",))},
               "Test")
    assert seen == [("a", 1, 2), ("b",), ("a", 3, 4)]
    for bad in (["c", 1], []):
        with pytest.raises(ValueError, match=r"unknown event .* in a saved Test state"):
            replay_log([["b"], bad], {"b": lambda: None}, "Test")


@pytest.mark.parametrize("make", [
    lambda: ASHA("acc", "max", grace_period=1, max_t=10, reduction_factor=2),
    lambda: Hyperband("acc", "max", max_t=9, reduction_factor=3),
    lambda: MedianStopping("acc", "max", grace_period=1, min_samples_required=1),
    lambda: PBT("acc", "max", {"lr": pbt.Continuous(0.1, 1.0)}, population_size=2,
                steps_per_trial=1),
], ids=["ASHA", "Hyperband", "MedianStopping", "PBT"])
def test_a_replayed_log_rebuilds_the_state_and_refuses_unknown_events(make):
    s = make()
    for i in range(3):
        s.on_trial_add(f"t{i}", {"lr": 0.5})
    for step in (1, 2, 3):
        for i in range(3):
            s.on_trial_result(f"t{i}", {"training_iteration": step, "acc": i * 0.1 + step})
    state = json.loads(json.dumps(s.state_dict()))
    again = make()
    again.load_state_dict(state)
    assert again.state_dict() == s.state_dict()
    # and it decides as the original does from here on
    for step in (4, 5):
        for i in (2, 0, 1):
            result = {"training_iteration": step, "acc": (2 - i) * 0.3 + step}
            assert again.on_trial_result(f"t{i}", result) == s.on_trial_result(f"t{i}", result)
    assert again.state_dict() == s.state_dict()
    state["log"] = state["log"] + [["no-such-event", "t0"]]
    with pytest.raises(ValueError, match="unknown event"):
        make().load_state_dict(state)
