"""Single-path one-shot NAS, Guo et al., "Single Path One-Shot Neural Architecture Search with
Uniform Sampling", ECCV 2020: train a super-net one uniformly sampled path per batch, then
search it by evolution, ranking candidates by validation accuracy with inherited weights."""
from __future__ import annotations

from typing import Any

import torch

from ...cost_terms import CandidateFilter
from ...enums import Mode
from ...sampler import RandomSampler, index_of, sample_key
from .base import EvaluatedModel, OneShot, SegmentContext, SegmentResult
from .shared_training import (ExportsInherited, SharedTraining, check_positive, check_shared,
                              check_state, mean_over_ranks, rank_rngs, ready, segment_rng, take)


class _MutateSampler:
    """A parent's choices, each redrawn uniformly with probability ``prob`` (a choice the
    parent lacks, or whose key is gone, is drawn too)."""

    def __init__(self, parent: dict, prob: float, rng):
        self.parent, self.prob, self.rng = parent, prob, rng

    def choose(self, label: str, candidates: list, context: dict) -> int:
        index = index_of(candidates, self.parent[label]) if label in self.parent else None
        if index is None or self.rng.random() < self.prob:
            return self.rng.randrange(len(candidates))
        return index


class _CrossoverSampler:
    """Each choice from one of two parents, picked by a fair coin (uniform crossover)."""

    def __init__(self, a: dict, b: dict, rng):
        self.a, self.b, self.rng = a, b, rng

    def choose(self, label: str, candidates: list, context: dict) -> int:
        first, second = (self.a, self.b) if self.rng.random() < 0.5 else (self.b, self.a)
        for parent in (first, second):
            if label in parent:
                index = index_of(candidates, parent[label])
                if index is not None:
                    return index
        return self.rng.randrange(len(candidates))


class _FairSampler:
    """FairNAS's strict fairness (Chu et al., ICCV 2021): a choice of K candidates takes each
    of them once in every K draws of it, in an order shuffled anew for each cycle (one cycle
    per label; a label whose number of candidates changes starts a new cycle)."""

    def __init__(self, rng):
        self.rng = rng
        self._left: dict[str, tuple[int, list[int]]] = {}  # label -> (K, indices left)

    def choose(self, label: str, candidates: list, context: dict) -> int:
        k, left = self._left.get(label, (0, []))
        if not left or k != len(candidates):
            k, left = len(candidates), list(range(len(candidates)))
            self.rng.shuffle(left)
            self._left[label] = (k, left)
        return left.pop()


