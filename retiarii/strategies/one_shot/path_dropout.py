"""Bender et al., "Understanding and Simplifying One-Shot Architecture Search", ICML 2018: train
the whole one-shot model with scheduled path dropout, ghost batch normalization and L2 on the
used weights only, then rank random architectures on it with the other paths zeroed out.

Path dropout: at a choice point with k incoming paths, each path is dropped with probability
``rate ** (1 / k)`` (so the chance that all k go is ``rate`` whatever k), ``rate`` growing
linearly from 0 at the first training step to ``final_rate`` at the last
(:func:`dropout_rate`); a row whose paths all drew a drop keeps one of them, drawn uniformly
(:func:`path_masks`). Masks are drawn per example (``per_example=True``) or once per batch.
The kept paths are summed unscaled, as the evaluation sums an architecture's paths.

The space hands over its one-shot model through ``space.macro = {"kind": "path_dropout",
"build": <callable>}``; the model has ``choice_points() -> [(name, k)]``, ``set_masks({name:
(B, k)} | None)`` and ``paths_of(sample) -> {name: [kept path indices]}``
(``model_spaces/oneshot.py``).

Example::

    s = PathDropout(epochs=20, final_rate=0.5, ghost_batch=16, search_population=24)
    s.setup(space, trainer, {}, torch.device("cpu"))
    for seg in range(s.num_segments()):
        s.run_segment(SegmentContext(seg, trainer, {}, torch.device("cpu")))
    best = space.build(s.selected())            # retrained from scratch
"""
from __future__ import annotations

import math
import random
from typing import Any

import torch
from torch import nn

from ...enums import Mode
from ...sampler import RandomSampler, sample_key
from .base import EvaluatedModel, OneShot, SegmentContext, SegmentResult
from .shared_training import check_positive, check_state, take
from .supernet import average_metrics, macro_of, seeded, trainer_optimizer

__all__ = ["GhostBatchNorm2d", "PathDropout", "dropout_rate", "ghost_batch_norm", "path_masks",
           "used_l2"]


def dropout_rate(step: int, total_steps: int, final_rate: float) -> float:
    """The path dropout rate at training ``step`` of ``total_steps``: linear from 0 at step 0
    to ``final_rate`` at the last step (Bender et al.'s schedule).

    Example:
        >>> [dropout_rate(s, 5, 0.5) for s in (0, 2, 4)]
        [0.0, 0.25, 0.5]
    """
    return final_rate * min(1.0, step / max(total_steps - 1, 1))


def path_masks(k: int, rows: int, rate: float, generator: torch.Generator | None = None
               ) -> torch.Tensor:
    """(rows, k) of 0/1: each path dropped with probability ``rate ** (1 / k)``; a row that
    dropped all k keeps one, drawn uniformly (a choice point never goes dark)."""
    p_drop = rate ** (1.0 / k) if rate > 0 else 0.0
    keep = (torch.rand(rows, k, generator=generator) >= p_drop).float()
    dark = keep.sum(1) == 0
    if bool(dark.any()):
        pick = torch.randint(k, (int(dark.sum()),), generator=generator)
        keep[dark.nonzero().flatten(), pick] = 1.0
    return keep


class GhostBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d whose training-mode statistics are those of each ghost batch of
    ``ghost_batch`` examples (Hoffer et al., 2017; Bender et al. train the one-shot model so);
    the running averages are updated once per ghost batch. Same parameters and buffers as
    BatchNorm2d, so state dicts move between the two."""

    ghost_batch: int = 0  # 0: the whole batch (plain BatchNorm2d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or not self.ghost_batch or x.shape[0] <= self.ghost_batch:
            return super().forward(x)
        # (B, C, H, W) -> ceil(B / g) chunks of (g, C, H, W), each normalized by its own stats
        return torch.cat([super(GhostBatchNorm2d, self).forward(chunk)
                          for chunk in x.split(self.ghost_batch)])


def ghost_batch_norm(net: nn.Module, ghost_batch: int) -> nn.Module:
    """``net`` with every BatchNorm2d turned into a :class:`GhostBatchNorm2d` of ``ghost_batch``
    (in place: the modules keep their weights and statistics)."""
    for module in net.modules():
        if type(module) is nn.BatchNorm2d:
            module.__class__ = GhostBatchNorm2d
            module.ghost_batch = ghost_batch
    return net


def used_l2(params: list[nn.Parameter], weight_decay: float) -> int:
    """Adds L2's gradient ``weight_decay * w`` to the parameters the batch used (those that
    got a gradient: a path no example kept was not computed); returns how many."""
    used = 0
    for p in params:
        if p.grad is not None:
            p.grad.add_(p.detach(), alpha=weight_decay)
            used += 1
    return used


class PathDropout(OneShot):
    """Bender et al.'s one-shot search; see the module docstring.

    Segments ``0 .. epochs-1`` train the one-shot model; the last evaluates
    ``search_population`` distinct random architectures on it (each choice point keeps the
    architecture's paths, the others zeroed), BatchNorm on batch statistics as in training
    (the running averages are left as they were). :meth:`selected` is the best one by
    ``metric`` (the space's default sample before).

    Args:
        epochs: segments (epochs) of training.
        final_rate: the dropout rate ``r`` the schedule reaches at the end of training.
        per_example: a mask per example (True) or one per batch.
        ghost_batch: ghost batch size of the BatchNorm layers (0: plain BatchNorm).
        weight_decay: L2 on the used weights; None: the trainer's optimizer's
            ``weight_decay`` (taken out of the optimizer, which would decay every weight).
        search_population: random architectures ranked in the last segment.
        eval_batches: validation batches per architecture (None: all).
        metric, mode: what ranks them.
        seed: seeds the weights, the masks and the candidates.
    """

    def __init__(self, epochs: int = 10, final_rate: float = 0.5, per_example: bool = True,
                 ghost_batch: int = 16, weight_decay: float | None = None,
                 search_population: int = 24, eval_batches: int | None = 2,
                 metric: str = "val_acc", mode: str = "max", seed: int = 0):
        check_positive("PathDropout", epochs=epochs, search_population=search_population)
        if eval_batches is not None:
            check_positive("PathDropout", eval_batches=eval_batches)
        if not 0 <= final_rate < 1:
            raise ValueError(f"PathDropout: final_rate must be in [0, 1), got {final_rate!r}")
        if isinstance(ghost_batch, bool) or not isinstance(ghost_batch, int) or ghost_batch < 0:
            raise ValueError(f"PathDropout: ghost_batch must be an int >= 0 (0: plain "
                             f"BatchNorm), got {ghost_batch!r}")
        if weight_decay is not None and not weight_decay >= 0:
            raise ValueError(f"PathDropout: weight_decay must be >= 0 or None, got "
                             f"{weight_decay!r}")
        self.epochs, self.final_rate, self.per_example = epochs, float(final_rate), per_example
        self.ghost_batch, self.weight_decay = ghost_batch, weight_decay
        self.search_population, self.eval_batches = search_population, eval_batches
        self.metric, self.mode, self.seed = metric, str(Mode.parse(mode, "PathDropout")), seed
        self._net: Any = None
        self._step = 0  # training steps so far (the schedule's clock)
        self._evaluated: dict[str, tuple[dict, dict]] = {}

    def setup(self, space: Any, trainer: Any, hparams: dict, device: torch.device) -> None:
        macro = macro_of(space, "PathDropout", "path_dropout", "model_spaces.oneshot.small()")
        self._space, self._trainer, self._hparams = space, trainer, hparams
        with seeded(self.seed, -1, "init"):
            self._net = ghost_batch_norm(macro["build"](), self.ghost_batch).to(device)
        self._points = self._net.choice_points()
        self._opt = trainer_optimizer(trainer, self._net, hparams)
        decay = {float(g.get("weight_decay", 0.0)) for g in self._opt.param_groups}
        # L2 only on what a batch uses: the optimizer's own decay would reach every weight
        self._decay = self.weight_decay if self.weight_decay is not None else max(decay)
        for group in self._opt.param_groups:
            group["weight_decay"] = 0.0
        self._step, self._evaluated = 0, {}

    def num_segments(self) -> int:
        return self.epochs + 1

    def masks(self, rows: int, rate: float) -> dict[str, torch.Tensor]:
        """One training step's masks, ``{choice point: (rows, k)}`` (one row repeated for
        ``per_example=False``)."""
        out = {}
        for name, k in self._points:
            m = path_masks(k, rows if self.per_example else 1, rate)
            out[name] = m if self.per_example else m.expand(rows, k)
        return out

    def train_step(self, batch: Any, masks: dict[str, torch.Tensor]) -> float:
        """One optimizer step of the one-shot model on ``batch`` under ``masks``, L2 on the
        used weights; returns the loss."""
        from ...training import to_device

        device = next(self._net.parameters()).device
        self._net.train()
        self._net.set_masks({k: m.to(device) for k, m in masks.items()})
        try:
            loss = self._trainer.training_step(self._net, to_device(batch, device),
                                               self._hparams)
        finally:
            self._net.set_masks(None)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"PathDropout: the loss is {value}; lower the learning "
                                     f"rate")
        self._opt.zero_grad(set_to_none=True)
        loss.backward()
        if self._decay:
            used_l2(list(self._net.parameters()), self._decay)
        self._opt.step()
        return value

    def run_segment(self, ctx: SegmentContext) -> SegmentResult:
        if self._net is None:
            raise RuntimeError("PathDropout.run_segment(): call setup(...) first")
        if not 0 <= ctx.segment < self.num_segments():
            raise ValueError(f"PathDropout: segment {ctx.segment} is out of range 0.."
                             f"{self.num_segments() - 1}")
        if ctx.segment < self.epochs:
            return self._train(ctx)
        return self._search(ctx)

    def _train(self, ctx: SegmentContext) -> SegmentResult:
        from ...training import batch_size

        batches = list(ctx.train_batches())
        total = self.epochs * len(batches)
        # the step counts from the segment: a resumed segment draws what an uninterrupted one
        self._step = ctx.segment * len(batches)
        losses, rate = [], 0.0
        with seeded(self.seed, ctx.segment, "train"):
            for batch in batches:
                if ctx.should_stop():
                    break
                rate = dropout_rate(self._step, total, self.final_rate)
                losses.append(self.train_step(batch, self.masks(batch_size(batch), rate)))
                self._step += 1
        return SegmentResult({"train_loss": sum(losses) / max(len(losses), 1),
                              "batches": len(losses), "dropout_rate": rate})

    def evaluate(self, sample: dict, batches: list) -> dict:
        """``metric`` of architecture ``sample`` on the one-shot model, its other paths zeroed
        out, BatchNorm on batch statistics (the running averages restored after)."""
        net = self._net
        paths = net.paths_of(sample)
        saved = {k: v.clone() for k, v in net.state_dict().items()
                 if k.endswith(("running_mean", "running_var", "num_batches_tracked"))}
        masks = {}
        for name, k in self._points:
            m = torch.zeros(1, k)
            m[0, paths[name]] = 1.0
            masks[name] = m
        total: dict[str, float] = {}
        n = 0
        try:
            for batch in batches:
                rows = len(batch[1]) if isinstance(batch, (tuple, list)) else 1
                device = next(net.parameters()).device
                net.set_masks({k: m.expand(rows, -1).to(device) for k, m in masks.items()})
                # batch statistics: the training-mode BatchNorm the shared weights learnt with
                net.train()
                with torch.no_grad():
                    metrics = average_metrics(_TrainMode(self._trainer), net, [batch], device)
                for key, value in metrics.items():
                    total[key] = total.get(key, 0.0) + value
                n += 1
        finally:
            net.set_masks(None)
            net.load_state_dict(saved, strict=False)
        return {k: v / max(n, 1) for k, v in total.items()}

    def _search(self, ctx: SegmentContext) -> SegmentResult:
        rng = random.Random(f"{self.seed}:{ctx.segment}:search")
        valid = take(ctx.valid_batches(), self.eval_batches)
        models = []
        sign = Mode(self.mode).sign
        for _ in range(100 * self.search_population):
            if len(models) == self.search_population or ctx.should_stop():
                break
            sample = dict(self._space.sample(RandomSampler(rng)).sample)
            if sample_key(sample) in self._evaluated:
                continue
            metrics = self.evaluate(sample, valid)
            if self.metric not in metrics:
                raise KeyError(f"PathDropout ranks by {self.metric!r} but the trainer's "
                               f"validation_step returned {sorted(metrics)}")
            self._evaluated[sample_key(sample)] = (sample, metrics)
            models.append(EvaluatedModel(sample, metrics))
        best = max((m[self.metric] * sign for _, m in self._evaluated.values()), default=None)
        out = {"candidates": len(models)}
        if best is not None:
            out[f"best_{self.metric}"] = best * sign
        return SegmentResult(out, models)

    def selected(self) -> dict:
        if not self._evaluated:
            if self._net is None:
                raise RuntimeError("PathDropout.selected(): call setup(space, ...) first")
            return self._space.default_sample()
        sign = Mode(self.mode).sign
        return dict(max(self._evaluated.values(), key=lambda sm: sign * sm[1][self.metric])[0])

    def state_dict(self) -> dict:
        if self._net is None:
            raise RuntimeError("PathDropout.state_dict(): call setup(space, ...) first")
        return {"strategy": "PathDropout", "config": self.config(), "net": self._net.state_dict(),
                "opt": self._opt.state_dict(), "step": self._step,
                "evaluated": [[s, m] for s, m in self._evaluated.values()]}

    def load_state_dict(self, state: dict) -> None:
        if self._net is None:
            raise RuntimeError("PathDropout.load_state_dict(): call setup(space, ...) first")
        check_state("PathDropout", state, self.config())
        self._net.load_state_dict(state["net"])
        self._opt.load_state_dict(state["opt"])
        self._step = int(state["step"])
        self._evaluated = {sample_key(s): (dict(s), dict(m)) for s, m in state["evaluated"]}


class _TrainMode:
    """A trainer whose validation_step leaves the net in training mode (BatchNorm on the
    batch's statistics) instead of the eval mode average_metrics sets."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def validation_step(self, net: nn.Module, batch: Any) -> dict:
        net.train()
        return self.trainer.validation_step(net, batch)

