"""DARTS (Liu et al., ICLR 2019): the softmax relaxation trained by bilevel gradient descent.

The supernet (:class:`~retiarii.optim.relax.Relaxation`, mode ``"softmax"``) computes every
candidate of every choice, weighted by ``softmax(alpha)``; the weights are trained on training
batches and the alphas on validation batches, alternately (see
:mod:`retiarii.strategies.one_shot.relaxed_training`). The architecture found is the argmax of every alpha.

``first_order=False`` takes DARTS' second-order step: the alphas follow the gradient of the
validation loss at the weights after one virtual SGD step ``w' = w - xi * dL_train/dw``
(``xi`` the weight optimizer's learning rate), with the Hessian-vector product of the chain
rule approximated by finite differences::

    dL_val(w', a)/da - xi * (dL_train(w+, a)/da - dL_train(w-, a)/da) / (2 eps)
    w+- = w +- eps * dL_val(w', a)/dw',   eps = 0.01 / ||dL_val(w', a)/dw'||

Example::

    s = rt.strategies.DARTS(epochs=10, arch_lr=3e-4)
    s.setup(space, trainer, {}, torch.device("cpu"))
    for seg in range(s.num_segments()):
        s.run_segment(SegmentContext(seg, trainer, {}, torch.device("cpu")))
    net = s.export()            # the selected architecture with the supernet's weights
"""
from __future__ import annotations

import torch

from .relaxed_training import RelaxedOneShot

__all__ = ["DARTS"]


class DARTS(RelaxedOneShot):
    """Differentiable architecture search.

    Args:
        epochs: segments (epochs) of the search.
        first_order: True for the first-order approximation (the alphas' gradient at the
            current weights); False for the unrolled second-order step.
        arch_lr, arch_weight_decay, arch_betas, grad_clip, seed: see
            :class:`~retiarii.strategies.one_shot.relaxed_training.RelaxedOneShot`.
    """

    mode = "softmax"

    def __init__(self, epochs: int, first_order: bool = True, arch_lr: float = 3e-4,
                 arch_weight_decay: float = 1e-3, arch_betas: tuple = (0.5, 0.999),
                 grad_clip: float | None = 5.0, seed: int = 0):
        super().__init__(epochs, arch_lr, arch_weight_decay, arch_betas, grad_clip, seed)
        self.first_order = first_order

    def arch_step(self, train_batch, valid_batch, segment: int) -> float:
        if self.first_order:
            return super().arch_step(train_batch, valid_batch, segment)
        relax = self.relaxation
        relax.set_mode("softmax")
        weights = [p for p in relax.weight_parameters() if p.requires_grad]
        alphas = list(relax.arch_parameters())
        xi = float(self._opt.param_groups[0]["lr"])
        saved = [p.detach().clone() for p in weights]
        # w' = w - xi * dL_train/dw (a virtual step, undone below)
        grads = _grads(self._loss(train_batch), weights)
        with torch.no_grad():
            for p, g in zip(weights, grads):
                p.sub_(xi * g)
        loss = self._loss(valid_batch)
        d = _grads(loss, alphas + weights)
        d_alpha, d_w = d[:len(alphas)], d[len(alphas):]
        norm = torch.sqrt(sum((g * g).sum() for g in d_w))
        eps = 0.01 / max(float(norm), 1e-12)
        hessian = []
        for sign in (1.0, -1.0):
            with torch.no_grad():
                for p, w0, g in zip(weights, saved, d_w):
                    p.copy_(w0 + sign * eps * g)
            hessian.append(_grads(self._loss(train_batch), alphas))
        with torch.no_grad():
            for p, w0 in zip(weights, saved):
                p.copy_(w0)
        self._arch_opt.zero_grad(set_to_none=True)
        for a, ga, hp, hm in zip(alphas, d_alpha, *hessian):
            a.grad = ga - xi * (hp - hm) / (2 * eps)
        self._arch_opt.step()
        self._check_alphas()
        return float(loss.detach())


def _grads(loss: torch.Tensor, params: list) -> list[torch.Tensor]:
    """d loss / d params, zeros for parameters the loss does not reach."""
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
