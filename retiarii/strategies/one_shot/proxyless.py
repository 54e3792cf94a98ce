"""ProxylessNAS (Cai et al., ICLR 2019): binary gates, one path at a time.

The supernet runs in mode ``"binary"`` (:class:`~retiarii.optim.relax.Relaxation`): per choice
one candidate is active, so a weight step trains one sampled path (memory of one path). An
architecture step draws ``paths`` candidates per choice from ``softmax(alpha)`` (2, as the
paper), makes one of them active and computes the others without autograd, and updates the
alphas with the binary-gate estimator ``dL/dalpha_i = sum_j dL/dg_j * p_j (delta_ij - p_i)``
over the drawn candidates; then it shifts the drawn alphas so that their total probability
is what it was (the candidates not drawn keep theirs), as the paper does.

A **latency term**: pass ``latency={label: {candidate key: cost}}`` (milliseconds, FLOPs, any
unit) and ``latency_weight``; the architecture loss becomes
``L_val + latency_weight * sum_label sum_c p_c * cost[label][c]`` (the expected cost,
differentiable in the alphas). Labels left out cost nothing.

Example::

    s = rt.strategies.ProxylessNAS(epochs=10, latency={"cell/op": {"conv": 2.0, "pool": 0.3}},
                                   latency_weight=0.05)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...optim.relax import Relaxation, rescale_drawn
from ...sampler import index_of
from .relaxed_training import RelaxedOneShot

__all__ = ["ProxylessNAS"]


class ProxylessNAS(RelaxedOneShot):
    """Binary-gate relaxation with the ProxylessNAS gradient estimator.

    Args:
        epochs: segments (epochs) of the search.
        paths: candidates drawn per choice in an architecture step (2 in the paper; the number
            of candidates gives the estimator over all of them).
        latency: optional cost table ``{label: {key: cost}}``.
        latency_weight: the cost term's factor in the architecture loss.
        arch_lr, arch_weight_decay, arch_betas, grad_clip, seed: see
            :class:`~retiarii.strategies.one_shot.relaxed_training.RelaxedOneShot`.
    """

    mode = "binary"

    def __init__(self, epochs: int, paths: int = 2, latency: dict | None = None,
                 latency_weight: float = 0.0, arch_lr: float = 1e-3,
                 arch_weight_decay: float = 0.0, arch_betas: tuple = (0.0, 0.999),
                 grad_clip: float | None = 5.0, seed: int = 0):
        super().__init__(epochs, arch_lr, arch_weight_decay, arch_betas, grad_clip, seed)
        if paths < 1:
            raise ValueError(f"paths must be at least 1, got {paths}")
        if latency_weight and not latency:
            raise ValueError("latency_weight is set but no latency table was given "
                             "(latency={label: {candidate key: cost}})")
        self.paths, self.latency_weight = paths, latency_weight
        self.latency = {label: dict(costs) for label, costs in (latency or {}).items()}
        self._costs: dict[str, torch.Tensor] = {}

    def check(self, relaxation: Relaxation) -> None:
        self._costs = {}
        for label, table in self.latency.items():
            if label not in relaxation.keys:
                raise ValueError(f"latency table: label {label!r} is not a choice of the "
                                 f"space; its labels are {relaxation.labels}")
            keys = relaxation.keys[label]
            cost = torch.zeros(len(keys))
            for key, value in table.items():
                i = index_of(keys, key)
                if i is None:
                    raise ValueError(f"latency table: {key!r} is not a candidate of label "
                                     f"{label!r}; its candidates are {keys}")
                cost[i] = float(value)
            self._costs[label] = cost.to(relaxation.alpha(label).device)

    def step_mode(self, step: str, segment: int) -> dict:
        return {"mode": "binary", "paths": self.paths if step == "arch" else 1}

    def arch_extra_loss(self) -> torch.Tensor | float:
        if not self._costs or not self.latency_weight:
            return 0.0
        relax = self.relaxation
        expected = sum((F.softmax(relax.alpha(label), -1) * cost).sum()
                       for label, cost in self._costs.items())
        return self.latency_weight * expected

    def arch_step(self, train_batch, valid_batch, segment: int) -> float:
        relax = self.relaxation
        before = {label: a.detach().clone() for label, a in zip(relax.labels, relax.alphas)}
        loss = super().arch_step(train_batch, valid_batch, segment)
        rescale_drawn(relax, before)
        return loss
