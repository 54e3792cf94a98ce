"""Proximal policy optimization of the NAS controller (Schulman et al., 2017), the update NASNet's
controller uses (Zoph et al., CVPR 2018): the clipped surrogate over batches of architectures.

:class:`~retiarii.strategies.multi_trial.rl.PolicyBasedRL` holds the controller and, with
``algorithm="ppo"``, hands each full batch of told architectures to :func:`ppo_update`: the
batch's log-probabilities under the policy that *drew* them (kept when they were proposed)
are the old policy; a few epochs of Adam steps over the batch lower

    -mean_i min(rho_i A_i, clip(rho_i, 1 - eps, 1 + eps) A_i) - entropy_weight * mean_i H_i,
    rho_i = exp(log p_new(a_i) - log p_old(a_i)),

so no step moves an architecture's probability ratio far from 1 in the direction its
advantage rewards.
"""
from __future__ import annotations

from typing import Callable

import torch


def clipped_surrogate(log_prob: torch.Tensor, old_log_prob: torch.Tensor,
                      advantage: torch.Tensor, clip: float) -> torch.Tensor:
    """PPO's clipped objective per sample (to maximize): ``min(rho A, clip(rho) A)``.

    Example:
        >>> import math
        >>> rho = torch.tensor([1.5, 0.5])                  # ratios new / old
        >>> out = clipped_surrogate(rho.log(), torch.zeros(2), torch.tensor([1.0, 1.0]), 0.2)
        >>> [round(v, 6) for v in out.tolist()]             # 1.5 clipped to 1.2; 0.5 kept
        [1.2, 0.5]

    Args:
        log_prob: (N,) log-probabilities of the samples under the policy being trained.
        old_log_prob: (N,) the same under the policy that drew them (no gradient).
        advantage: (N,) each sample's advantage (reward minus baseline, normalized).
        clip: epsilon, the ratio's allowed distance from 1 (the PPO paper: 0.2).
    """
    ratio = torch.exp(log_prob - old_log_prob)
    return torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)


def ppo_update(log_prob_and_entropy: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
               old_log_probs: list[float], advantages: list[float],
               optimizer: torch.optim.Optimizer, *, epochs: int, clip: float,
               entropy_weight: float) -> list[float]:
    """``epochs`` optimizer steps, each on the whole batch's clipped surrogate; returns the
    loss of each step (before it).

    Args:
        log_prob_and_entropy: ``i -> (log p(a_i), entropy)`` under the current policy, with
            gradients (the controller fed the i-th sample again).
        old_log_probs, advantages: per sample of the batch.
        optimizer: steps the controller's parameters.
    """
    old = torch.tensor(old_log_probs, dtype=torch.float32)  # (N,)
    adv = torch.tensor(advantages, dtype=torch.float32)  # (N,)
    losses = []
    for _ in range(epochs):
        pairs = [log_prob_and_entropy(i) for i in range(len(old_log_probs))]
        log_prob = torch.stack([p for p, _ in pairs])  # (N,)
        entropy = torch.stack([h for _, h in pairs])  # (N,)
        loss = -clipped_surrogate(log_prob, old, adv, clip).mean() \
            - entropy_weight * entropy.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().item())
    return losses
