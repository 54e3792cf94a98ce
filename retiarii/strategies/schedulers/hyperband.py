"""Synchronous Hyperband: successive-halving brackets whose trials pause at each milestone."""
from __future__ import annotations

import math

from ...enums import Mode
from .base import (
    Decision, Scheduler, check_state, from_json_float, json_float, metric_value, replay_log,
)


def bracket_plan(max_t: float, eta: float, s: int, s_max: int) -> tuple[int, list[int]]:
    """Size and milestones of bracket ``s``: ``n = ceil((s_max + 1) / (s + 1) * eta ** s)`` trials
    and milestones ``max(1, round(max_t * eta ** (i - s)))`` for ``i = 0..s`` (the last is
    ``max_t``).

    >>> bracket_plan(27, 3, 3, 3)
    (27, [1, 3, 9, 27])
    >>> bracket_plan(27, 3, 2, 3)
    (12, [3, 9, 27])
    """
    n = math.ceil((s_max + 1) / (s + 1) * eta ** s - 1e-9)
    milestones = [max(1, round(max_t * eta ** (i - s))) for i in range(s)] + [max_t]
    return n, milestones


def _rank_key(value: float) -> float:
    return -math.inf if math.isnan(value) else value


class Hyperband(Scheduler):
    """Hyperband (Li et al.) run synchronously: each bracket is successive halving with barriers.

    With ``s_max = floor(log(max_t) / log(eta))`` there are ``s_max + 1`` brackets
    (``brackets`` keeps only the first, most exploratory ones; ``brackets=1`` is plain
    successive halving). Trials are dealt to brackets in the order they are added: bracket
    ``s_max`` takes its ``n`` trials, then ``s_max - 1``, ... and the cycle repeats. Bracket ``s``
    runs rounds ``i = 0..s``; in round ``i`` every live trial trains to milestone ``r_i`` (see
    :func:`bracket_plan` for the rounding). A trial that reaches the milestone before the
    round is over is PAUSED (its worker goes to another trial). When the last one reports, the
    best ``max(1, floor(m / eta))`` of the ``m`` that reported (metric negated for ``"min"``, ties
    by arrival, NaN last) go on: the reporter continues or stops, waiting winners are resumed
    first by :meth:`choose_trial_to_run`, waiting losers are named by :meth:`trials_to_stop`.
    A trial reaching ``max_t`` is STOP (complete). A bracket that will get no more trials (a
    worker is free and nothing else can run) closes its round with the trials it has.
    A result without the metric counts as NaN; without the time attribute it is an error.

    Example:
        >>> hb = Hyperband("acc", "max", max_t=4, reduction_factor=2, brackets=1)
        >>> for t in "abcd": hb.on_trial_add(t, {})
        >>> [hb.on_trial_result(t, {"training_iteration": 1, "acc": a}).name
        ...  for t, a in [("a", .1), ("b", .4), ("c", .3), ("d", .2)]]
        ['PAUSE', 'PAUSE', 'PAUSE', 'STOP']
        >>> hb.trials_to_stop(), hb.choose_trial_to_run(["a", "b", "c"])
        (['a'], 'b')

    Args:
        metric: the result key to compare; mode: ``"min"`` or ``"max"``.
        max_t: the time a surviving trial trains to. reduction_factor: ``eta``.
        brackets: keep only the first ``brackets`` brackets (None: all ``s_max + 1``).
        bracket_size: put this many trials in every bracket instead of ``n`` (with
            ``brackets=1``: successive halving of one whole population, as HyperTrick's paper
            compares it).
        time_attr: the result key that measures progress.
    """

    def __init__(self, metric: str, mode: str = "max", max_t: int = 81, reduction_factor: float = 3,
                 brackets: int | None = None, bracket_size: int | None = None,
                 time_attr: str = "training_iteration"):
        mode = Mode.parse(mode, type(self).__name__)
        self.sign = mode.sign
        if not reduction_factor > 1:
            raise ValueError(f"reduction_factor must be > 1, got {reduction_factor}")
        if not max_t >= 1:
            raise ValueError(f"max_t must be >= 1, got {max_t}")
        self.metric, self.mode, self.time_attr = metric, mode, time_attr
        self.max_t, self.eta = max_t, reduction_factor
        self.s_max = int(math.floor(math.log(max_t) / math.log(reduction_factor) + 1e-9))
        n_brackets = self.s_max + 1 if brackets is None else brackets
        if not 1 <= n_brackets <= self.s_max + 1:
            raise ValueError(f"brackets must be in 1..{self.s_max + 1} for max_t={max_t} and "
                             f"reduction_factor={reduction_factor}, got {brackets}")
        if bracket_size is not None and bracket_size < 1:
            raise ValueError(f"bracket_size must be >= 1 or None, got {bracket_size}")
        self.bracket_size = bracket_size
        self.cycle = [self.s_max - k for k in range(n_brackets)]
        # each bracket: {"s", "n", "milestones", "round", "live": [ids], "recorded": {id: v},
        #                "promoted": [ids waiting to resume], "closed_rounds": int}
        self._brackets: list[dict] = []
        self._trial_bracket: dict[str, int] = {}
        self._to_stop: list[str] = []
        # The inputs that changed the state above, in order: ["add", trial], ["res", trial,
        # time, value], ["error", trial], ["force"] (rounds closed for lack of trials) and
        # ["taken"] (the stop list handed out). The rules are deterministic, so replaying them
        # rebuilds the state exactly; state_dict saves this log, which only grows at its end
        # (a store writes just what is new after every decision).
        self._log: list[list] = []

    # ---- bracket bookkeeping ------------------------------------------------------------

    def _open_bracket(self) -> dict:
        s = self.cycle[len(self._brackets) % len(self.cycle)]
        n, milestones = bracket_plan(self.max_t, self.eta, s, self.s_max)
        n = self.bracket_size or n
        b = {"s": s, "n": n, "milestones": milestones, "round": 0, "live": [], "recorded": {},
             "promoted": []}
        self._brackets.append(b)
        return b

    def _close_round(self, b: dict) -> list[str]:
        """Judge the current round; returns the winners (others go to the stop list)."""
        recorded = b["recorded"]
        order = sorted(recorded, key=lambda t: -_rank_key(recorded[t]))  # stable: arrival order
        keep = order[: max(1, int(len(order) // self.eta))]
        kept = set(keep)
        losers = [t for t in b["live"] if t not in kept]
        b["live"] = [t for t in b["live"] if t in kept]
        b["recorded"], b["round"] = {}, b["round"] + 1
        self._to_stop.extend(losers)
        return keep

    def _round_done(self, b: dict, force: bool = False) -> bool:
        full = (force or b["round"] > 0 or len(b["live"]) >= b["n"]
                or b is not self._brackets[-1])
        return full and b["live"] and all(t in b["recorded"] for t in b["live"])

    # ---- the scheduler interface --------------------------------------------------------

    def on_trial_add(self, trial_id: str, config: dict) -> None:
        if trial_id in self._trial_bracket:
            return
        self._add(trial_id)

    def _add(self, trial_id: str) -> None:
        self._log.append(["add", trial_id])
        b = self._brackets[-1] if self._brackets else None
        if b is None or len(b["live"]) >= b["n"] or b["round"] > 0:
            b = self._open_bracket()
        b["live"].append(trial_id)
        self._trial_bracket[trial_id] = len(self._brackets) - 1

    def on_trial_result(self, trial_id: str, result: dict) -> Decision:
        if self.time_attr not in result:
            raise ValueError(f"Hyperband needs {self.time_attr!r} in every result, got keys "
                             f"{sorted(result)}")
        if trial_id not in self._trial_bracket:
            self.on_trial_add(trial_id, {})
        if trial_id not in self._brackets[self._trial_bracket[trial_id]]["live"]:
            return Decision.STOP  # already eliminated
        return self._result(trial_id, result[self.time_attr],
                            self.sign * metric_value(result, self.metric))

    def _result(self, trial_id: str, time: float, value: float) -> Decision:
        """A result of a live trial: ``value`` is signed (higher is better)."""
        self._log.append(["res", trial_id, time, json_float(value)])
        b = self._brackets[self._trial_bracket[trial_id]]
        if trial_id in b["promoted"]:
            b["promoted"].remove(trial_id)
        if time >= self.max_t:
            return Decision.STOP
        if time < b["milestones"][b["round"]] or trial_id in b["recorded"]:
            return Decision.CONTINUE
        b["recorded"][trial_id] = value
        if not self._round_done(b):
            return Decision.PAUSE
        keep = self._close_round(b)
        b["promoted"].extend(t for t in keep if t != trial_id)
        if trial_id in keep:
            return Decision.CONTINUE
        self._to_stop.remove(trial_id)  # the reporter is stopped by the decision itself
        return Decision.STOP

    def on_trial_error(self, trial_id: str) -> None:
        if trial_id not in self._trial_bracket:
            return
        self._log.append(["error", trial_id])
        b = self._brackets[self._trial_bracket[trial_id]]
        for key in ("live", "promoted"):
            if trial_id in b[key]:
                b[key].remove(trial_id)
        b["recorded"].pop(trial_id, None)
        if self._round_done(b):
            b["promoted"].extend(self._close_round(b))

    def choose_trial_to_run(self, candidates: list[str]) -> str | None:
        pick = self._runnable(candidates)
        if pick is None and self._force_close():  # nothing else can run: close rounds that
            pick = self._runnable(candidates)     # will get no more trials
        return pick

    def _force_close(self) -> bool:
        """Close every round that is complete with the trials it has; whether any was."""
        closing = [b for b in self._brackets if self._round_done(b, force=True)]
        if closing:
            self._log.append(["force"])
        for b in self._brackets:
            if self._round_done(b, force=True):
                b["promoted"].extend(self._close_round(b))
        return bool(closing)

    def _runnable(self, candidates: list[str]) -> str | None:
        allowed = set(candidates) - set(self._to_stop)
        for b in self._brackets:  # resume promoted trials first, oldest bracket first
            for t in b["promoted"]:
                if t in allowed:
                    return t
        for t in candidates:
            if t not in allowed:
                continue
            if t not in self._trial_bracket:
                return t  # unknown to us: FIFO
            b = self._brackets[self._trial_bracket[t]]
            if t in b["live"] and t not in b["recorded"]:
                return t
        return None

    def trials_to_stop(self) -> list[str]:
        out, self._to_stop = self._to_stop, []
        if out:
            self._log.append(["taken"])
        return out

    def state_dict(self) -> dict:
        """``{"kind", "log", "append_only": ["log"]}``: the inputs that changed the state (see
        ``__init__``), replayed by :meth:`load_state_dict`."""
        return {"kind": "Hyperband", "log": list(self._log), "append_only": ["log"]}

    def load_state_dict(self, state: dict) -> None:
        check_state(state, "Hyperband")
        self._brackets, self._trial_bracket, self._to_stop, self._log = [], {}, [], []
        replay_log(state["log"], {
            "add": self._add,
            "res": lambda trial_id, time, value: self._result(trial_id, time,
                                                              from_json_float(value)),
            "error": self.on_trial_error,
            "force": self._force_close,
            "taken": self.trials_to_stop,
        }, "Hyperband")
