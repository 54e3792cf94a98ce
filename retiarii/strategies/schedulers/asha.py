"""Asynchronous successive halving (ASHA): stop-based as in Ray Tune, or promotion-based."""
from __future__ import annotations

import base64
import bisect
import math

import numpy as np

from ...enums import Mode
from .base import Decision, Scheduler, check_state, from_json_float, json_float, replay_log


def rung_milestones(grace_period: float, max_t: float, reduction_factor: float, s: int) -> list:
    """Milestones of bracket ``s``, highest first, with Ray's rounding.

    The count is ``int(log(max_t / grace_period) / log(rf) - s + 1)`` (truncation, float
    arithmetic of ``np.log``) and milestone ``k`` is ``grace_period * rf ** (k + s)``.

    >>> rung_milestones(1, 10, 2, 0)
    [8, 4, 2, 1]
    """
    count = int(np.log(max_t / grace_period) / np.log(reduction_factor) - s + 1)
    return [grace_period * reduction_factor ** (k + s) for k in reversed(range(count))]


def _cutoff(recorded: dict[str, float], reduction_factor: float) -> float | None:
    """The ``(1 - 1/rf)`` percentile of a rung (linear interpolation, NaNs ignored)."""
    if not recorded:
        return None
    values = np.fromiter(recorded.values(), dtype=float, count=len(recorded))
    nan = np.isnan(values)
    if nan.all():
        return float("nan")  # what np.nanpercentile returns, without its warning
    # np.nanpercentile is np.percentile of the non-NaN values (and much slower)
    return float(np.percentile(values[~nan] if nan.any() else values,
                               (1 - 1 / reduction_factor) * 100))


def _rank_key(value: float) -> float:
    return -math.inf if math.isnan(value) else value


