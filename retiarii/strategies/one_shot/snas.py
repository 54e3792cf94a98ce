"""GumbelDARTS / SNAS (Xie et al., ICLR 2019): the relaxation sampled with Gumbel-softmax.

Every step draws, for every choice, ``softmax((alpha + g) / tau)`` with Gumbel noise ``g``
(:class:`~retiarii.optim.relax.Relaxation`, mode ``"gumbel"``): a sample of the architecture
that is differentiable in the alphas. The temperature ``tau`` anneals from ``temperature`` to
``min_temperature`` geometrically over the epochs (SNAS' schedule), so the samples grow from
smooth mixtures to nearly one-hot. ``hard=True`` makes the forward one-hot with the soft
gradient (straight-through, as GDAS). The weights and alphas are trained alternately on
training and validation batches as in DARTS (:mod:`retiarii.strategies.one_shot.relaxed_training`); the
architecture found is the argmax of every alpha.

FBNet's **latency loss** (Wu et al., CVPR 2019, Eq. 2): given ``latency=`` a lookup table
(:class:`~retiarii.cost_terms.LatencyLUT`, as JSON), the architecture loss is
``CE * alpha * log(LAT) ** beta``, with ``LAT`` the expected latency of the architecture
under the Gumbel-softmax weights of the step's forward pass: the base model's latency plus,
per choice, ``sum_c m_c * table[c]``, in the table's ms times ``latency_scale``. The paper's
``alpha = 0.2, beta = 0.6``; its latencies are tens of ms (log ~3), ours on 8x8 digits are
below one ms, whose log is negative: ``latency_scale=1000`` reads them in microseconds
(hundreds; log ~6). The weight step keeps the plain loss (the factor depends on the alphas
only: it would merely rescale the weights' step).

Example::

    s = rt.strategies.GumbelDARTS(epochs=10, temperature=1.0, min_temperature=0.1)
    lut = LatencyLUT.of(space, OpLatencyTable(store))      # retiarii.cost_terms
    fbnet = rt.strategies.GumbelDARTS(epochs=10, latency=lut.to_json())   # 0.2, 0.6
"""
from __future__ import annotations

import math

import torch

from ...cost_terms import LatencyLUT, fbnet_factor
from .relaxed_training import RelaxedOneShot

__all__ = ["GumbelDARTS"]


class GumbelDARTS(RelaxedOneShot):
    """Gumbel-softmax relaxation with a temperature schedule.

    Args:
        epochs: segments (epochs) of the search.
        temperature: tau of the first epoch.
        min_temperature: tau of the last epoch (geometric decay in between).
        hard: one-hot forward, soft gradient (straight-through).
        latency: FBNet's latency lookup table (``LatencyLUT.to_json()``); None: no cost term.
        latency_alpha, latency_beta: FBNet's ``alpha`` and ``beta`` (the paper: 0.2, 0.6).
        latency_scale: ``LAT`` is the table's ms times this (default 1000: microseconds).
        arch_lr, arch_weight_decay, arch_betas, grad_clip, seed: see
            :class:`~retiarii.strategies.one_shot.relaxed_training.RelaxedOneShot`.
    """

    mode = "gumbel"

    def __init__(self, epochs: int, temperature: float = 1.0, min_temperature: float = 0.1,
                 hard: bool = False, arch_lr: float = 3e-4, arch_weight_decay: float = 1e-3,
                 arch_betas: tuple = (0.5, 0.999), grad_clip: float | None = 5.0,
                 seed: int = 0, latency: dict | None = None, latency_alpha: float = 0.2,
                 latency_beta: float = 0.6, latency_scale: float = 1000.0):
        super().__init__(epochs, arch_lr, arch_weight_decay, arch_betas, grad_clip, seed)
        if not 0 < min_temperature <= temperature:
            raise ValueError(f"need 0 < min_temperature <= temperature; got "
                             f"min_temperature={min_temperature}, temperature={temperature}")
        self.temperature, self.min_temperature, self.hard = temperature, min_temperature, hard
        for name, value in [("latency_alpha", latency_alpha), ("latency_beta", latency_beta),
                            ("latency_scale", latency_scale)]:
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"GumbelDARTS: {name} must be a positive number, got "
                                 f"{value!r}")
        self._lut = None if latency is None else LatencyLUT.from_json(latency)
        self.latency = None if latency is None else self._lut.to_json()
        self.latency_alpha, self.latency_beta = latency_alpha, latency_beta
        self.latency_scale = latency_scale
        self._costs: dict[str, torch.Tensor] = {}

    def check(self, relaxation) -> None:
        self._costs = {}
        if self._lut is None:
            return
        for label in self._lut.choices:
            if label not in relaxation.keys:
                raise ValueError(f"latency table: label {label!r} is not a choice of the "
                                 f"space; its labels are {relaxation.labels}")
            self._costs[label] = torch.tensor(
                self._lut.costs(label, relaxation.keys[label]),
                device=relaxation.alpha(label).device)

    def expected_latency(self) -> torch.Tensor:
        """FBNet's ``LAT``: the base latency plus each choice's table weighed by the mixing
        weights of the last forward pass, times ``latency_scale`` (differentiable in the
        alphas through the Gumbel-softmax weights)."""
        mixing = getattr(self.relaxation, "mixing", {})
        total = torch.tensor(self._lut.base, device=self.relaxation.alphas[0].device)
        for label, cost in self._costs.items():
            if label in mixing:
                total = total + (mixing[label] * cost).sum()
        return total * self.latency_scale

    def arch_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``CE * alpha * log(LAT) ** beta`` with a table, else the plain loss."""
        if self._lut is None:
            return loss
        lat = self.expected_latency()
        fbnet_factor(float(lat.detach()), self.latency_alpha, self.latency_beta)  # LAT > 1
        return loss * self.latency_alpha * torch.log(lat) ** self.latency_beta

    def temperature_at(self, segment: int) -> float:
        """tau of ``segment``: temperature * (min_temperature / temperature) ** (s / (E - 1))."""
        frac = min(segment, self.epochs - 1) / max(1, self.epochs - 1)
        return self.temperature * (self.min_temperature / self.temperature) ** frac

    def step_mode(self, step: str, segment: int) -> dict:
        return {"mode": "gumbel", "temperature": self.temperature_at(segment), "hard": self.hard}
