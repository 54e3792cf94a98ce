"""MOASHA: asynchronous successive halving that promotes by non-dominated rank (Schmucker et
al., "Multi-objective Asynchronous Successive Halving", 2021), over several objectives."""
from __future__ import annotations

import base64
import math

import numpy as np

from ...enums import Mode
from ...objectives import nsga_keys
from .asha import rung_milestones
from .base import Decision, Scheduler, check_state, from_json_float, json_float, replay_log


def nsga_order(points: list[tuple[float, ...]]) -> list[int]:
    """Indices of ``points`` (to minimize) best first: by non-dominated rank, then by crowding
    distance within the front (larger first), then by index (arrival). A point with a NaN
    objective comes after every point without one.

    Example:
        >>> nsga_order([(2.0, 2.0), (0.0, 4.0), (1.0, 2.5), (4.0, 0.0), (3.0, 3.0)])
        [1, 3, 0, 2, 4]

    (the front's ends first; then (2, 2), crowding 3/4 + 5/8, before (1, 2.5), 1/2 + 1/2;
    (3, 3), dominated, last)
    """
    clean = [i for i, p in enumerate(points) if not any(math.isnan(x) for x in p)]
    keys = nsga_keys([points[i] for i in clean])
    ranked = sorted(range(len(clean)), key=lambda k: (keys[k], clean[k]))
    return [clean[k] for k in ranked] + [i for i in range(len(points)) if i not in set(clean)]