class SPOS(ExportsInherited, OneShot):
    """Single-path one-shot: uniform path sampling on a super-graph, then evolutionary search.

    Segments ``0 .. train_segments-1`` train: every ``batches_per_model`` training batches a
    path is drawn uniformly (each choice independently, as :class:`~retiarii.strategies.Random`
    draws) and trained on the shared weights with the trainer's loss and optimizer. The last
    segment searches: ``search_population`` random candidates, then ``search_generations - 1``
    generations, each of ``search_population`` children (half mutations of one parent, each
    choice redrawn with probability ``mutation_prob``, half uniform crossovers of two),
    parents drawn from the ``search_parents`` best candidates so far. A candidate is ranked
    by ``metric`` (averaged ``trainer.validation_step`` over ``eval_batches`` validation
    batches) with the inherited weights and no training; with ``recalibrate_bn`` its
    BatchNorm statistics are first recomputed on ``calibrate_batches`` training batches (the
    super-graph's statistics are restored after each candidate). :meth:`selected` is the best
    candidate (the space's default sample before the search).

    Example (``space`` a ModelSpace, ``trainer`` a Trainer)::

        s = SPOS(train_segments=20, search_population=20, search_generations=5)
        s.setup(space, trainer, {}, torch.device("cpu"))
        for seg in range(s.num_segments()):
            s.run_segment(SegmentContext(seg, trainer, {}, torch.device("cpu")))
        model = space.build(s.selected())

    Args:
        train_segments: segments (epochs) of super-net training.
        batches_per_model: training batches per sampled path (SPOS: 1).
        search_population: candidates per generation (SPOS: 50).
        search_generations: generations of the search, the random first one included
            (SPOS: 20).
        search_parents: the best candidates that breed (SPOS: top 10).
        mutation_prob: probability that a mutation redraws each choice (SPOS: 0.1).
        eval_batches: validation batches per candidate (``None``: the whole loader).
        recalibrate_bn: recompute BatchNorm statistics per candidate before evaluating.
        calibrate_batches: training batches for that recalibration.
        metric: the validation metric that ranks candidates.
        mode: ``"max"`` (``metric`` higher is better, default) or ``"min"``.
        fair: FairNAS's strict fairness instead of independent uniform draws: within a
            segment, each choice of K candidates takes every one of them once per K paths
            (FairNAS also sums the K paths' gradients into one step; here each path steps).
        seed: seeds the initial weights, the sampling and the search.
        shared: annotate which operators share weights, as ``fnmatch`` patterns of their
            module paths (``["stem", "cells.*"]``); the others are private to each
            architecture. None (default): the whole space shares weights.
        constraints: the search's constraints on the predicted latency, as
            ``Experiment``'s (``["predicted_latency_ms <= 0.6"]``): a candidate the lookup
            table ``latency`` predicts over them is never evaluated nor bred from (Once-for-All
            and SPOS search under a latency constraint so); the search draws others instead.
        latency: the lookup table of those predictions
            (:class:`~retiarii.cost_terms.LatencyLUT` as JSON: ``LatencyLUT.of(space,
            OpLatencyTable(store)).to_json()``).
    """

    def __init__(self, train_segments: int = 10, batches_per_model: int = 1,
                 search_population: int = 50, search_generations: int = 20,
                 eval_batches: int | None = 1, *, search_parents: int = 10,
                 mutation_prob: float = 0.1, recalibrate_bn: bool = True,
                 calibrate_batches: int = 4, metric: str = "val_acc", mode: str = "max",
                 fair: bool = False, seed: int = 0, shared: list[str] | None = None,
                 constraints: list[str] | None = None, latency: dict | None = None):
        check_positive("SPOS", train_segments=train_segments,
                       batches_per_model=batches_per_model, search_population=search_population,
                       search_generations=search_generations, search_parents=search_parents,
                       calibrate_batches=calibrate_batches)
        if eval_batches is not None:
            check_positive("SPOS", eval_batches=eval_batches)
        if not 0 <= mutation_prob <= 1:
            raise ValueError(f"SPOS: mutation_prob must be in [0, 1], got {mutation_prob!r}")
        if not isinstance(seed, int):
            raise ValueError(f"SPOS: seed must be an int, got {seed!r}")
        if not isinstance(fair, bool):
            raise ValueError(f"SPOS: fair must be True or False, got {fair!r}")
        self.fair = fair
        self._filter = CandidateFilter(constraints or [], latency)
        self.constraints = [str(c) for c in self._filter.constraints]
        self.latency = None if self._filter.lut is None else self._filter.lut.to_json()
        self._rejected = 0  # candidates of the search the constraints ruled out
        self.train_segments = train_segments
        self.batches_per_model = batches_per_model
        self.search_population = search_population
        self.search_generations = search_generations
        self.search_parents = search_parents
        self.mutation_prob = mutation_prob
        self.eval_batches = eval_batches
        self.recalibrate_bn = recalibrate_bn
        self.calibrate_batches = calibrate_batches
        self.metric = metric
        self.mode = str(Mode.parse(mode, "SPOS"))
        self.seed = seed
        self.shared = check_shared(type(self).__name__, shared)
        self._shared: SharedTraining | None = None
        self._space: Any = None
        # key -> (sample, metrics) of every candidate the search evaluated, in order
        self._evaluated: dict[str, tuple[dict, dict]] = {}

    def setup(self, space: Any, trainer: Any, hparams: dict, device: torch.device) -> None:
        self._space = space
        self._shared = SharedTraining(space, trainer, hparams, device, self.seed,
                                      shared=self.shared)
        self._evaluated = {}

    def num_segments(self) -> int:
        return self.train_segments + 1

    def run_segment(self, ctx: SegmentContext) -> SegmentResult:
        shared = ready(self, self._shared, ctx)
        with shared.own_rng():
            if ctx.segment < self.train_segments:
                return self._train(shared, ctx)
            return self._search(shared, ctx)

    # -- phase 1: uniform single-path training ---------------------------------------------

    def _train(self, shared: SharedTraining, ctx: SegmentContext) -> SegmentResult:
        # each rank its own generator (seeded with the rank) and its own path; see own_path
        rngs = rank_rngs(self.seed, ctx.segment, ctx.world, "train")
        # (a fair sampler's cycles start at each segment: its draws follow from the segment's
        # generator alone, so a resumed segment draws what an uninterrupted one does)
        samplers = [_FairSampler(g) if self.fair else RandomSampler(g) for g in rngs]
        if shared.memory is not None:
            return self._train_split(shared, ctx, samplers)
        losses: list[float] = []
        model = None
        for i, batch in enumerate(ctx.train_batches()):
            if ctx.should_stop():
                break
            if i % self.batches_per_model == 0:
                model = shared.own_path([self._space.sample(s) for s in samplers], ctx)
            losses.append(shared.train(model, batch, ctx))
        shared.end_segment()
        paths = -(-len(losses) // self.batches_per_model)
        return SegmentResult({"train_loss": sum(losses) / max(len(losses), 1),
                              "paths": paths, "batches": len(losses)})

    def _train_split(self, shared: SharedTraining, ctx: SegmentContext,
                     samplers: list) -> SegmentResult:
        """Phase 1 under a device budget (``device_memory``): the segment's models are drawn
        first (each step's K, as the plain loop draws them) and the packing code decides which
        rank trains and holds which (:mod:`retiarii.optim.split`)."""
        metrics = shared.train_split(ctx, samplers, self.batches_per_model,
                                     lambda s: self._space.sample(s))
        shared.end_segment()
        return SegmentResult(metrics)

    # -- phase 2: evolutionary search with inherited weights ---------------------------------

    def _search(self, shared: SharedTraining, ctx: SegmentContext) -> SegmentResult:
        # The search's draws are the same on every rank (rank 0's stream): ranks evaluate the
        # same candidates on their own validation shares and average (mean_over_ranks).
        rng = segment_rng(self.seed, ctx.segment, 0, "search")
        self._rejected = 0
        valid = take(ctx.valid_batches(), self.eval_batches)
        calibrate = take(ctx.train_batches(), self.calibrate_batches) \
            if self.recalibrate_bn else None
        models: list[EvaluatedModel] = []
        population = self._children(rng, None, self.search_population)
        for generation in range(self.search_generations):
            for sample in population:
                if ctx.should_stop():
                    break
                metrics = mean_over_ranks(shared.evaluate(sample, valid, calibrate), ctx)
                self._check_metric(metrics)
                metrics = self._with_costs(sample, metrics)
                self._evaluated[sample_key(sample)] = (sample, metrics)
                models.append(EvaluatedModel(sample, {**metrics, "generation": generation}))
            if ctx.should_stop() or generation + 1 == self.search_generations:
                break
            parents = self._parents()
            population = self._children(rng, parents, self.search_population)
            if not population:  # every model of the space was evaluated
                break
        best = self._best()
        metrics = {"candidates": len(models)}
        if self.constraints:
            metrics["rejected_by_constraints"] = self._rejected
        if best is not None:  # (metrics are numbers only)
            metrics[f"best_{self.metric}"] = best[1]
        # every rank evaluated the same candidates (metrics averaged): rank 0 reports them
        return SegmentResult(metrics, models if ctx.rank == 0 else [])

    def _children(self, rng, parents: list[dict] | None, n: int) -> list[dict]:
        """Up to ``n`` new samples: random ones (no parents), else half mutations, half
        crossovers; never one evaluated before. Fewer when the space runs out."""
        children: dict[str, dict] = {}
        misses = 0
        while len(children) < n and misses < 100 * n:
            if parents is None:
                sampler: Any = RandomSampler(rng)
            elif len(children) < n // 2 or len(parents) < 2:
                sampler = _MutateSampler(parents[rng.randrange(len(parents))],
                                         self.mutation_prob, rng)
            else:
                a, b = rng.sample(parents, 2)
                sampler = _CrossoverSampler(a, b, rng)
            sample = dict(self._space.sample(sampler).sample)
            key = sample_key(sample)
            if key in children or key in self._evaluated:
                misses += 1
                continue
            if not self._filter.feasible(sample):  # never evaluated: the table rules it out
                self._rejected += 1
                misses += 1
                continue
            children[key] = sample
        return list(children.values())

    def _with_costs(self, sample: dict, metrics: dict) -> dict:
        """A candidate's metrics with what else ranks it (FairNAS adds its latency)."""
        return metrics

    def _parents(self) -> list[dict]:
        """The ``search_parents`` best candidates so far, by ``metric``."""
        sign = Mode(self.mode).sign
        ranked = sorted(self._evaluated.values(), key=lambda sm: -sign * sm[1][self.metric])
        return [s for s, _ in ranked[:self.search_parents]]

    def _check_metric(self, metrics: dict) -> None:
        if self.metric not in metrics:
            raise KeyError(f"SPOS ranks candidates by {self.metric!r} but the trainer's "
                           f"validation_step returned {sorted(metrics)}; pass metric= one of "
                           f"those")

    def _best(self) -> tuple[dict, float] | None:
        if not self._evaluated:
            return None
        sign = Mode(self.mode).sign
        sample, metrics = max(self._evaluated.values(), key=lambda sm: sign * sm[1][self.metric])
        return sample, metrics[self.metric]

    def export_state(self, sample: dict) -> dict[str, torch.Tensor]:
        """The weights ``sample`` inherits, with the BatchNorm statistics its evaluation
        used when ``recalibrate_bn`` (recomputed on the search segment's first
        ``calibrate_batches`` training batches): the exported module computes what the
        search measured."""
        if not self.recalibrate_bn or self._shared is None:
            return super().export_state(sample)
        shared = self._shared
        batches = take(shared.trainer.train_dataloader(shared.hparams, self.num_segments() - 1),
                       self.calibrate_batches)
        return shared.calibrated_state(sample, batches)

    def selected(self) -> dict:
        best = self._best()
        if best is not None:
            return dict(best[0])
        if self._space is None:
            raise RuntimeError("SPOS.selected(): call setup(space, ...) first")
        return self._space.default_sample()

    def config(self) -> dict:
        config = super().config()
        if self.latency is not None:  # (a dict: the default config keeps plain values only)
            config["latency"] = self.latency
        if not self.constraints:  # (configs saved before constraints existed still match)
            config.pop("constraints", None)
        return config

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        if self._shared is None:
            raise RuntimeError("SPOS.state_dict(): call setup(space, ...) first")
        return {"strategy": "SPOS", "config": self.config(),
                "shared": self._shared.state_dict(),
                "evaluated": [[s, m] for s, m in self._evaluated.values()]}

    def load_state_dict(self, state: dict) -> None:
        if self._shared is None:
            raise RuntimeError("SPOS.load_state_dict(): call setup(space, ...) first, then "
                               "load the state")
        check_state("SPOS", state, self.config())
        self._shared.load_state_dict(state["shared"])
        self._evaluated = {sample_key(s): (dict(s), dict(m)) for s, m in state["evaluated"]}
