"""The median stopping rule (Google Vizier), deciding exactly as Ray Tune's ``MedianStoppingRule``.
"""
from __future__ import annotations

import numpy as np

from ...enums import Mode
from .base import Decision, Scheduler, check_state, from_json_float, json_float, replay_log


def _running_mean(history: list[tuple[float, float]], grace_period: float, time: float) -> float:
    """Mean of the metric over results with ``grace_period <= t <= time``; NaN if none."""
    scoped = [m for t, m in history if grace_period <= t <= time]
    return float(np.mean(scoped)) if scoped else float("nan")


class MedianStopping(Scheduler):
    """Stop a trial whose best result so far is worse than the median of its peers' running means.

    At a result with time ``t >= grace_period`` the trial is compared with every *other* trial
    whose latest result is at time ``>= t``. For each such peer the running mean of its metric
    over its results with ``grace_period <= time <= t`` is taken; non-finite means are dropped.
    With fewer than ``min_samples_required`` means left the trial continues. Otherwise the
    trial's best metric over all its results (``min``/``max`` of Python, so a NaN first value
    poisons it as it does in Ray) is compared with ``np.median`` of the means (the average of
    the two middle values for an even count). The cutoff is strict: a trial exactly at the
    median continues; a NaN best is stopped.

    Numeric conventions are Ray Tune's (``ray.tune.schedulers.MedianStoppingRule``), so both
    decide identically on the same stream of results, including the result that Ray (and our
    runner) append again through ``on_trial_complete``. A trial once stopped with
    ``hard_stop=False`` is PAUSED, and continues unconditionally when resumed. One deliberate
    difference: when samples are insufficient Ray may ask the trial to yield (PAUSE) if other
    trials wait and ``min_time_slice`` has passed; this rule always continues, which is Ray's
    decision whenever no other trial waits. Results without the time attribute or the metric
    are ignored (CONTINUE).

    Example:
        >>> s = MedianStopping("loss", "min", grace_period=1, min_samples_required=2)
        >>> for tid, loss in [("a", 1.0), ("b", 2.0), ("c", 3.0)]:
        ...     d = s.on_trial_result(tid, {"training_iteration": 1, "loss": loss})
        >>> d.name            # median of a and b is 1.5 and c's best is 3.0
        'STOP'

    Args:
        metric: the result key to compare.
        mode: ``"min"`` or ``"max"``.
        grace_period: never stop before this time; running means start here.
        min_samples_required: the fewest peer means to take a median of.
        hard_stop: STOP a losing trial if true, PAUSE it otherwise.
        time_attr: the result key that measures progress (``training_iteration`` or
            ``time_total_s``).
    """

    def __init__(self, metric: str, mode: str = "max", grace_period: float = 1.0,
                 min_samples_required: int = 3, hard_stop: bool = True,
                 time_attr: str = "training_iteration"):
        mode = Mode.parse(mode, type(self).__name__)
        self.sign = mode.sign
        if min_samples_required < 1:
            raise ValueError(f"min_samples_required must be >= 1, got {min_samples_required}")
        self.metric, self.mode, self.time_attr = metric, mode, time_attr
        self.grace_period = grace_period
        self.min_samples_required = min_samples_required
        self.hard_stop = hard_stop
        self._results: dict[str, list[tuple[float, float]]] = {}  # trial -> [(time, metric)]
        self._stopped: set[str] = set()
        # Every change of the two above, in order: ["r", trial, time, metric], ["stop", trial].
        # state_dict saves it: it only grows at its end, so a store writes just what is new.
        self._log: list[list] = []
        # (peer, time) -> (length of the peer's history, its running mean up to time): a peer
        # that reported nothing new since keeps its mean (most peers have finished or paused).
        self._means: dict[tuple[str, float], tuple[int, float]] = {}

    def _mean(self, peer: str, time: float) -> float:
        history = self._results[peer]
        hit = self._means.get((peer, time))
        if hit is not None and hit[0] == len(history):
            return hit[1]
        mean = _running_mean(history, self.grace_period, time)
        self._means[(peer, time)] = (len(history), mean)
        return mean

    def _append(self, trial_id: str, time: float, value: float) -> None:
        self._results.setdefault(trial_id, []).append((time, value))
        self._log.append(["r", trial_id, json_float(time), json_float(value)])

    def _best(self, trial_id: str) -> float:
        # Python's min/max on purpose: identical to Ray, NaN handling included.
        values = [m for _, m in self._results[trial_id]]
        return max(values) if self.mode is Mode.MAX else min(values)

    def on_trial_result(self, trial_id: str, result: dict) -> Decision:
        if self.time_attr not in result or self.metric not in result:
            return Decision.CONTINUE
        if trial_id in self._stopped:
            return Decision.CONTINUE  # only reachable with hard_stop=False: resumed, runs FIFO
        time = float(result[self.time_attr])
        self._append(trial_id, time, float(result[self.metric]))
        if time < self.grace_period:
            return Decision.CONTINUE
        peers = [t for t, h in self._results.items() if t != trial_id and h[-1][0] >= time]
        means = [m for m in (self._mean(p, time) for p in peers) if np.isfinite(m)]
        if len(means) < self.min_samples_required:
            return Decision.CONTINUE
        median, best = np.median(means), self._best(trial_id)
        compare = max if self.mode is Mode.MAX else min
        if compare(median, best) != best:
            self._stopped.add(trial_id)
            self._log.append(["stop", trial_id])
            return Decision.STOP if self.hard_stop else Decision.PAUSE
        return Decision.CONTINUE

    def on_trial_complete(self, trial_id: str, result: dict) -> None:
        # Ray appends the final result once more; so do we (it weighs in the running mean).
        if self.time_attr in result and self.metric in result:
            self._append(trial_id, float(result[self.time_attr]), float(result[self.metric]))

    def state_dict(self) -> dict:
        """``{"kind", "log", "append_only": ["log"]}``: the log of changes (see ``__init__``),
        replayed by :meth:`load_state_dict`."""
        return {"kind": "MedianStopping", "log": list(self._log), "append_only": ["log"]}

    def load_state_dict(self, state: dict) -> None:
        check_state(state, "MedianStopping")
        self._results, self._stopped, self._log, self._means = {}, set(), [], {}
        def stop(trial_id: str) -> None:
            self._stopped.add(trial_id)
            self._log.append(["stop", trial_id])

        replay_log(state["log"], {
            "r": lambda trial_id, time, value: self._append(trial_id, from_json_float(time),
                                                            from_json_float(value)),
            "stop": stop,
        }, "MedianStopping")
