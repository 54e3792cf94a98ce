"""Once-for-All (Cai, Gan, Wang, Zhang & Han, "Once-for-All: Train One Network and Specialize it
for Efficient Deployment", ICLR 2020): progressive shrinking of one elastic network, then an
evolutionary search guided by an accuracy predictor under a latency constraint.

Training segments run four phases in order, ``epochs`` segments each; every batch trains one
sub-network drawn uniformly from the phase's allowed set (:data:`PHASES`):

1. ``full``: the largest network (kernel 7, expansion 6, depth 4);
2. ``kernel``: kernels {3, 5, 7} (the smaller ones through the kernel transformation
   matrices, :mod:`retiarii.optim.elastic`), the rest largest;
3. ``depth``: depths {2, 3, 4} too (a unit keeps its first d layers);
4. ``width``: expansions {3, 4, 6} too, after the hidden channels are sorted by importance.

From phase 2 on, the loss adds knowledge distillation from the largest network as phase 1
left it (``kd_weight`` x KL of the soft labels; 0 turns it off). The search segment measures
``predictor_samples`` random sub-networks on the shared weights (BatchNorm statistics
recalibrated each), trains an MLP accuracy predictor on their encodings (per layer slot a
one-hot kernel and expansion, zeros past the unit's depth), then runs an evolution (mutation
and crossover of the top candidates) ranked by the predictor over the sub-networks whose
latency (by the operator table: :func:`ofa_latency_table`) is at most ``max_latency``; the
best one is measured and selected.

Example::

    s = OnceForAll(epochs=2, latency=ofa_latency_table(space, OpLatencyTable(store)))
    s.setup(space, trainer, {}, torch.device("cpu"))
"""
from __future__ import annotations

import copy
import math
import random
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...optim.elastic import ElasticBody
from ...training import to_device
from .base import EvaluatedModel, OneShot, SegmentContext, SegmentResult
from .shared_training import check_positive, check_state, take
from .supernet import MobileSkeleton, average_metrics, macro_of, seeded, trainer_optimizer

__all__ = ["OnceForAll", "PHASES", "encode", "ofa_latency_table"]

# phase -> (kernels, expansions, depths) its sub-networks are drawn from
PHASES = {"full": ((7,), (6,), (4,)), "kernel": ((3, 5, 7), (6,), (4,)),
          "depth": ((3, 5, 7), (6,), (2, 3, 4)), "width": ((3, 5, 7), (3, 4, 6), (2, 3, 4))}
_ORDER = tuple(PHASES)
_ACTS = {"relu": nn.ReLU, "hardswish": nn.Hardswish}


def encode(config, slots: int = 4) -> list[float]:
    """The predictor's input: per unit and layer slot, one-hot kernel and expansion (zeros
    past the unit's depth)."""
    out: list[float] = []
    k_all, e_all, _ = PHASES["width"]
    for depth, layers in config:
        for i in range(slots):
            k, e = layers[i] if i < depth else (None, None)
            out += [float(k == v) for v in k_all] + [float(e == v) for v in e_all]
    return out


def ofa_latency_table(space: Any, table: Any) -> dict:
    """The latency lookup of the OFA space by the operator table (ms): ``base`` (every unit
    at depth 2, kernel 3, expansion 3) and per unit the cost of its first and of a later
    layer slot at each ``k{k}_e{e}`` over ``k3_e3``, and ``layer``, one more layer at k3_e3.
    The later slots share their shapes, so their operator calls and costs are the same.
    """
    base = space.default_sample()
    example = space.example_input[:1]

    def ms(sample):
        return table.predict(space.instantiate(sample).to_module(), example)

    ref = ms(base)
    out: dict = {"base": ref}
    units = sorted({label.split("/")[0] for label in base})
    k_all, e_all, _ = PHASES["width"]
    for unit in units:
        entry: dict = {}
        for slot, layer in (("first", 1), ("rest", 2)):
            entry[slot] = {f"k{k}_e{e}": ms({**base, f"{unit}/layer{layer}/kernel": k,
                                            f"{unit}/layer{layer}/expansion": e}) - ref
                           for k in k_all for e in e_all}
        entry["layer"] = ms({**base, f"{unit}/depth": 3, f"{unit}/layer3/kernel": 3,
                             f"{unit}/layer3/expansion": 3}) - ref
        out[unit] = entry
    return out


