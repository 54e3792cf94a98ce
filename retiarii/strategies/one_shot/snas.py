"""GumbelDARTS / SNAS (Xie et al., ICLR 2019): the relaxation sampled with Gumbel-softmax.

Every step draws, for every choice, ``softmax((alpha + g) / tau)`` with Gumbel noise ``g``
(:class:`~retiarii.optim.relax.Relaxation`, mode ``"gumbel"``): a sample of the architecture
that is differentiable in the alphas. The temperature ``tau`` anneals from ``temperature`` to
``min_temperature`` geometrically over the epochs (SNAS' schedule), so the samples grow from
smooth mixtures to nearly one-hot. ``hard=True`` makes the forward one-hot with the soft
gradient (straight-through, as GDAS). The weights and alphas are trained alternately on
training and validation batches as in DARTS (:mod:`retiarii.strategies.one_shot.relaxed_training`); the
architecture found is the argmax of every alpha.

Example::

    s = rt.strategies.GumbelDARTS(epochs=10, temperature=1.0, min_temperature=0.1)
"""
from __future__ import annotations

from .relaxed_training import RelaxedOneShot

__all__ = ["GumbelDARTS"]


class GumbelDARTS(RelaxedOneShot):
    """Gumbel-softmax relaxation with a temperature schedule.

    Args:
        epochs: segments (epochs) of the search.
        temperature: tau of the first epoch.
        min_temperature: tau of the last epoch (geometric decay in between).
        hard: one-hot forward, soft gradient (straight-through).
        arch_lr, arch_weight_decay, arch_betas, grad_clip, seed: see
            :class:`~retiarii.strategies.one_shot.relaxed_training.RelaxedOneShot`.
    """

    mode = "gumbel"

    def __init__(self, epochs: int, temperature: float = 1.0, min_temperature: float = 0.1,
                 hard: bool = False, arch_lr: float = 3e-4, arch_weight_decay: float = 1e-3,
                 arch_betas: tuple = (0.5, 0.999), grad_clip: float | None = 5.0,
                 seed: int = 0):
        super().__init__(epochs, arch_lr, arch_weight_decay, arch_betas, grad_clip, seed)
        if not 0 < min_temperature <= temperature:
            raise ValueError(f"need 0 < min_temperature <= temperature; got "
                             f"min_temperature={min_temperature}, temperature={temperature}")
        self.temperature, self.min_temperature, self.hard = temperature, min_temperature, hard

    def temperature_at(self, segment: int) -> float:
        """tau of ``segment``: temperature * (min_temperature / temperature) ** (s / (E - 1))."""
        frac = min(segment, self.epochs - 1) / max(1, self.epochs - 1)
        return self.temperature * (self.min_temperature / self.temperature) ** frac

    def step_mode(self, step: str, segment: int) -> dict:
        return {"mode": "gumbel", "temperature": self.temperature_at(segment), "hard": self.hard}
