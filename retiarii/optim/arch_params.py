"""What every continuous relaxation exposes to the one-shot strategies that train it: its
weights and its alphas as two parameter groups, one alpha per choice label, the softmax
distributions and their mean entropy (``self.weights``, ``self.alphas``, ``self.labels``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ArchParameters"]


class ArchParameters(nn.Module):
    """The base of a relaxation: a subclass sets ``weights`` (a module), ``alphas`` (a
    ParameterList) and ``labels`` (the choice label of each alpha, in order)."""

    def weight_parameters(self):
        return self.weights.parameters()

    def arch_parameters(self):
        return self.alphas.parameters()

    def alpha(self, label: str) -> torch.Tensor:
        return self.alphas[self.labels.index(label)]

    def probabilities(self) -> dict[str, torch.Tensor]:
        """label -> softmax(alpha), detached."""
        return {label: F.softmax(a.detach(), -1) for label, a in zip(self.labels, self.alphas)}

    def entropy(self) -> float:
        """Mean entropy (nats) of the choices' distributions: log(n) when uniform, 0 when
        decided."""
        ents = [float(-(p * p.clamp_min(1e-12).log()).sum()) for p in self.probabilities().values()]
        return sum(ents) / max(1, len(ents))
