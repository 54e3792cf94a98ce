"""Efficient NAS, Pham et al., "Efficient Neural Architecture Search via Parameter Sharing",
ICML 2018: an LSTM controller samples paths of a super-graph whose shared weights train on
training batches; the controller learns by REINFORCE from the validation reward of its paths."""
from __future__ import annotations

import json
from typing import Any

import torch

from ...enums import Mode
from ...sampler import ReplaySampler, sample_key
from .base import EvaluatedModel, OneShot, SegmentContext, SegmentResult
from ..multi_trial.rl import Controller
from .shared_training import (ExportsInherited, SharedTraining, check_positive, check_shared,
                              check_state, mean_over_ranks, rank_rngs, ready, segment_rng, take)


class _PolicySampler:
    """Decides each choice from the controller as the space reaches it: drawn from the
    policy with ``rng``, its most likely candidate (``rng=None``), or the choice of ``fixed``
    (a sample to score). Sums the log-probability of the decisions and the policy's entropy
    (with gradients when enabled)."""

    def __init__(self, enas: "ENAS", rng, fixed: dict | None = None):
        self.enas, self.rng = enas, rng
        self.fixed = None if fixed is None else ReplaySampler(fixed)
        self.x, self.state = enas._controller.initial()
        self.log_prob = torch.zeros(())
        self.entropy = torch.zeros(())

    def choose(self, label: str, candidates: list, context: dict) -> int:
        enas = self.enas
        head = enas._add_head(label, candidates)
        self.state, logp = enas._controller.step(self.x, self.state, head, enas.tanh_constant)
        if self.fixed is not None:
            index = self.fixed.choose(label, candidates, context)
        elif self.rng is None:
            index = int(logp.argmax())
        else:
            index = self.rng.choices(range(len(candidates)), weights=logp.exp().tolist())[0]
        self.log_prob = self.log_prob + logp[index]
        self.entropy = self.entropy - (logp.exp() * logp).sum()
        self.x = enas._controller.feed(head, index)
        return index


