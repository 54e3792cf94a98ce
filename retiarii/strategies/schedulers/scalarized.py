"""Any scheduler of one metric (median stopping, HyperTrick, ASHA) over a stated scalarization
of several objectives: it sees one number per result, the scalarization's."""
from __future__ import annotations

import math

from ...enums import Mode
from ...scalarization import MnasNetReward, WeightedSum, scalarization_from_json
from .base import Decision, Scheduler, Spawn, check_state


class Scalarized(Scheduler):
    """Runs ``scheduler`` on ``scalarization`` of each result, written under the scheduler's
    metric: several objectives early-stopped by a rule of one, with the rule stated.

    The wrapped scheduler must maximize its metric (a scalarization is higher-is-better).
    An objective missing from a result is read from the trial's ``costs`` (measured by the
    engine when it proposed the model, in the trial's config), so ``latency_ms`` need not be
    reported; a result the scalarization cannot score (a metric missing) reaches the
    scheduler without its metric, which ignores it. Every other call is passed through.

    Example:
        >>> from retiarii.strategies import MedianStopping
        >>> from retiarii.scalarization import MnasNetReward
        >>> s = Scalarized(MedianStopping("reward", "max", min_samples_required=2),
        ...                MnasNetReward("acc", "ms", target=2.0, alpha=0.0, beta=-1.0))
        >>> for t, acc, ms in [("a", 0.9, 1.0), ("b", 0.8, 2.0), ("c", 0.95, 8.0)]:
        ...     s.on_trial_add(t, {"costs": {"ms": ms}})
        ...     d = s.on_trial_result(t, {"training_iteration": 1, "acc": acc})
        >>> d.name     # c's reward 0.95 * 2 / 8 = 0.24 is below the median 0.85 of a and b
        'STOP'

    Args:
        scheduler: a scheduler of one metric, built with ``mode="max"``; its ``metric`` is
            the name the scalar is written under.
        scalarization: :class:`~retiarii.scalarization.MnasNetReward` or
            :class:`~retiarii.scalarization.WeightedSum`.
    """

    def __init__(self, scheduler: Scheduler, scalarization: MnasNetReward | WeightedSum):
        if not isinstance(scheduler, Scheduler) or not isinstance(
                getattr(scheduler, "metric", None), str):
            raise ValueError(f"Scalarized: give a scheduler of one metric (MedianStopping, "
                             f"HyperTrick, ASHA...), got {scheduler!r}")
        if getattr(scheduler, "mode", Mode.MAX) is not Mode.MAX:
            raise ValueError(f"Scalarized: build {type(scheduler).__name__} with mode='max': "
                             f"the scalarization is higher-is-better")
        if not isinstance(scalarization, (MnasNetReward, WeightedSum)):
            raise ValueError(f"Scalarized: scalarization must be a MnasNetReward or a "
                             f"WeightedSum, got {scalarization!r}")
        self.inner, self.scalarization = scheduler, scalarization
        self.spawns_trials = scheduler.spawns_trials
        self.checkpoints_shared = scheduler.checkpoints_shared
        self._costs: dict[str, dict] = {}  # trial -> the costs the scalarization reads

    def _scalar(self, trial_id: str, result: dict) -> dict:
        out = {k: v for k, v in result.items() if k != self.inner.metric}
        value = self.scalarization({**self._costs.get(trial_id, {}), **result})
        if math.isfinite(value):
            out[self.inner.metric] = value
        return out

    def on_trial_add(self, trial_id: str, config: dict) -> None:
        costs = {k: v for k, v in (config.get("costs") or {}).items()
                 if k in self.scalarization.metrics}
        if costs:
            self._costs[trial_id] = costs
        self.inner.on_trial_add(trial_id, config)

    def on_trial_result(self, trial_id: str, result: dict) -> Decision:
        return self.inner.on_trial_result(trial_id, self._scalar(trial_id, result))

    def on_trial_complete(self, trial_id: str, result: dict) -> None:
        self.inner.on_trial_complete(trial_id, self._scalar(trial_id, result))

    def on_trial_error(self, trial_id: str) -> None:
        self.inner.on_trial_error(trial_id)

    def choose_trial_to_run(self, candidates: list[str]) -> str | None:
        return self.inner.choose_trial_to_run(candidates)

    def next_spawn(self) -> Spawn | None:
        return self.inner.next_spawn()

    def trials_to_stop(self) -> list[str]:
        return self.inner.trials_to_stop()

    def deletable_checkpoints(self, checkpoints, states, keep_lineage_of=None) -> set[str]:
        return self.inner.deletable_checkpoints(checkpoints, states, keep_lineage_of)

    def state_dict(self) -> dict:
        return {"kind": "Scalarized", "scalarization": self.scalarization.to_json(),
                "costs": dict(self._costs), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_state(state, "Scalarized")
        if scalarization_from_json(state["scalarization"]) != self.scalarization:
            raise ValueError(f"saved Scalarized state scalarizes by {state['scalarization']}, "
                             f"this one by {self.scalarization.to_json()}: build it with the "
                             f"same scalarization")
        self._costs = {k: dict(v) for k, v in state["costs"].items()}
        self.inner.load_state_dict(state["inner"])