class _Rungs:
    """One bracket's rungs, highest milestone first: ``recorded[i]`` maps a trial to its point
    at milestone ``milestones[i]`` (in arrival order), ``promoted[i]`` the trials promoted
    out of rung ``i``. Plain numbers: tests drive it without a runner."""

    def __init__(self, milestones: list, reduction_factor: float):
        self.milestones, self.rf = milestones, reduction_factor
        self.recorded: list[dict[str, tuple]] = [{} for _ in milestones]
        self.promoted: list[set[str]] = [set() for _ in milestones]

    def rung_of(self, time: float, trial_id: str) -> int | None:
        """The highest rung ``time`` passed, if the trial is not recorded there yet."""
        for index, milestone in enumerate(self.milestones):
            if time >= milestone:
                return None if trial_id in self.recorded[index] else index
        return None

    def top(self, index: int, share: int | None = None) -> list[str]:
        """The best ``floor(n / rf)`` trials of rung ``index`` (``share``: that many), best
        first by :func:`nsga_order`."""
        trials = list(self.recorded[index])
        n = int(len(trials) // self.rf) if share is None else share
        order = nsga_order([self.recorded[index][t] for t in trials])
        return [trials[i] for i in order[:n]]

    def promotable(self, index: int) -> list[str]:
        return [t for t in self.top(index) if t not in self.promoted[index]]


class MOASHA(Scheduler):
    """ASHA over several objectives: a rung keeps the trials of the lowest non-dominated rank
    (crowding distance breaking ties within a front) instead of the best values of one metric.

    Milestones and brackets are ASHA's (:func:`~retiarii.strategies.schedulers.asha.rung_milestones`;
    several brackets make it asynchronous Hyperband, a trial's bracket drawn with
    probability ``softmax(number of rungs)`` from ``numpy.random.RandomState(seed)``).

    Promotion-based (default, Li et al.'s ASHA): a trial reaching a milestone is recorded
    there with its objectives and PAUSED; when a worker is free the best unpromoted trial
    among the top ``floor(n / rf)`` of the highest rung that has one (:func:`nsga_order`) is
    resumed, else a new trial starts. ``max_t`` completes a trial. Stop-based
    (``promotion=False``): a trial reaching a milestone continues when it is among the top
    ``ceil(n / rf)`` of the ``n`` recorded there, itself included, and is stopped otherwise.

    An objective missing from a result is read from the trial's ``costs`` (the costs the
    engine measured for its model when it proposed it, given in the trial's config), so
    ``latency_ms`` or ``params`` need not be reported by the trainer.

    Example:
        >>> s = MOASHA(["acc", "ms"], ["max", "min"], grace_period=1, max_t=9,
        ...            reduction_factor=3)
        >>> for t, acc, ms in [("a", 0.9, 5.0), ("b", 0.5, 9.0), ("c", 0.6, 1.0)]:
        ...     s.on_trial_add(t, {"costs": {"ms": ms}})
        ...     _ = s.on_trial_result(t, {"training_iteration": 1, "acc": acc})
        >>> s.choose_trial_to_run(["b", "c", "a"])  # a and c on the front: floor(3/3)=1 kept
        'a'

    Args:
        metric: the objectives' result keys (or costs); mode: each one's ``"min"`` or
            ``"max"`` (one mode: every objective's).
        grace_period, max_t, reduction_factor, brackets, time_attr: as :class:`ASHA`.
        promotion: pause at rungs and promote (default), or stop early.
        seed: seeds the bracket draw.
    """

    def __init__(self, metric: list[str], mode: list[str] | str = "max",
                 grace_period: float = 1, max_t: float = 100, reduction_factor: float = 4,
                 brackets: int = 1, time_attr: str = "training_iteration",
                 promotion: bool = True, seed: int | None = None):
        metrics = [metric] if isinstance(metric, str) else list(metric)
        if len(metrics) < 2:
            raise ValueError(f"MOASHA ranks several objectives: give metric=[two names or "
                             f"more] (got {metric!r}); for one metric use ASHA")
        modes = [mode] * len(metrics) if isinstance(mode, (str, Mode)) else list(mode)
        if len(modes) != len(metrics):
            raise ValueError(f"MOASHA: one mode per metric ({len(metrics)}), got {mode!r}")
        self.signs = [Mode.parse(m, "MOASHA").sign for m in modes]
        if not max_t > 0 or not grace_period > 0 or max_t < grace_period:
            raise ValueError(f"need 0 < grace_period <= max_t, got grace_period={grace_period}, "
                             f"max_t={max_t}")
        if not reduction_factor > 1:
            raise ValueError(f"reduction_factor must be > 1, got {reduction_factor}")
        if brackets < 1:
            raise ValueError(f"brackets must be >= 1, got {brackets}")
        self.metrics, self.modes, self.time_attr = list(metrics), modes, time_attr
        self.max_t, self.rf, self.promotion = max_t, reduction_factor, promotion
        self._brackets = [_Rungs(rung_milestones(grace_period, max_t, reduction_factor, s),
                                 reduction_factor) for s in range(brackets)]
        self._trials: dict[str, tuple[int, dict]] = {}  # trial -> (bracket, its costs)
        self._dead: set[str] = set()
        # Every change, in order (state_dict saves it; it only grows at its end):
        # ["add", trial, bracket, costs], ["rec", bracket, rung, trial, point], ["promote",
        # bracket, rung, trial], ["dead", trial].
        self._log: list[list] = []
        self._rng = np.random.RandomState(seed)

    def point(self, trial_id: str, result: dict) -> tuple[float, ...]:
        """The trial's objectives in ``result`` (or its costs) as a point to minimize; NaN
        where one is missing."""
        costs = self._trials[trial_id][1]
        out = []
        for metric, sign in zip(self.metrics, self.signs):
            value = result.get(metric, costs.get(metric))
            out.append(math.nan if value is None else -sign * float(value))
        return tuple(out)

    def on_trial_add(self, trial_id: str, config: dict) -> None:
        if trial_id in self._trials:
            return
        bracket = 0
        if len(self._brackets) > 1:
            sizes = np.array([len(b.milestones) for b in self._brackets])
            probs = np.e ** (sizes - sizes.max())
            bracket = int(self._rng.choice(len(sizes), p=probs / probs.sum()))
        costs = {k: v for k, v in (config.get("costs") or {}).items() if k in self.metrics}
        self._add(trial_id, bracket, costs)

    def _add(self, trial_id: str, bracket: int, costs: dict) -> None:
        self._trials[trial_id] = (bracket, costs)
        self._log.append(["add", trial_id, bracket, costs])

    def _record(self, bracket: int, rung: int, trial_id: str, point) -> None:
        self._brackets[bracket].recorded[rung][trial_id] = tuple(point)
        self._log.append(["rec", bracket, rung, trial_id, [json_float(x) for x in point]])

    def _promote(self, bracket: int, rung: int, trial_id: str) -> None:
        self._brackets[bracket].promoted[rung].add(trial_id)
        self._log.append(["promote", bracket, rung, trial_id])

    def on_trial_result(self, trial_id: str, result: dict) -> Decision:
        if self.time_attr not in result:
            return Decision.CONTINUE
        time = result[self.time_attr]
        if time >= self.max_t:
            return Decision.STOP
        if trial_id not in self._trials:
            self.on_trial_add(trial_id, {})
        bracket = self._trials[trial_id][0]
        rungs = self._brackets[bracket]
        rung = rungs.rung_of(time, trial_id)
        if rung is None:
            return Decision.CONTINUE
        self._record(bracket, rung, trial_id, self.point(trial_id, result))
        if self.promotion:
            return Decision.PAUSE
        share = math.ceil(len(rungs.recorded[rung]) / self.rf)
        return Decision.CONTINUE if trial_id in rungs.top(rung, share) else Decision.STOP

    def on_trial_error(self, trial_id: str) -> None:
        if trial_id not in self._dead:
            self._dead.add(trial_id)
            self._log.append(["dead", trial_id])

    def choose_trial_to_run(self, candidates: list[str]) -> str | None:
        if not self.promotion:
            return super().choose_trial_to_run(candidates)
        allowed = set(candidates) - self._dead
        rungs = sorted(((m, b, r) for b, rs in enumerate(self._brackets)
                        for r, m in enumerate(rs.milestones)), key=lambda x: -x[0])
        for _, b, r in rungs:
            for trial_id in self._brackets[b].promotable(r):
                if trial_id in allowed:
                    self._promote(b, r, trial_id)
                    return trial_id
        waiting = {t for rs in self._brackets for rec, pro in zip(rs.recorded, rs.promoted)
                   for t in rec if t not in pro}
        for trial_id in candidates:  # a new trial (one never recorded at a rung)
            if trial_id in allowed and trial_id not in waiting:
                return trial_id
        return None

    def state_dict(self) -> dict:
        return {"kind": "MOASHA", "brackets": len(self._brackets), "metrics": self.metrics,
                "log": list(self._log), "append_only": ["log"], "rng": _rng_words(self._rng)}

    def load_state_dict(self, state: dict) -> None:
        check_state(state, "MOASHA")
        if state["brackets"] != len(self._brackets) or state["metrics"] != self.metrics:
            raise ValueError(f"saved MOASHA state has {state['brackets']} brackets over "
                             f"{state['metrics']}, this one {len(self._brackets)} over "
                             f"{self.metrics}: build it with the same arguments")
        self._log, self._trials, self._dead = [], {}, set()
        for rs in self._brackets:
            rs.recorded = [{} for _ in rs.milestones]
            rs.promoted = [set() for _ in rs.milestones]
        replay_log(state["log"], {
            "add": self._add,
            "rec": lambda b, r, t, p: self._record(b, r, t, [from_json_float(x) for x in p]),
            "promote": self._promote,
            "dead": self.on_trial_error,
        }, "MOASHA")
        _set_rng_words(self._rng, state["rng"])


def _rng_words(rng: np.random.RandomState) -> list:
    """The generator's state with its 624 words as base64 (saved after every decision)."""
    kind, keys, pos, has_gauss, gauss = rng.get_state()
    words = base64.b64encode(np.asarray(keys, dtype="<u4").tobytes()).decode("ascii")
    return [kind, words, int(pos), int(has_gauss), float(gauss)]


def _set_rng_words(rng: np.random.RandomState, state: list) -> None:
    kind, words, pos, has_gauss, gauss = state
    keys = np.frombuffer(base64.b64decode(words), dtype="<u4").astype(np.uint32)
    rng.set_state((kind, keys, pos, has_gauss, gauss))