class ENAS(ExportsInherited, OneShot):
    """ENAS: a controller samples one path per training batch; REINFORCE trains the controller.

    Each segment first trains the shared weights: every ``batches_per_model`` training batches
    the controller samples a path, which trains on them with the trainer's loss and optimizer.
    Then ``controller_steps`` controller updates: each samples a path, its reward is ``metric``
    on the next ``eval_batches`` validation batches (cycling through the loader) with the
    inherited weights, the baseline moves towards the reward
    (``b <- decay * b + (1 - decay) * r``, starting at the first reward) and one Adam step
    lowers ``-(r - b) * log p(path) - entropy_weight * entropy``. The controller is
    :mod:`~retiarii.strategies.multi_trial.rl`'s LSTM (one decoder and embedding per choice, created when
    the choice is first met, logits bounded by ``tanh_constant * tanh``).

    The last segment ends with a **selection**: the controller's most likely path (each
    choice at its argmax), ``select_samples`` paths sampled from it, and every path the
    controller steps evaluated during the search (once each) are evaluated on the same first
    ``eval_batches`` validation batches with the final weights, and the best is selected
    (ties: the most likely path, then the earliest). Rewards of the controller steps are
    measured on other batches and older weights, so they do not compare; this makes the
    selected path the best of what the search evaluated, judged alike. :meth:`selected` is
    that path; before the selection, the most likely path.

    Example (``space`` a ModelSpace, ``trainer`` a Trainer)::

        s = ENAS(segments=10, controller_steps=50)
        s.setup(space, trainer, {}, torch.device("cpu"))
        for seg in range(s.num_segments()):
            s.run_segment(SegmentContext(seg, trainer, {}, torch.device("cpu")))
        model = space.build(s.selected())

    Args:
        segments: segments (epochs) of the search.
        batches_per_model: training batches per sampled path (ENAS: 1).
        controller_steps: controller updates per segment (ENAS: 2000, over a much longer run).
        eval_batches: validation batches per reward.
        hidden_size: the controller's LSTM width (ENAS: 100 for 100+ decisions; 64 suits the
            tens of choices of spaces here).
        controller_lr: Adam's step for the controller; above ENAS's 3.5e-4 because a search
            here makes hundreds of updates, not hundreds of thousands (on
            ``tests/one_shot_task.py`` 0.02 found the best path for 10 seeds of 10, 0.01 for 9,
            0.05 locked onto a wrong path early more often).
        baseline_decay: moving-average factor of the baseline (ENAS: 0.99; 0.9 follows the
            rising rewards of a short search).
        entropy_weight: the entropy bonus that keeps exploring (ENAS: 1e-4).
        tanh_constant: bound on the logits (ENAS: 1.5); ``None`` leaves them free.
        select_samples: paths sampled from the controller for the final selection, besides
            the most likely one and the paths the search evaluated.
        metric: the validation metric used as reward.
        mode: ``"max"`` (default) or ``"min"`` (the reward is then ``-metric``).
        seed: seeds the weights, the controller and every draw.
        shared: annotate which operators share weights, as ``fnmatch`` patterns of their
            module paths (``["stem", "cells.*"]``); the others are private to each
            architecture. None (default): the whole space shares weights.
    """

    def __init__(self, segments: int = 10, batches_per_model: int = 1,
                 controller_steps: int = 50, eval_batches: int = 1, *, hidden_size: int = 64,
                 controller_lr: float = 0.02, baseline_decay: float = 0.9,
                 entropy_weight: float = 1e-4, tanh_constant: float | None = 1.5,
                 select_samples: int = 0, metric: str = "val_acc", mode: str = "max",
                 seed: int = 0, shared: list[str] | None = None):
        check_positive("ENAS", segments=segments, batches_per_model=batches_per_model,
                       controller_steps=controller_steps, eval_batches=eval_batches,
                       hidden_size=hidden_size)
        if not controller_lr > 0:
            raise ValueError(f"ENAS: controller_lr must be positive, got {controller_lr!r}")
        if not 0 <= baseline_decay < 1:
            raise ValueError(f"ENAS: baseline_decay must be in [0, 1), got {baseline_decay!r}")
        if tanh_constant is not None and not tanh_constant > 0:
            raise ValueError(f"ENAS: tanh_constant must be positive or None, "
                             f"got {tanh_constant!r}")
        if isinstance(select_samples, bool) or not isinstance(select_samples, int) \
                or select_samples < 0:
            raise ValueError(f"ENAS: select_samples must be an int >= 0, got {select_samples!r}")
        if not isinstance(seed, int):
            raise ValueError(f"ENAS: seed must be an int, got {seed!r}")
        self.segments = segments
        self.batches_per_model = batches_per_model
        self.controller_steps = controller_steps
        self.eval_batches = eval_batches
        self.hidden_size = hidden_size
        self.controller_lr = controller_lr
        self.baseline_decay = baseline_decay
        self.entropy_weight = entropy_weight
        self.tanh_constant = tanh_constant
        self.select_samples = select_samples
        self.metric = metric
        self.mode = str(Mode.parse(mode, "ENAS"))
        self.seed = seed
        self.shared = check_shared(type(self).__name__, shared)
        self._shared: SharedTraining | None = None
        self._space: Any = None
        self._new_controller()
        self._baseline: float | None = None
        self._updates = 0  # controller updates so far: where the validation batches resume
        self._selected: dict | None = None
        self._seen: dict[str, dict] = {}  # paths the controller steps evaluated, by key

    # -- the controller -----------------------------------------------------------------------

    def _new_controller(self) -> None:
        # init_scale 0.1 as ENAS: the first policy is close to uniform.
        self._controller = Controller(self.hidden_size, self.seed, 0.1)
        self._optimizer = torch.optim.Adam(self._controller.parameters(), lr=self.controller_lr)

    def _add_head(self, label: str, candidates: list) -> int:
        head, created = self._controller.head(label, candidates)
        if created:
            params = [*self._controller.decoders[head].parameters(),
                      *self._controller.embeddings[head].parameters()]
            self._optimizer.add_param_group({"params": params})
        return head

    def _draw(self, rng, grad: bool = False) -> tuple[Any, _PolicySampler]:
        """A model of the space from the controller (``rng=None``: the most likely one)."""
        sampler = _PolicySampler(self, rng)
        with torch.set_grad_enabled(grad):
            model = self._space.sample(sampler)
        return model, sampler

    def reinforce(self, log_prob: torch.Tensor, entropy: torch.Tensor, reward: float) -> float:
        """One REINFORCE step of the controller for a path of log-probability ``log_prob``
        (with gradients) that earned ``reward`` (higher is better); returns the advantage
        ``reward - baseline``, the baseline moved first."""
        if self._baseline is None:
            self._baseline = reward
        else:
            self._baseline += (1 - self.baseline_decay) * (reward - self._baseline)
        advantage = reward - self._baseline
        loss = -advantage * log_prob - self.entropy_weight * entropy
        self._optimizer.zero_grad()
        loss.backward()
        self._optimizer.step()
        return advantage

    def probability(self, sample: dict) -> float:
        """The probability that the controller emits ``sample`` now (after :meth:`setup`)."""
        scored = _PolicySampler(self, None, fixed=sample)
        with torch.no_grad():
            self._space.sample(scored)
        return float(scored.log_prob.exp())

    # -- the OneShot interface ------------------------------------------------------------------

    def setup(self, space: Any, trainer: Any, hparams: dict, device: torch.device) -> None:
        self._space = space
        self._shared = SharedTraining(space, trainer, hparams, device, self.seed,
                                      shared=self.shared)
        self._new_controller()
        self._baseline, self._updates, self._selected = None, 0, None
        self._seen = {}

    def num_segments(self) -> int:
        return self.segments

    def run_segment(self, ctx: SegmentContext) -> SegmentResult:
        shared = ready(self, self._shared, ctx)
        with shared.own_rng():
            metrics = self._train(shared, ctx)
            models, rewards = self._update_controller(shared, ctx)
            if ctx.segment == self.segments - 1 and not ctx.should_stop():
                models += self._select(shared, ctx)
        if ctx.rank != 0:  # every rank evaluated the same paths (rewards averaged)
            models = []
        metrics["controller_steps"] = len(rewards)
        if rewards:  # (metrics are numbers only: none when a stop came first)
            metrics[f"mean_{self.metric}"] = sum(rewards) / len(rewards) * Mode(self.mode).sign
            metrics["baseline"] = self._baseline
        return SegmentResult(metrics, models)

    def _train(self, shared: SharedTraining, ctx: SegmentContext) -> dict:
        # each rank its own generator (seeded with the rank) and its own path; see own_path
        rngs = rank_rngs(self.seed, ctx.segment, ctx.world, "train")
        if shared.memory is not None:  # a device budget: the schedule planned (split.py)
            # (the controller does not change while the shared weights train, so drawing the
            # segment's paths first draws the same ones)
            metrics = shared.train_split(ctx, rngs, self.batches_per_model,
                                         lambda g: self._draw(g)[0])
            shared.end_segment()
            return {k: metrics[k] for k in ("train_loss", "batches", "windows", "split",
                                            "held_bytes")}
        losses: list[float] = []
        model = None
        for i, batch in enumerate(ctx.train_batches()):
            if ctx.should_stop():
                break
            if i % self.batches_per_model == 0:
                model = shared.own_path([self._draw(g)[0] for g in rngs], ctx)
            losses.append(shared.train(model, batch, ctx))
        shared.end_segment()
        return {"train_loss": sum(losses) / max(len(losses), 1), "batches": len(losses)}

    def _reward(self, shared: SharedTraining, model: Any, ctx: SegmentContext,
                valid: list) -> dict:
        """``metric`` of ``model`` on the next ``eval_batches`` of ``valid`` (cycling)."""
        n = len(valid)
        start = self._updates * self.eval_batches
        batches = [valid[(start + j) % n] for j in range(min(self.eval_batches, n))]
        metrics = mean_over_ranks(shared.evaluate(model, batches), ctx)
        if self.metric not in metrics:
            raise KeyError(f"ENAS rewards {self.metric!r} but the trainer's validation_step "
                           f"returned {sorted(metrics)}; pass metric= one of those")
        return metrics

    def _update_controller(self, shared: SharedTraining, ctx: SegmentContext):
        # Every rank draws the same paths (rank 0's stream) and averages its reward over the
        # ranks, so the controllers of all ranks stay identical.
        rng = segment_rng(self.seed, ctx.segment, 0, "controller")
        valid = list(ctx.valid_batches())
        if not valid:
            raise ValueError("ENAS: the validation loader gave no batches; the controller "
                             "learns from validation rewards")
        sign = Mode(self.mode).sign
        models, rewards = [], []
        for step in range(self.controller_steps):
            if ctx.should_stop():
                break
            model, sampler = self._draw(rng, grad=True)
            metrics = self._reward(shared, model, ctx, valid)
            reward = sign * metrics[self.metric]
            self.reinforce(sampler.log_prob, sampler.entropy, reward)
            self._updates += 1
            rewards.append(reward)
            self._seen.setdefault(sample_key(model.sample), dict(model.sample))
            models.append(EvaluatedModel(dict(model.sample), {**metrics, "controller_step": step}))
        return models, rewards

    def _select(self, shared: SharedTraining, ctx: SegmentContext) -> list[EvaluatedModel]:
        rng = segment_rng(self.seed, ctx.segment, 0, "select")
        valid = take(ctx.valid_batches(), self.eval_batches)
        sign = Mode(self.mode).sign
        candidates: dict[str, dict] = {}
        for draw_rng in [None] + [rng] * self.select_samples:  # the argmax path first
            model, _ = self._draw(draw_rng)
            candidates.setdefault(sample_key(model.sample), dict(model.sample))
        for key, sample in self._seen.items():  # every path evaluated, judged alike now
            candidates.setdefault(key, dict(sample))
        models, best = [], None
        for sample in candidates.values():
            metrics = mean_over_ranks(shared.evaluate(sample, valid), ctx)
            models.append(EvaluatedModel(sample, {**metrics, "select": 1}))
            if best is None or sign * metrics[self.metric] > best[1]:
                best = (sample, sign * metrics[self.metric])
        self._selected = best[0]
        return models

    def selected(self) -> dict:
        if self._selected is not None:
            return dict(self._selected)
        if self._space is None:
            raise RuntimeError("ENAS.selected(): call setup(space, ...) first")
        model, _ = self._draw(None)
        return dict(model.sample)

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        if self._shared is None:
            raise RuntimeError("ENAS.state_dict(): call setup(space, ...) first")
        return {"strategy": "ENAS", "config": self.config(),
                "shared": self._shared.state_dict(),
                "heads": list(self._controller.heads),  # in creation order
                "controller": self._controller.state_dict(),
                "controller_optimizer": self._optimizer.state_dict(),
                "baseline": self._baseline, "updates": self._updates,
                "selected": self._selected, "seen": list(self._seen.values())}

    def load_state_dict(self, state: dict) -> None:
        if self._shared is None:
            raise RuntimeError("ENAS.load_state_dict(): call setup(space, ...) first, then "
                               "load the state")
        check_state("ENAS", state, self.config())
        self._shared.load_state_dict(state["shared"])
        self._new_controller()
        for name in state["heads"]:  # re-create the heads in order: the optimizer's groups
            label, candidates = json.loads(name)
            self._add_head(label, candidates)
        self._controller.load_state_dict(state["controller"])
        self._optimizer.load_state_dict(state["controller_optimizer"])
        self._baseline = state["baseline"]
        self._updates = state["updates"]
        self._selected = state["selected"]
        # (a unit written before the selection judged every path has no "seen")
        self._seen = {sample_key(s): dict(s) for s in state.get("seen", [])}
