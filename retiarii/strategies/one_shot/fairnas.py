"""FairNAS (Chu, Zhang & Xu, "FairNAS: Rethinking Evaluation Fairness of Weight Sharing Neural
Architecture Search", ICCV 2021): strict fairness in super-net training, then a search over
accuracy and latency (NSGA-II) with the inherited weights.

Strict fairness: every super-net step draws K paths (K the number of candidates of a choice)
from one random permutation per choice, path j taking candidate ``perm[label][j]``, so that
every candidate of every choice is used exactly once in the step; the K paths' losses are
back-propagated on the same batch into summed gradients and the optimizer steps ONCE. A
choice with fewer candidates than the step's K (SCARLET-NAS: layers that cannot be skipped
have 6 candidates, the others 7) walks its own permutations one after the other, so each of
its candidates is used as evenly as K allows.

Example::

    s = FairNAS(train_segments=20, latency={"layer1": {"k3_e3": 0.0, "k5_e6": 0.4}})
    s.setup(space, trainer, {}, torch.device("cpu"))
"""
from __future__ import annotations

import math
import random
from typing import Any

import torch

from ...objectives import nsga_keys
from .base import SegmentContext, SegmentResult
from .shared_training import SharedTraining, segment_rng
from .spos import SPOS

__all__ = ["FairNAS", "fair_paths", "summed_step"]


class _Recorder:
    """Every choice at its first candidate, recording each label's candidates."""

    def __init__(self):
        self.sizes: dict[str, int] = {}

    def choose(self, label: str, candidates: list, context: dict) -> int:
        self.sizes[label] = len(candidates)
        return 0


class _Column:
    """Path ``j`` of a step: each label's candidate ``perms[label][j]``; a label first met
    here (a conditional choice) gets its permutation drawn now."""

    def __init__(self, perms: dict, j: int, k: int, rng: random.Random):
        self.perms, self.j, self.k, self.rng = perms, j, k, rng

    def choose(self, label: str, candidates: list, context: dict) -> int:
        n = len(candidates)
        if label not in self.perms or self.perms[label][0] != n:
            self.perms[label] = (n, _cycles(n, self.k, self.rng))
        return self.perms[label][1][self.j]


def _cycles(n: int, k: int, rng: random.Random) -> list[int]:
    """``k`` indices of ``range(n)``: shuffled permutations of it one after the other."""
    out: list[int] = []
    while len(out) < k:
        perm = list(range(n))
        rng.shuffle(perm)
        out.extend(perm)
    return out[:k]


def fair_paths(space: Any, rng: random.Random, k: int | None = None) -> list:
    """The K models of one strictly fair step (``k``: default the most candidates of a
    choice): column j of one permutation per label.

    Example::

        models = fair_paths(space, random.Random(0))     # 6 for FairNAS's 6 MBConvs
        {m.sample["layer1"] for m in models}             # every candidate once
    """
    if k is None:
        recorder = _Recorder()
        space.sample(recorder)
        k = max(recorder.sizes.values(), default=1)
    perms: dict[str, tuple[int, list[int]]] = {}
    return [space.sample(_Column(perms, j, k, rng)) for j in range(k)]


def summed_step(shared: SharedTraining, models: list, batch: Any) -> float:
    """One optimizer step from the summed gradients of ``models`` on ``batch`` (FairNAS's
    step); returns the mean loss.

    Raises:
        FloatingPointError: a path's loss is not finite (naming it).
    """
    from ...training import to_device

    batch = to_device(batch, shared.device)
    shared.optimizer.zero_grad(set_to_none=True)
    losses = []
    for model in models:
        net = shared.net(model)
        net.train()
        loss = shared.trainer.training_step(net, batch, shared.hparams)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"the loss of path {dict(model.sample)} is {value}; lower "
                                     f"the learning rate or check the trainer's training_step")
        if loss.requires_grad:
            loss.backward()  # accumulates: the K gradients are summed, not averaged
        losses.append(value)
    shared.optimizer.step()
    if shared.scheduler is not None and shared.interval == "step":
        shared.scheduler.step()
    return sum(losses) / len(losses)


