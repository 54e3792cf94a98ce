"""HyperTrick (Heinrich & Frosio): asynchronous early termination without pausing."""
from __future__ import annotations

import math

import numpy as np

from ...enums import Mode
from .base import (
    Decision, Scheduler, check_state, from_json_float, json_float, metric_value,
)


def dcm_threshold(num_workers: int, eviction_rate: float, phase: int) -> int:
    """How many trials end phase ``phase`` (0-based) in data-collection mode.

    ``floor(W0 (1 - sqrt r) (1 - r) ** phase)`` (Eq. 2 of the paper, rounded down; a 1e-9
    slack absorbs float error so exact integers stay exact).

    >>> [dcm_threshold(16, 0.25, p) for p in range(3)]   # the paper's toy: 8, 6, 4
    [8, 6, 4]
    """
    return int(math.floor(
        num_workers * (1 - math.sqrt(eviction_rate)) * (1 - eviction_rate) ** phase + 1e-9))


def expected_completion_rate(num_phases: int, eviction_rate: float) -> float:
    """E[alpha] = (1 - (1 - r) ** Np) / (r Np): the expected fraction of phases run (Eq. 1)."""
    r = eviction_rate
    return (1 - (1 - r) ** num_phases) / (r * num_phases)


def min_completion_rate(num_phases: int, eviction_rate: float) -> float:
    """min[alpha] = (1 - sqrt r)(1 - (1 - r) ** Np) / (r Np) (Eq. 8, unrounded thresholds)."""
    r = eviction_rate
    return (1 - math.sqrt(r)) * expected_completion_rate(num_phases, r)


class HyperTrick(Scheduler):
    """Terminate trials that end a phase late *and* badly; never pause.

    Phase ``p`` (0-based) ends when a trial's time reaches ``(p + 1) * phase_length``. The
    first :func:`dcm_threshold` (``floor``) trials to end phase ``p`` continue unconditionally
    (data-collection mode). Every later one is in worker-selection mode: its value (negated for
    ``"min"``) is compared with the ``sqrt(r)`` quantile (``np.quantile``, linear
    interpolation) of the finite values recorded at phase ``p``, its own included, and it is
    stopped if strictly below it; a NaN or missing metric is stopped. The last phase is not
    judged: reaching it is STOP (complete). A trial that jumps several phase ends in one result
    is judged at the highest. At most ``num_workers`` (``W0``) trials are started
    (:meth:`choose_trial_to_run` returns None after that), as in Algorithm 1.

    Example:
        >>> ht = HyperTrick("score", "max", num_workers=16, num_phases=4, eviction_rate=0.25)
        >>> ht.dcm_threshold(2), round(ht.expected_completion_rate(), 4)
        (4, 0.6836)

    Args:
        metric: the result key to compare; mode: ``"min"`` or ``"max"``.
        num_workers: ``W0``, the number of trials the search starts.
        num_phases: ``N_p``; a trial that ends all phases is complete.
        eviction_rate: ``r``, the expected fraction terminated after each phase.
        phase_length: time units (steps by default) per phase.
        time_attr: the result key that measures progress.
    """

    def __init__(self, metric: str, mode: str = "max", num_workers: int = 16, num_phases: int = 4,
                 eviction_rate: float = 0.25, phase_length: float = 1,
                 time_attr: str = "training_iteration"):
        mode = Mode.parse(mode, type(self).__name__)
        self.sign = mode.sign
        if not 0 < eviction_rate < 1:
            raise ValueError(f"eviction_rate must be in (0, 1), got {eviction_rate}")
        if num_workers < 1 or num_phases < 1 or not phase_length > 0:
            raise ValueError("num_workers and num_phases must be >= 1 and phase_length > 0, got "
                             f"{num_workers}, {num_phases}, {phase_length}")
        self.metric, self.mode, self.time_attr = metric, mode, time_attr
        self.num_workers, self.num_phases = num_workers, num_phases
        self.eviction_rate, self.phase_length = eviction_rate, phase_length
        self._phases: list[dict[str, float]] = [{} for _ in range(num_phases)]
        self._started: dict[str, None] = {}  # ordered set

    def dcm_threshold(self, phase: int) -> int:
        """Trials that end ``phase`` in data-collection mode (see :func:`dcm_threshold`)."""
        return dcm_threshold(self.num_workers, self.eviction_rate, phase)

    def expected_completion_rate(self) -> float:
        return expected_completion_rate(self.num_phases, self.eviction_rate)

    def min_completion_rate(self) -> float:
        return min_completion_rate(self.num_phases, self.eviction_rate)

    def on_trial_result(self, trial_id: str, result: dict) -> Decision:
        if self.time_attr not in result:
            raise ValueError(f"HyperTrick needs {self.time_attr!r} in every result, got keys "
                             f"{sorted(result)}")
        self._started.setdefault(trial_id)
        ended = int(math.floor(result[self.time_attr] / self.phase_length + 1e-9))  # phases done
        if ended >= self.num_phases:
            return Decision.STOP
        phase = ended - 1
        if phase < 0 or trial_id in self._phases[phase]:
            return Decision.CONTINUE
        value = self.sign * metric_value(result, self.metric)
        seen = self._phases[phase]
        in_dcm = len(seen) < self.dcm_threshold(phase)
        seen[trial_id] = value
        if in_dcm:
            return Decision.CONTINUE
        finite = [v for v in seen.values() if math.isfinite(v)]
        if not math.isfinite(value):
            return Decision.STOP
        cut = float(np.quantile(finite, math.sqrt(self.eviction_rate)))
        return Decision.STOP if value < cut else Decision.CONTINUE

    def choose_trial_to_run(self, candidates: list[str]) -> str | None:
        for trial_id in candidates:
            if trial_id in self._started or len(self._started) < self.num_workers:
                self._started.setdefault(trial_id)
                return trial_id
        return None

    def state_dict(self) -> dict:
        return {"kind": "HyperTrick", "started": list(self._started),
                "phases": [{t: json_float(v) for t, v in p.items()} for p in self._phases]}

    def load_state_dict(self, state: dict) -> None:
        check_state(state, "HyperTrick")
        if len(state["phases"]) != self.num_phases:
            raise ValueError(f"saved HyperTrick state has {len(state['phases'])} phases, this "
                             f"one {self.num_phases}: build it with the same arguments")
        self._started = dict.fromkeys(state["started"])
        self._phases = [{t: from_json_float(v) for t, v in p.items()} for p in state["phases"]]