class _Bracket:
    """The rungs of one bracket: ``[(milestone, {trial: signed metric})]``, highest first.

    ``promoted[i]`` holds the trials already promoted out of rung ``i`` (promotion variant).
    Every change is appended to ``log`` (the scheduler's, shared by its brackets) as
    ``["rec", bracket, rung, trial, value]`` or ``["promote", bracket, rung, trial]``.
    """

    def __init__(self, milestones: list, reduction_factor: float, stop_last_trials: bool,
                 index: int = 0, log: list | None = None):
        self.index, self.log = index, ([] if log is None else log)
        self.rf = reduction_factor
        self.stop_last_trials = stop_last_trials
        self.rungs: list[tuple[float, dict[str, float]]] = [(m, {}) for m in milestones]
        self.promoted: list[set[str]] = [set() for _ in milestones]
        self._ranked: list[list[tuple]] = [[] for _ in milestones]  # (-value, arrival, trial)
        self.latest: dict[str, int] = {}  # trial -> index of the highest rung it is recorded at
        self.waiting: set[str] = set()  # recorded at their latest rung, not promoted out of it

    def on_result(self, trial_id: str, time: float, value: float) -> Decision:
        """Ray's rule: at the highest milestone passed and not yet recorded, stop the trial if
        its value is strictly below the rung's cutoff (computed before recording it)."""
        for index, (milestone, recorded) in enumerate(self.rungs):
            if time >= milestone and trial_id in recorded and not self.stop_last_trials:
                break
            if time < milestone or trial_id in recorded:
                continue
            cutoff = _cutoff(recorded, self.rf)
            action = Decision.STOP if cutoff is not None and value < cutoff else Decision.CONTINUE
            recorded[trial_id] = value
            self.log.append(["rec", self.index, index, trial_id, json_float(value)])
            return action
        return Decision.CONTINUE

    def record(self, trial_id: str, time: float, value: float) -> bool:
        """Promotion variant: record at the highest milestone passed and not yet recorded."""
        for index, (milestone, recorded) in enumerate(self.rungs):
            if time >= milestone and trial_id not in recorded:
                self._rank(index, trial_id, value)
                recorded[trial_id] = value
                self.log.append(["rec", self.index, index, trial_id, json_float(value)])
                if index <= self.latest.get(trial_id, index):
                    self.latest[trial_id] = index
                    self.waiting.add(trial_id)
                return True
            if time >= milestone:
                return False
        return False

    def _rank(self, index: int, trial_id: str, value: float) -> None:
        """Keep rung ``index`` sorted best first; ties keep arrival order, NaN ranks last."""
        ranked = self._ranked[index]
        bisect.insort(ranked, (-_rank_key(value), len(ranked), trial_id))

    def promotable(self, index: int) -> list[str]:
        """Trials of rung ``index`` in its top ``floor(n / rf)``, best first, not yet promoted."""
        recorded, promoted = self.rungs[index][1], self.promoted[index]
        ranked = self._ranked[index]
        top = ranked[: int(len(recorded) // self.rf)]
        return [t for _, _, t in top if t not in promoted]

    def promote(self, index: int, trial_id: str) -> None:
        self.promoted[index].add(trial_id)
        self.log.append(["promote", self.index, index, trial_id])
        if self.latest.get(trial_id) == index:
            self.waiting.discard(trial_id)

    def derive(self) -> None:
        """Rebuild the rankings, latest rungs and waiting set from ``rungs`` and ``promoted``
        (after a restore, which sets only those two)."""
        self._ranked = [[] for _ in self.rungs]
        for i, (_, recorded) in enumerate(self.rungs):  # recorded dicts keep arrival order
            for t, v in recorded.items():
                self._rank(i, t, v)
        self.latest = {}
        for i in reversed(range(len(self.rungs))):  # lowest rung first: the highest one wins
            for t in self.rungs[i][1]:
                self.latest[t] = i
        self.waiting = {t for t, i in self.latest.items() if t not in self.promoted[i]}


def _rng_state(rng: np.random.RandomState) -> list:
    kind, keys, pos, has_gauss, gauss = rng.get_state()
    words = np.asarray(keys, dtype="<u4").tobytes()
    return [kind, base64.b64encode(words).decode("ascii"), int(pos), int(has_gauss),
            float(gauss)]


def _set_rng_state(rng: np.random.RandomState, state: list) -> None:
    kind, words, pos, has_gauss, gauss = state
    keys = np.frombuffer(base64.b64decode(words), dtype="<u4").astype(np.uint32)
    rng.set_state((kind, keys, pos, has_gauss, gauss))


class ASHA(Scheduler):
    """Asynchronous successive halving over rungs spaced by ``reduction_factor``.

    Bracket ``s`` has milestones ``grace_period * rf ** (k + s)`` for
    ``k < int(log(max_t / grace_period) / log(rf) - s + 1)``. A trial is assigned to a bracket
    when added, at random with probability ``softmax(number of rungs)`` (Ray's rule, drawn from
    ``numpy.random.RandomState(seed)``; one bracket needs no draw).

    Stop-based (default; decides exactly as Ray Tune's ``AsyncHyperBandScheduler``): a result
    with time ``>= max_t`` is STOP. Otherwise, at the highest milestone the trial has passed and
    not yet been recorded at, the cutoff is the ``(1 - 1/rf) * 100`` percentile of the values
    already recorded there (linear interpolation, ``np.nanpercentile``; the trial's own value is
    not included); the trial is stopped if its value is strictly below the cutoff (values are
    negated for ``mode="min"``), then recorded. A NaN value is never below a cutoff, so it
    continues (and is ignored by later cutoffs); a rung passed over without a result at it is
    recorded later only if a higher rung was already recorded (Ray's walk down the rungs).

    Promotion-based (``promotion=True``, Li et al.'s ASHA): a trial reaching a milestone is
    recorded there and PAUSED. When a worker is free, :meth:`choose_trial_to_run` promotes the
    best unpromoted trial among the top ``floor(n / rf)`` of the highest rung that has one
    (ties by arrival, NaN last), else starts a new trial; trials that never make the cut stay
    paused and are terminated when the search ends. ``max_t`` completes a trial (STOP).

    Example:
        >>> s = ASHA("loss", "min", grace_period=1, max_t=4, reduction_factor=2)
        >>> [s.on_trial_result(t, {"training_iteration": 1, "loss": l}).name
        ...  for t, l in [("a", 0.5), ("b", 0.9), ("c", 0.4)]]
        ['CONTINUE', 'STOP', 'CONTINUE']

    Args:
        metric: the result key to compare; mode: ``"min"`` or ``"max"``.
        grace_period: the first milestone (``min_t``). max_t: the last time a trial trains to.
        reduction_factor: rung spacing and selection rate (keep the top ``1/rf``).
        brackets: number of brackets (1 = plain ASHA).
        time_attr: the result key that measures progress.
        stop_last_trials: STOP trials at ``max_t`` (Ray's flag).
        promotion: pause at rungs and promote (Li et al.) instead of stopping early.
        seed: seeds the bracket draw.
    """

    def __init__(self, metric: str, mode: str = "max", grace_period: float = 1, max_t: float = 100,
                 reduction_factor: float = 4, brackets: int = 1,
                 time_attr: str = "training_iteration", stop_last_trials: bool = True,
                 promotion: bool = False, seed: int | None = None):
        mode = Mode.parse(mode, type(self).__name__)
        self.sign = mode.sign
        if not max_t > 0 or not grace_period > 0 or max_t < grace_period:
            raise ValueError(f"need 0 < grace_period <= max_t, got grace_period={grace_period}, "
                             f"max_t={max_t}")
        if not reduction_factor > 1:
            raise ValueError(f"reduction_factor must be > 1, got {reduction_factor}")
        if brackets < 1:
            raise ValueError(f"brackets must be >= 1, got {brackets}")
        self.metric, self.mode, self.time_attr = metric, mode, time_attr
        self.max_t, self.rf, self.promotion = max_t, reduction_factor, promotion
        self.stop_last_trials = stop_last_trials
        # Every change of the state below, in order: ["add", trial, bracket], ["forget", trial],
        # ["dead", trial] and the brackets' events. It is what state_dict saves: it only grows
        # at its end, so a store writes just the new events (a search of thousands of trials
        # saves its scheduler state after every decision).
        self._log: list[list] = []
        self._brackets = [
            _Bracket(rung_milestones(grace_period, max_t, reduction_factor, s),
                     reduction_factor, stop_last_trials, s, self._log) for s in range(brackets)]
        self._trial_bracket: dict[str, int] = {}
        self._dead: set[str] = set()  # promotion variant: failed trials never chosen
        self._rng = np.random.RandomState(seed)

    def _bracket_of(self, trial_id: str) -> _Bracket:
        if trial_id not in self._trial_bracket:
            self.on_trial_add(trial_id, {})  # tolerate plain-number driving without on_trial_add
        return self._brackets[self._trial_bracket[trial_id]]

    def on_trial_add(self, trial_id: str, config: dict) -> None:
        if trial_id in self._trial_bracket:
            return
        if len(self._brackets) == 1:
            bracket = 0
        else:
            sizes = np.array([len(b.rungs) for b in self._brackets])
            probs = np.e ** (sizes - sizes.max())
            bracket = int(self._rng.choice(len(sizes), p=probs / probs.sum()))
        self._trial_bracket[trial_id] = bracket
        self._log.append(["add", trial_id, bracket])

    def on_trial_result(self, trial_id: str, result: dict) -> Decision:
        if self.time_attr not in result or self.metric not in result:
            return Decision.CONTINUE
        time = result[self.time_attr]
        if time >= self.max_t and (self.stop_last_trials or self.promotion):
            return Decision.STOP
        value = self.sign * float(result[self.metric])
        bracket = self._bracket_of(trial_id)
        if self.promotion:
            return Decision.PAUSE if bracket.record(trial_id, time, value) else Decision.CONTINUE
        return bracket.on_result(trial_id, time, value)

    def on_trial_complete(self, trial_id: str, result: dict) -> None:
        if self.promotion or self.time_attr not in result or self.metric not in result:
            return
        if trial_id in self._trial_bracket:  # Ray records the final result, then forgets the trial
            bracket = self._trial_bracket.pop(trial_id)
            self._log.append(["forget", trial_id])
            self._brackets[bracket].on_result(
                trial_id, result[self.time_attr], self.sign * float(result[self.metric]))

    def on_trial_error(self, trial_id: str) -> None:
        if trial_id not in self._dead:
            self._dead.add(trial_id)
            self._log.append(["dead", trial_id])

    def choose_trial_to_run(self, candidates: list[str]) -> str | None:
        if not self.promotion:
            return super().choose_trial_to_run(candidates)
        allowed = set(candidates) - self._dead
        # the highest milestone first, across brackets
        rungs = sorted(((m, bi, ri) for bi, b in enumerate(self._brackets)
                        for ri, (m, _) in enumerate(b.rungs)), key=lambda x: -x[0])
        for _, bi, ri in rungs:
            for trial_id in self._brackets[bi].promotable(ri):
                if trial_id in allowed:
                    self._brackets[bi].promote(ri, trial_id)
                    return trial_id
        for trial_id in candidates:
            if trial_id in allowed and trial_id not in self._bracket_of(trial_id).waiting:
                return trial_id
        return None

    def state_dict(self) -> dict:
        """``{"kind", "brackets": count, "rng", "log", "append_only": ["log"]}``: the state is
        its log of changes (see ``__init__``), replayed by :meth:`load_state_dict`."""
        return {"kind": "ASHA", "brackets": len(self._brackets), "rng": _rng_state(self._rng),
                "log": list(self._log), "append_only": ["log"]}

    def load_state_dict(self, state: dict) -> None:
        check_state(state, "ASHA")
        if state["brackets"] != len(self._brackets):
            raise ValueError(f"saved ASHA state has {state['brackets']} brackets, this one "
                             f"{len(self._brackets)}: build it with the same arguments")
        self._log.clear()  # (the brackets hold this very list)
        self._trial_bracket, self._dead = {}, set()
        for b in self._brackets:
            b.rungs = [(m, {}) for m, _ in b.rungs]
            b.promoted = [set() for _ in b.rungs]
        brackets = self._brackets

        def rec(bracket: int, rung: int, trial_id: str, value) -> None:
            brackets[bracket].rungs[rung][1][trial_id] = from_json_float(value)

        replay_log(state["log"], {
            "add": self._trial_bracket.__setitem__,  # [trial, bracket]
            "forget": lambda trial_id: self._trial_bracket.pop(trial_id, None),
            "dead": self._dead.add,
            "rec": rec,
            "promote": lambda bracket, rung, trial_id: brackets[bracket].promoted[rung].add(
                trial_id),
        }, "ASHA")
        self._log.extend(list(event) for event in state["log"])
        for b in self._brackets:
            b.derive()
        _set_rng_state(self._rng, state["rng"])