class FairNAS(SPOS):
    """Strictly fair super-net training, then NSGA-II over (accuracy, latency).

    Training segments: each batch is one step of K paths (:func:`fair_paths`) whose summed
    gradients step the optimizer once (:func:`summed_step`). The search segment is SPOS's
    evolution with inherited weights (mutation and crossover), but parents are chosen as
    NSGA-II chooses them: by non-dominated rank over (``metric``, latency), then crowding
    distance. A candidate's latency is the sum of its choices' entries of ``latency``
    (``{label: {candidate: ms}}``, e.g. :func:`retiarii.engine.op_latency.choice_latencies`:
    each candidate's cost over the base model's); it is reported as ``latency_ms``.
    :meth:`selected` is the most accurate candidate whose latency is at most
    ``max_latency`` (any latency when None).

    Args:
        latency: the per-choice cost table (None: latency 0 for all; the search is then
            SPOS's, by accuracy alone).
        max_latency: the latency bound of the selected architecture (same unit as
            ``latency``, over the base model's).
        the others: see :class:`~retiarii.strategies.SPOS` (``batches_per_model`` and
            ``fair`` are FairNAS's own: one batch per step of K paths).
    """

    def __init__(self, train_segments: int = 10, search_population: int = 50,
                 search_generations: int = 20, eval_batches: int | None = 1, *,
                 latency: dict | None = None, max_latency: float | None = None,
                 search_parents: int = 10, mutation_prob: float = 0.1,
                 recalibrate_bn: bool = True, calibrate_batches: int = 4,
                 metric: str = "val_acc", seed: int = 0):
        super().__init__(train_segments, 1, search_population, search_generations,
                         eval_batches, search_parents=search_parents,
                         mutation_prob=mutation_prob, recalibrate_bn=recalibrate_bn,
                         calibrate_batches=calibrate_batches, metric=metric, mode="max",
                         fair=True, seed=seed)
        if latency is not None and not (isinstance(latency, dict) and all(
                isinstance(t, dict) for t in latency.values())):
            raise ValueError(f"FairNAS: latency must be {{label: {{candidate: cost}}}}, got "
                             f"{latency!r}")
        self.latency = {str(k): {str(c): float(v) for c, v in t.items()}
                        for k, t in (latency or {}).items()}
        self.max_latency = None if max_latency is None else float(max_latency)

    def config(self) -> dict:
        return {"train_segments": self.train_segments,
                "search_population": self.search_population,
                "search_generations": self.search_generations,
                "eval_batches": self.eval_batches, "latency": self.latency,
                "max_latency": self.max_latency, "search_parents": self.search_parents,
                "mutation_prob": self.mutation_prob, "recalibrate_bn": self.recalibrate_bn,
                "calibrate_batches": self.calibrate_batches, "metric": self.metric,
                "seed": self.seed}

    def setup(self, space: Any, trainer: Any, hparams: dict, device: torch.device) -> None:
        super().setup(space, trainer, hparams, device)
        for label, table in self.latency.items():  # a typo'd table is refused, not ignored
            recorder = _Recorder()
            space.sample(recorder)
            if label not in recorder.sizes:
                raise ValueError(f"FairNAS: latency table label {label!r} is not a choice of "
                                 f"the space; its choices are {sorted(recorder.sizes)}")

    def latency_of(self, sample: dict) -> float:
        """The candidate's latency by the table (0 for choices it leaves out)."""
        return sum(self.latency.get(label, {}).get(str(key), 0.0)
                   for label, key in sample.items())

    # -- training: K paths, summed gradients, one step ----------------------------------------

    def _train(self, shared: SharedTraining, ctx: SegmentContext) -> SegmentResult:
        if ctx.world > 1 or shared.memory is not None:
            raise ValueError("FairNAS trains on one rank without a device budget (its K "
                             "paths share one step); run it with ranks=1 and no "
                             "device_memory")
        rng = segment_rng(self.seed, ctx.segment, 0, "train")
        losses: list[float] = []
        paths = 0
        for batch in ctx.train_batches():
            if ctx.should_stop():
                break
            models = fair_paths(self._space, rng)
            losses.append(summed_step(shared, models, batch))
            paths += len(models)
        shared.end_segment()
        return SegmentResult({"train_loss": sum(losses) / max(len(losses), 1),
                              "paths": paths, "batches": len(losses), "steps": len(losses)})

    # -- search: NSGA-II over (accuracy, latency) ---------------------------------------------

    def _with_costs(self, sample: dict, metrics: dict) -> dict:
        return {**metrics, "latency_ms": self.latency_of(sample)}

    def _parents(self) -> list[dict]:
        members = list(self._evaluated.values())
        keys = nsga_keys([(-m[self.metric], self.latency_of(s)) for s, m in members])
        order = sorted(range(len(members)), key=lambda i: keys[i])
        return [members[i][0] for i in order[:self.search_parents]]

    def _best(self) -> tuple[dict, float] | None:
        feasible = [(s, m) for s, m in self._evaluated.values()
                    if self.max_latency is None or self.latency_of(s) <= self.max_latency]
        if not feasible:
            return None
        sample, metrics = max(feasible, key=lambda sm: (sm[1][self.metric],
                                                        -self.latency_of(sm[0])))
        return sample, metrics[self.metric]

