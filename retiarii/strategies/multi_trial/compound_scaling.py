"""EfficientNet's two steps (Tan & Le, ICML 2019): search the baseline with MnasNet's
multi-objective RL, then, the baseline fixed, a small grid search of the compound scaling
coefficients under ``alpha * beta ** 2 * gamma ** 2 ~= 2``.

Phase 1 proposes ``b0_models`` models through a :class:`~retiarii.strategies.PolicyBasedRL`
(its ``reward``: MnasNet's ``ACC x (FLOPS / T) ** w``, EfficientNet optimizing FLOPs) over
the space with the scaling choices held at their first candidate (coefficients 1: the
baseline's own size). Once every phase-1 model is told, the baseline (B0) is the one of best
reward, and phase 2 proposes B0 at each grid point (:func:`constrained_grid`) of the space's
scaling candidates, a candidate's coefficient being its value over the first one's; the
best of phase 2 by the first objective (accuracy) is the compound-scaled model at phi = 1.

Example::

    s = CompoundScaling(b0_models=8, reward=MnasNetReward("val_acc", "flops", target=4e8))
    # Experiment(space, s, trainer, metric=["val_acc", "flops"], mode=["max", "min"])
"""
from __future__ import annotations

from typing import Any

from ...sampler import sample_key
from .base import Draw, SpaceExhausted, Strategy
from .rl import PolicyBasedRL

__all__ = ["CompoundScaling", "constrained_grid"]

SCALING = ("scaling/depth", "scaling/width", "scaling/resolution")


def constrained_grid(alphas, betas, gammas, target: float = 2.0, tolerance: float = 0.1
                     ) -> list[tuple[float, float, float]]:
    """The (alpha, beta, gamma) of the grid, each >= 1, with ``alpha * beta**2 * gamma**2``
    within ``tolerance * target`` of ``target`` (EfficientNet: 2, twice the FLOPs per phi).

    Example:
        >>> constrained_grid([1.0, 1.2], [1.0, 1.1], [1.0, 1.15])
        [(1.2, 1.1, 1.15)]
    """
    return [(a, b, g) for a in alphas for b in betas for g in gammas
            if min(a, b, g) >= 1 and abs(a * b * b * g * g - target) <= tolerance * target]


class _Fixed:
    """A space whose ``fixed`` labels always take the given candidate index."""

    def __init__(self, space: Any, fixed: dict[str, int]):
        self.space, self.fixed = space, fixed

    def sample(self, sampler: Any):
        outer = self

        class _Pin:
            def choose(self, label, candidates, context):
                if label in outer.fixed:
                    return outer.fixed[label]
                return sampler.choose(label, candidates, context)

        return self.space.sample(_Pin())

    def size(self):
        return self.space.size()


class _Candidates:
    """Every choice at its first candidate, recording each label's candidates."""

    def __init__(self):
        self.seen: dict[str, list] = {}

    def choose(self, label, candidates, context):
        self.seen.setdefault(label, list(candidates))
        return 0


