"""The loop DARTS, GumbelDARTS and ProxylessNAS share: bilevel training of a relaxation.

One segment is one epoch over ``ctx.train_batches()``. For every training batch the strategy
first takes an **architecture step** on a validation batch (the alphas, with the loss of the
trainer's ``training_step`` on that batch), then a **weight step** on the training batch (the
supernet's weights, with the trainer's optimizer). Architecture batches come from
``ctx.arch_batches()``, cycled from its first batch at every segment (so a segment depends on
the segment number and the state only, which is what makes resume exact): the trainer's
``arch_dataloader`` where it has one (DARTS' recipe: half of the training data,
:class:`retiarii.arch_split.ArchSplitTrainer`), else its validation batches. After the
epoch the derived architecture (the argmax of every alpha, or the space's ``derivation``) is
evaluated on the validation batches with the supernet's weights (``trainer.validation_step``) and reported as
the segment's model.

Subclasses say how the relaxation runs in each step (:meth:`RelaxedOneShot.step_mode`) and
may add to the architecture loss or replace the architecture step.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from ...training import batch_size as _batch_size
from ...training import parse_optimizers as _parse_optimizers
from ...training import to_device as _to_device
from ...optim.relax import Relaxation
from .base import EvaluatedModel, OneShot, SegmentContext, SegmentResult

__all__ = ["RelaxedOneShot"]


class RelaxedOneShot(OneShot):
    """Base of the differentiable one-shot strategies; see the module docstring.

    Args:
        epochs: segments of the search (one epoch each).
        arch_lr, arch_weight_decay, arch_betas: Adam on the alphas (DARTS' settings).
        grad_clip: the weights' gradient norm is clipped to this (DARTS: 5); None: no clip.
        seed: the supernet's initial weights and the generator of its random draws.
    """

    mode = "softmax"

    def __init__(self, epochs: int, arch_lr: float = 3e-4, arch_weight_decay: float = 1e-3,
                 arch_betas: tuple = (0.5, 0.999), grad_clip: float | None = 5.0,
                 seed: int = 0):
        if epochs < 1:
            raise ValueError(f"epochs must be at least 1, got {epochs}")
        if arch_lr <= 0:
            raise ValueError(f"arch_lr must be positive, got {arch_lr}")
        self.epochs, self.arch_lr, self.arch_weight_decay = epochs, arch_lr, arch_weight_decay
        self.arch_betas, self.grad_clip, self.seed = tuple(arch_betas), grad_clip, seed
        self.relaxation: Relaxation | None = None
        self._done = 0

    # ---- what subclasses change --------------------------------------------------------------
    def step_mode(self, step: str, segment: int) -> dict:
        """Mode and settings of the relaxation for ``step`` ("arch" or "weight") in
        ``segment``: ``{"mode": ..., **settings}``."""
        return {"mode": self.mode}

    def arch_extra_loss(self) -> torch.Tensor | float:
        """Added to the validation loss in the architecture step (a latency term...)."""
        return 0.0

    def arch_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The architecture step's loss from the validation loss (default: plus
        :meth:`arch_extra_loss`; FBNet multiplies it by a latency factor instead)."""
        return loss + self.arch_extra_loss()

    def check(self, relaxation: Relaxation) -> None:
        """Validate the strategy's settings against the relaxed space (after it is built)."""

    # ---- the OneShot interface --------------------------------------------------------------
    def setup(self, space, trainer, hparams: dict, device: torch.device) -> None:
        make = space.relaxation or Relaxation  # a space may bring its own supernet
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.relaxation = make(space, mode=self.mode, seed=self.seed)
        self.relaxation.to(device)
        self.check(self.relaxation)
        self._trainer, self._hparams, self._device = trainer, dict(hparams), device
        answer = trainer.configure_optimizers(self.relaxation.weights, self._hparams)
        self._opt, self._sched, self._interval = _parse_optimizers(answer)
        self._arch_opt = torch.optim.Adam(self.relaxation.arch_parameters(), lr=self.arch_lr,
                                          betas=self.arch_betas,
                                          weight_decay=self.arch_weight_decay)
        self._done = 0

    def num_segments(self) -> int:
        return self.epochs

    def _need_setup(self) -> Relaxation:
        if self.relaxation is None:
            raise RuntimeError(f"{type(self).__name__}: call setup(space, trainer, hparams, "
                               f"device) first")
        return self.relaxation

    def _loss(self, batch) -> torch.Tensor:
        return self._trainer.training_step(self.relaxation, batch, self._hparams)

    def arch_step(self, train_batch, valid_batch, segment: int) -> float:
        """One step of the alphas on ``valid_batch`` (first order); returns its loss."""
        self.relaxation.set_mode(**self.step_mode("arch", segment))
        self._arch_opt.zero_grad(set_to_none=True)
        loss = self.arch_loss(self._loss(valid_batch))
        if loss.requires_grad:
            loss.backward()
            self._arch_opt.step()
        self._check_alphas()
        return float(loss.detach())

    def _check_alphas(self) -> None:
        relax = self.relaxation
        bad = [label for label, a in zip(relax.labels, relax.alphas)
               if not torch.isfinite(a.detach()).all()]
        if bad:
            raise FloatingPointError(f"{type(self).__name__}: the architecture parameters of "
                                     f"{bad[:5]} are not finite after an architecture step; "
                                     f"lower arch_lr")

    def weight_step(self, batch, segment: int) -> float:
        relax = self.relaxation
        relax.set_mode(**self.step_mode("weight", segment))
        self._opt.zero_grad(set_to_none=True)
        loss = self._loss(batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{type(self).__name__}: the supernet's training loss is "
                                     f"{float(loss.detach())}; lower the learning rate")
        if loss.requires_grad:  # (a sampled path may hold no weights at all)
            loss.backward()
            if self.grad_clip is not None:
                nn.utils.clip_grad_norm_(list(relax.weight_parameters()), self.grad_clip)
            self._opt.step()
        if self._sched is not None and self._interval == "step":
            self._sched.step()
        return float(loss.detach())

    def run_segment(self, ctx: SegmentContext) -> SegmentResult:
        relax = self._need_setup()
        relax.train()
        seg = self._done
        valid = _Cycle(ctx.arch_batches())
        losses, arch_losses, n = 0.0, 0.0, 0
        for batch in ctx.train_batches():
            if ctx.should_stop():
                break
            batch = _to_device(batch, ctx.device)
            arch_losses += self.arch_step(batch, _to_device(valid.next(), ctx.device), seg)
            losses += self.weight_step(batch, seg)
            n += 1
        if self._sched is not None and self._interval == "epoch":
            self._sched.step()
        self._done += 1
        sample = relax.derive()
        metrics = self.evaluate(sample, ctx)
        own = {"train_loss": losses / max(1, n), "arch_loss": arch_losses / max(1, n),
               "arch_entropy": relax.entropy(), "train_batches": n,
               **{k: v for k, v in self.step_mode("arch", seg).items() if k != "mode"}}
        return SegmentResult({**own, **metrics},
                             [EvaluatedModel(sample, {**metrics, "train_batches": n})])

    def evaluate(self, sample: dict, ctx: SegmentContext) -> dict:
        """The trainer's validation metrics of ``sample`` run on the supernet's weights."""
        relax = self._need_setup()
        mode = relax.mode
        relax.fix(sample)
        relax.eval()
        sums: dict[str, float] = {}
        total = 0
        try:
            with torch.no_grad():
                for batch in ctx.valid_batches():
                    batch = _to_device(batch, ctx.device)
                    size = _batch_size(batch)
                    for k, v in self._trainer.validation_step(relax, batch).items():
                        sums[k] = sums.get(k, 0.0) + float(v) * size
                    total += size
        finally:
            relax.train()
            relax.mode = mode
        return {k: v / max(1, total) for k, v in sums.items()}

    def state_dict(self) -> dict:
        relax = self._need_setup()
        state = {"relaxation": relax.state_dict(), "optimizer": self._opt.state_dict(),
                 "arch_optimizer": self._arch_opt.state_dict(),
                 "scheduler": self._sched.state_dict() if self._sched is not None else None,
                 "generator": relax.generator.get_state(), "torch_rng": torch.get_rng_state(),
                 "done": self._done}
        if self._device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self._device)
        return state

    def load_state_dict(self, state: dict) -> None:
        relax = self._need_setup()
        relax.load_state_dict(state["relaxation"])
        self._opt.load_state_dict(state["optimizer"])
        self._arch_opt.load_state_dict(state["arch_optimizer"])
        if self._sched is not None and state.get("scheduler") is not None:
            self._sched.load_state_dict(state["scheduler"])
        relax.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state and self._device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], self._device)
        self._done = int(state["done"])

    def selected(self) -> dict:
        return self._need_setup().derive()

    def config(self) -> dict:
        """The constructor arguments, as JSON: ``type(self)(**config())`` rebuilds it."""
        names = [n for n in inspect.signature(type(self).__init__).parameters if n != "self"]
        out = {}
        for name in names:
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    def export(self, sample: dict | None = None) -> nn.Module:
        """The model of ``sample`` (default: :meth:`selected`) with the supernet's weights."""
        relax = self._need_setup()
        return relax.export(sample if sample is not None else relax.derive())

    def export_state(self, sample: dict) -> dict[str, torch.Tensor]:
        """The weights ``sample`` inherits from the supernet (each chosen candidate's, its
        BatchNorm statistics included), as the ``state_dict`` of ``space.build(sample)``:
        what the engine exports with the selected architecture. The standalone module then
        computes what the supernet computes in mode ``"fixed"`` on that sample."""
        with torch.random.fork_rng(devices=[]):  # building the module draws initial weights
            net = self.export(sample)
        return {k: v.detach().clone() for k, v in net.state_dict().items()}


class _Cycle:
    """The validation batches, from the first, round and round."""

    def __init__(self, batches):
        self.batches, self.it = batches, iter(batches)

    def next(self):
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.batches)
            try:
                return next(self.it)
            except StopIteration:
                raise ValueError("the validation data is empty: an architecture step needs "
                                 "validation batches (trainer.val_dataloader)") from None