class _Recorder(nn.Module):
    """The network the trainer runs, keeping its input and output for distillation."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        self.x, self.out = x, self.net(x)
        return self.out


class OnceForAll(OneShot):
    """Progressive shrinking, then predictor-guided evolution under a latency constraint.

    Args:
        epochs: segments per phase (4 phases, then one search segment).
        kd_weight: weight of the distillation term from phase 2 on (0: none).
        latency: :func:`ofa_latency_table`'s dict (None: every sub-network costs 0).
        max_latency: the constraint (ms); None: halfway between the space's least and
            greatest latency by the table.
        predictor_samples: sub-networks measured to train the accuracy predictor.
        predictor_steps: full-batch Adam steps of the predictor.
        search_population, search_generations, search_parents, mutation_prob: the
            evolution's (OFA: 100, 500, 25, 0.1).
        eval_batches, calibrate_batches: validation batches per measurement; training
            batches that recalibrate its BatchNorm statistics.
        metric: the validation metric the predictor learns (higher is better).
        seed: seeds the weights, the sampling and the search.
    """

    def __init__(self, epochs: int = 1, kd_weight: float = 1.0, latency: dict | None = None,
                 max_latency: float | None = None, predictor_samples: int = 16,
                 predictor_steps: int = 300, search_population: int = 16,
                 search_generations: int = 5, search_parents: int = 4,
                 mutation_prob: float = 0.2, eval_batches: int | None = 2,
                 calibrate_batches: int = 2, metric: str = "val_acc", seed: int = 0):
        check_positive("OnceForAll", epochs=epochs, predictor_samples=predictor_samples,
                       predictor_steps=predictor_steps, search_population=search_population,
                       search_generations=search_generations, search_parents=search_parents,
                       calibrate_batches=calibrate_batches)
        if kd_weight < 0 or not 0 <= mutation_prob <= 1:
            raise ValueError(f"OnceForAll: kd_weight must be >= 0 and mutation_prob in [0, 1], "
                             f"got {kd_weight!r}, {mutation_prob!r}")
        self.epochs, self.kd_weight = epochs, float(kd_weight)
        self.latency = latency
        self.max_latency = None if max_latency is None else float(max_latency)
        self.predictor_samples, self.predictor_steps = predictor_samples, predictor_steps
        self.search_population, self.search_generations = search_population, search_generations
        self.search_parents, self.mutation_prob = search_parents, mutation_prob
        self.eval_batches, self.calibrate_batches = eval_batches, calibrate_batches
        self.metric, self.seed = metric, seed
        self._net: MobileSkeleton | None = None

    def config(self) -> dict:
        return {k: getattr(self, k) for k in (
            "epochs", "kd_weight", "latency", "max_latency", "predictor_samples",
            "predictor_steps", "search_population", "search_generations", "search_parents",
            "mutation_prob", "eval_batches", "calibrate_batches", "metric", "seed")}

    def setup(self, space: Any, trainer: Any, hparams: dict, device: torch.device) -> None:
        macro = macro_of(space, "OnceForAll", "elastic", "model_spaces.once_for_all.small()")
        self._space, self._trainer, self._hparams, self._device = space, trainer, hparams, device
        units = [(c_in, c_out, s, se, _ACTS[act]) for c_in, c_out, s, se, act in macro["units"]]
        with seeded(self.seed, -1, "init"):
            body = ElasticBody(units)
            self._net = MobileSkeleton(macro, body, act=nn.Hardswish,
                                       first_act=nn.ReLU).to(device)
        self._units = len(units)
        self._opt = trainer_optimizer(trainer, self._net, hparams)
        self._teacher: MobileSkeleton | None = None
        self._history: list[dict] = []  # per training segment: its phase and what it drew
        self._search: list[list[float]] = []  # (latency, predicted) of every candidate ranked
        self._selected: dict | None = None

    def num_segments(self) -> int:
        return len(_ORDER) * self.epochs + 1

    def phase(self, segment: int) -> str | None:
        """The phase segment ``segment`` trains (None: the search)."""
        return _ORDER[segment // self.epochs] if segment < len(_ORDER) * self.epochs else None

    # -- sub-networks ------------------------------------------------------------------------

    def draw(self, rng: random.Random, phase: str = "width") -> list:
        """A sub-network drawn uniformly from ``phase``'s allowed set."""
        ks, es, ds = PHASES[phase]
        return [(d, [(rng.choice(ks), rng.choice(es)) for _ in range(d)])
                for d in (rng.choice(ds) for _ in range(self._units))]

    def sample_of(self, config) -> dict:
        """The space's sample of a sub-network (the labels of model_spaces/once_for_all.py)."""
        out: dict = {}
        for u, (depth, layers) in enumerate(config, 1):
            out[f"unit{u}/depth"] = depth
            for i, (k, e) in enumerate(layers, 1):
                out[f"unit{u}/layer{i}/kernel"], out[f"unit{u}/layer{i}/expansion"] = k, e
        return out

    def latency_of(self, config) -> float:
        """The sub-network's latency (ms) by the table (0 without one)."""
        t = self.latency
        if not t:
            return 0.0
        total = t["base"]
        for u, (depth, layers) in enumerate(config, 1):
            unit = t[f"unit{u}"]
            for i, (k, e) in enumerate(layers):
                total += unit["first" if i == 0 else "rest"][f"k{k}_e{e}"]
                total += unit["layer"] if i >= 2 else 0.0
        return total

    def bound(self) -> float:
        """The latency constraint: ``max_latency``, or halfway between the least and the
        greatest latency of the space by the table."""
        if self.max_latency is not None or not self.latency:
            return math.inf if self.max_latency is None else self.max_latency
        lo = hi = self.latency["base"]
        for u in range(1, self._units + 1):
            unit = self.latency[f"unit{u}"]
            per = [min(unit["first"].values()) + min(unit["rest"].values())
                   + (d - 2) * (unit["layer"] + min(unit["rest"].values())) for d in (2, 3, 4)]
            top = [max(unit["first"].values()) + max(unit["rest"].values())
                   + (d - 2) * (unit["layer"] + max(unit["rest"].values())) for d in (2, 3, 4)]
            lo, hi = lo + min(per), hi + max(top)
        return (lo + hi) / 2

    # -- training: progressive shrinking -----------------------------------------------------

    def run_segment(self, ctx: SegmentContext) -> SegmentResult:
        if self._net is None:
            raise RuntimeError("OnceForAll.run_segment(): call setup(...) first")
        if not 0 <= ctx.segment < self.num_segments():
            raise ValueError(f"OnceForAll: segment {ctx.segment} is out of range 0.."
                             f"{self.num_segments() - 1}")
        phase = self.phase(ctx.segment)
        with seeded(self.seed, ctx.segment, phase or "search") as rng:
            if phase is None:
                return self._search_segment(ctx, rng)
            return self._train(ctx, phase, rng)

    def _start_phase(self, phase: str) -> None:
        if phase != "full" and self._teacher is None and self.kd_weight > 0:
            # the teacher: the largest network as the first phase left it
            self._teacher = copy.deepcopy(self._net).eval()
            for p in self._teacher.parameters():
                p.requires_grad_(False)
        if phase == "width":
            self._net.body.sort_channels()
        # a fresh optimizer per phase (OFA sets each phase's rate; sorting also moved the
        # channels under any moments)
        self._opt = trainer_optimizer(self._trainer, self._net, self._hparams)

    def _train(self, ctx: SegmentContext, phase: str, rng: random.Random) -> SegmentResult:
        if ctx.segment % self.epochs == 0:
            self._start_phase(phase)
        net, recorder = self._net, _Recorder(self._net)
        drawn: dict[str, set] = {"kernels": set(), "expansions": set(), "depths": set()}
        losses, kd_losses = [], []
        net.train()
        for batch in ctx.train_batches():
            if ctx.should_stop():
                break
            config = self.draw(rng, phase)
            for d, layers in config:
                drawn["depths"].add(d)
                drawn["kernels"].update(k for k, _ in layers)
                drawn["expansions"].update(e for _, e in layers)
            net.config = config
            self._opt.zero_grad(set_to_none=True)
            loss = ctx.trainer.training_step(recorder, to_device(batch, ctx.device), ctx.hparams)
            if self._teacher is not None and phase != "full":
                with torch.no_grad():
                    soft = F.softmax(self._teacher(recorder.x), dim=1)
                kd = F.kl_div(F.log_softmax(recorder.out, dim=1), soft, reduction="batchmean")
                loss = loss + self.kd_weight * kd
                kd_losses.append(float(kd.detach()))
            value = float(loss.detach())
            if not math.isfinite(value):
                raise FloatingPointError(f"OnceForAll: the loss is {value} in phase {phase}; "
                                         f"lower the learning rate")
            loss.backward()
            self._opt.step()
            losses.append(value)
        net.config = None
        self._history.append({"segment": ctx.segment, "phase": phase,
                              **{k: sorted(v) for k, v in drawn.items()}})
        metrics = {"phase": _ORDER.index(phase), "train_loss": sum(losses) / max(len(losses), 1),
                   "batches": len(losses)}
        if kd_losses:
            metrics["kd_loss"] = sum(kd_losses) / len(kd_losses)
        return SegmentResult(metrics)

    # -- search: predictor-guided evolution under the latency constraint ---------------------

    def _measure(self, config, valid, calibrate, device) -> dict:
        """The metrics of a sub-network on the shared weights, its BatchNorm statistics first
        recomputed on ``calibrate`` (the super-network's restored after)."""
        net = self._net
        bns = [m for m in net.modules() if isinstance(m, nn.BatchNorm2d)]
        saved = [(m.momentum, {k: v.clone() for k, v in m.named_buffers()}) for m in bns]
        net.config = config
        try:
            for m in bns:
                m.reset_running_stats()
                m.momentum = None  # a cumulative average over the batches
            net.train()
            with torch.no_grad():
                for batch in calibrate:
                    x = to_device(batch, device)
                    net(x[0] if isinstance(x, (tuple, list)) else x)
            return average_metrics(self._trainer, net, valid, device)
        finally:
            net.config = None
            for m, (momentum, buffers) in zip(bns, saved):
                m.momentum = momentum
                for k, v in buffers.items():
                    getattr(m, k).copy_(v)

    def _fit_predictor(self, xs: list, ys: list) -> nn.Module:
        x, y = torch.tensor(xs), torch.tensor(ys, dtype=torch.float32)
        mean, std = float(y.mean()), float(y.std()) if len(ys) > 1 else 1.0
        std = std if std > 1e-8 else 1.0
        mlp = nn.Sequential(nn.Linear(x.shape[1], 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                            nn.Linear(64, 1))
        opt = torch.optim.Adam(mlp.parameters(), lr=1e-2)
        for _ in range(self.predictor_steps):
            opt.zero_grad()
            loss = F.mse_loss(mlp(x).squeeze(1), (y - mean) / std)
            loss.backward()
            opt.step()
        mlp.eval()
        self._predictor_mse = float(loss.detach()) * std * std

        def predict(configs):
            with torch.no_grad():
                return (mlp(torch.tensor([encode(c) for c in configs])).squeeze(1) * std
                        + mean).tolist()
        return predict

    def _child(self, rng: random.Random, parents: list) -> list:
        a = parents[rng.randrange(len(parents))]
        if len(parents) > 1 and rng.random() < 0.5:  # crossover: each unit from one parent
            b = parents[rng.randrange(len(parents))]
            return [copy.deepcopy(rng.choice((ua, ub))) for ua, ub in zip(a, b)]
        ks, es, ds = PHASES["width"]
        out = []
        for depth, layers in a:  # mutation: each gene redrawn with mutation_prob
            slots = list(layers) + [(rng.choice(ks), rng.choice(es))
                                    for _ in range(max(ds) - depth)]
            if rng.random() < self.mutation_prob:
                depth = rng.choice(ds)
            slots = [(rng.choice(ks) if rng.random() < self.mutation_prob else k,
                      rng.choice(es) if rng.random() < self.mutation_prob else e)
                     for k, e in slots]
            out.append((depth, slots[:depth]))
        return out

    def _feasible(self, make, bound: float) -> list | None:
        for _ in range(200):
            config = make()
            if self.latency_of(config) <= bound:
                return config
        return None

    def _search_segment(self, ctx: SegmentContext, rng: random.Random) -> SegmentResult:
        valid = take(ctx.valid_batches(), self.eval_batches)
        calibrate = take(ctx.train_batches(), self.calibrate_batches)
        models, xs, ys = [], [], []
        for _ in range(self.predictor_samples):
            config = self.draw(rng)
            metrics = self._measure(config, valid, calibrate, ctx.device)
            if self.metric not in metrics:
                raise KeyError(f"OnceForAll's predictor learns {self.metric!r} but the "
                               f"trainer's validation_step returned {sorted(metrics)}; pass "
                               f"metric= one of those")
            xs.append(encode(config))
            ys.append(metrics[self.metric])
            models.append(EvaluatedModel(self.sample_of(config), {
                **metrics, "latency_ms": self.latency_of(config), "measured_for_predictor": 1}))
        predict = self._fit_predictor(xs, ys)
        bound = self.bound()
        population = [c for c in (self._feasible(lambda: self.draw(rng), bound)
                                  for _ in range(self.search_population)) if c is not None]
        if not population:
            raise ValueError(f"OnceForAll: no sub-network of 200 drawn has a latency within "
                             f"max_latency={bound} ms; raise max_latency")
        ranked: list[tuple[float, list]] = []
        for generation in range(self.search_generations):
            scores = predict(population)
            ranked += list(zip(scores, population))
            self._search += [[self.latency_of(c), s] for s, c in zip(scores, population)]
            ranked.sort(key=lambda sc: -sc[0])
            parents = [c for _, c in ranked[:self.search_parents]]
            if generation + 1 < self.search_generations:
                population = [c for c in (self._feasible(lambda: self._child(rng, parents),
                                                         bound)
                                          for _ in range(self.search_population))
                              if c is not None] or parents
        predicted, best = ranked[0]
        metrics = self._measure(best, valid, calibrate, ctx.device)
        self._selected = self.sample_of(best)
        models.append(EvaluatedModel(self._selected, {
            **metrics, "latency_ms": self.latency_of(best), "predicted": predicted}))
        return SegmentResult({"candidates": len(self._search), "max_latency_ms": bound,
                              "predictor_mse": self._predictor_mse,
                              f"best_{self.metric}": metrics[self.metric]}, models)

    def selected(self) -> dict:
        """The searched sub-network (the space's default before the search)."""
        if self._selected is not None:
            return dict(self._selected)
        if self._net is None:
            raise RuntimeError("OnceForAll.selected(): call setup(space, ...) first")
        return self._space.default_sample()

    def history(self) -> list[dict]:
        """Per training segment so far: its phase and the kernels, expansions and depths it
        drew."""
        return [dict(h) for h in self._history]

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        if self._net is None:
            raise RuntimeError("OnceForAll.state_dict(): call setup(space, ...) first")
        return {"strategy": "OnceForAll", "config": self.config(),
                "net": self._net.state_dict(), "opt": self._opt.state_dict(),
                "teacher": None if self._teacher is None else self._teacher.state_dict(),
                "history": self._history, "search": self._search, "selected": self._selected}

    def load_state_dict(self, state: dict) -> None:
        if self._net is None:
            raise RuntimeError("OnceForAll.load_state_dict(): call setup(space, ...) first")
        check_state("OnceForAll", state, self.config())
        self._net.load_state_dict(state["net"])
        self._opt.load_state_dict(state["opt"])
        if state["teacher"] is not None:
            self._teacher = copy.deepcopy(self._net).eval()
            self._teacher.load_state_dict(state["teacher"])
            for p in self._teacher.parameters():
                p.requires_grad_(False)
        self._history = [dict(h) for h in state["history"]]
        self._search = [list(x) for x in state["search"]]
        self._selected = None if state["selected"] is None else dict(state["selected"])