class CompoundScaling(Strategy):
    """Baseline search by MnasNet's RL, then the grid of compound coefficients; see the
    module docstring.

    Args:
        b0_models: phase 1's models (the baseline's search).
        reward: phase 1's scalarization of the objectives
            (:class:`~retiarii.scalarization.MnasNetReward` over accuracy and FLOPs).
        scaling: the space's depth, width and resolution labels.
        target, tolerance: the grid's constraint (``alpha * beta^2 * gamma^2`` within
            ``tolerance * target`` of ``target``).
        rl: further settings of phase 1's :class:`PolicyBasedRL`.
        seed, mode, ...: see :class:`~retiarii.strategies.Strategy`.
    """

    multi_objective = True

    def __init__(self, *, b0_models: int = 8, reward: Any = None, scaling=SCALING,
                 target: float = 2.0, tolerance: float = 0.1, rl: dict | None = None,
                 seed: int | None = None, **common: Any):
        super().__init__(seed=seed, **common)
        if isinstance(b0_models, bool) or not isinstance(b0_models, int) or b0_models < 1:
            raise ValueError(f"CompoundScaling: b0_models must be a positive int, got "
                             f"{b0_models!r}")
        if not (target > 0 and 0 <= tolerance < 1):
            raise ValueError(f"CompoundScaling: target must be > 0 and tolerance in [0, 1), "
                             f"got {target!r}, {tolerance!r}")
        self.b0_models, self.scaling = b0_models, tuple(scaling)
        self.target, self.tolerance, self.rl = float(target), float(tolerance), dict(rl or {})
        self.reward = reward
        self._phase1 = PolicyBasedRL(seed=seed, reward=reward, **self.rl)
        self._b0: dict | None = None  # the baseline, once phase 1 is told
        self._grid: list[tuple[float, float, float]] = []
        self._phase2: list[dict] = []  # the samples phase 2 proposes, in order
        self._phase1_told: list[list] = []  # [sample, value] of phase 1, in tell order

    def use_objectives(self, modes, names=None):
        super().use_objectives(modes, names)
        self._phase1.use_objectives(modes, names)

    def phase(self) -> int:
        """1 while the baseline is searched, 2 once it is fixed."""
        return 1 if self._b0 is None else 2

    def _propose(self, space: Any) -> Draw:
        seen = _Candidates()
        space.sample(seen)
        missing = [label for label in self.scaling if label not in seen.seen]
        if missing:
            raise ValueError(f"CompoundScaling: the space has no choice {missing}; give "
                             f"scaling= its depth, width and resolution labels")
        if self._phase1.num_proposed < self.b0_models:
            sample = self._phase1.ask(_Fixed(space, {label: 0 for label in self.scaling}))
            return Draw(sample, None)
        if self._b0 is None:
            self._fix_b0(seen.seen)  # raises SpaceExhausted while phase 1 is pending
        for sample in self._phase2:
            if sample_key(sample) not in self._records:
                return Draw(dict(sample), None, parent=dict(self._b0))
        raise SpaceExhausted(f"CompoundScaling: the {len(self._phase2)} grid points of the "
                             f"baseline are proposed")

    def _fix_b0(self, candidates: dict[str, list]) -> None:
        told = self._phase1_told
        if len(told) < self._phase1.num_proposed:
            raise SpaceExhausted("CompoundScaling: the baseline's search has models in "
                                 "flight; the scaling search starts once they are told")
        if not any(v is not None for _, v in told):
            raise SpaceExhausted("CompoundScaling: every model of the baseline's search "
                                 "failed; nothing to scale")
        self._b0 = dict(max(((s, v) for s, v in told if v is not None),
                            key=lambda sv: self._reward_of(sv[1]))[0])
        coeffs = [[float(c) / float(cands[0]) for c in cands]
                  for cands in (candidates[label] for label in self.scaling)]
        self._grid = constrained_grid(*coeffs, target=self.target, tolerance=self.tolerance)
        self._phase2 = []
        for triple in self._grid:
            keys = [candidates[label][c.index(v)] for label, c, v in
                    zip(self.scaling, coeffs, triple)]
            self._phase2.append({**self._b0, **dict(zip(self.scaling, keys))})

    def _reward_of(self, value: Any) -> float:
        if self.reward is None or not isinstance(value, (list, tuple)):
            return float(value[0] if isinstance(value, (list, tuple)) else value)
        names = self.objective_names or self.reward.metrics
        return float(self.reward(dict(zip(names, value))))

    def tell(self, sample: dict, value: Any, violation: float = 0.0) -> None:
        super().tell(sample, value, violation)
        if self._b0 is None:  # a phase-1 model: the controller learns from it
            self._phase1.tell(sample, value, violation)
            self._phase1_told.append([dict(sample), value])

    def best(self) -> tuple[dict, Any] | None:
        """The best scaled model (phase 2) by the first objective."""
        told = [(k, v) for k, v in self._told if v is not None
                and k in {sample_key(s) for s in self._phase2}]
        if not told:
            return None
        sign = self.mode.sign if self.objectives is None else self.objectives[0].sign
        key, value = max(told, key=lambda kv: sign * (
            kv[1][0] if isinstance(kv[1], (list, tuple)) else kv[1]))
        return dict(self._records[key].sample), value

    def selected(self) -> dict | None:
        """The best scaled model (:meth:`best`): what EfficientNet retrains, never a phase-1
        model (None before a phase-2 model is told). A multi-trial strategy with this method
        names its choice: the experiment records it as its result model
        (``engine/storage/result_model.py``), which ``nas run`` retrains."""
        best = self.best()
        return None if best is None else best[0]

    def config(self) -> dict:
        return {**super().config(), "b0_models": self.b0_models, "scaling": list(self.scaling),
                "target": self.target, "tolerance": self.tolerance, "rl": self.rl,
                **({"reward": self.reward.to_json()} if self.reward is not None else {})}

    def _state(self) -> dict:
        return {"phase1": self._phase1.state_dict(), "b0": self._b0,
                "grid": [list(t) for t in self._grid], "phase2": self._phase2,
                "phase1_told": self._phase1_told}

    def _load_state(self, state: dict) -> None:
        self._phase1.load_state_dict(state["phase1"])
        self._b0 = state["b0"]
        self._grid = [tuple(t) for t in state["grid"]]
        self._phase2 = [dict(s) for s in state["phase2"]]
        self._phase1_told = [list(sv) for sv in state["phase1_told"]]
