"""The NAS solutions of the literature, one row each: space, strategy, paper, status.

The Retiarii paper (OSDI'20, Table 1) shows 27 published NAS solutions as a base model plus
mutators plus a strategy. This module is their registry: ``retiarii nas list`` prints it and
``retiarii nas run NAME`` searches a row's space on the digits data set through
:class:`~retiarii.Experiment`. A row whose space is written lives in ``model_spaces/`` (one
file per space, with a ``small`` preset that trains on 8x8 digits in seconds and a ``paper``
preset with the published sizes). Rows whose published strategy shares weights run their
paper's one-shot strategy (``runs_with``) through the engine's one-shot host
(docs/weight_sharing.md): one job per segment, the models it evaluates and the architecture it
selects in the store.

Example::

    >>> from retiarii import nas
    >>> row = nas.get("nasbench201")
    >>> row.status                                          # or 'variant: <what differs>'
    'faithful'
    >>> space = nas.build_space("nasbench201", "small")    # a ModelSpace for (1, 8, 8) digits
    >>> exp = nas.experiment("nasbench201", max_models=4, store="runs/nb201.db")
    >>> summary = exp.run()                                 # (under `if __name__ == "__main__":`)
    >>> nas.get("fairnas").runs_with, nas.get("fairnas").one_shot
    ('SPOS', True)
    >>> exp = nas.experiment("fairnas", epochs=3)           # 3 segments of SPOS(fair=True)
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

from . import nas_latency, registry
# the papers' cost terms `nas run` applies, readable as nas.X (retiarii/nas_latency.py)
from .nas_latency import (COST_TERMS, ELASTIC_LATENCY, LATENCY_OBJECTIVE,  # noqa: F401
                          LATENCY_TERM, RUNTIME_TERM)

PRESETS = ("small", "paper")
# What the launcher trains on: scikit-learn's 8x8 grayscale digits, 10 classes.
DIGITS = {"in_channels": 1, "num_classes": 10, "image_size": 8}


class RowNotImplemented(LookupError):
    """A registry row whose space is not written yet (its status says so)."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One NAS solution of the literature."""

    number: int  # its place in the paper's Table 1 (and issue #15's list)
    name: str  # the launcher's name for it: `retiarii nas run NAME`
    title: str  # how papers call it
    space: str  # the model space, in a few words
    strategy: str  # the published strategy
    paper: str  # authors, venue, year
    module: str | None = None  # the model_spaces module with small() and paper(); None: not yet
    runs_with: str | None = None  # our strategy (rt.strategies name) when implemented
    note: str = ""  # what differs from the publication, if anything
    # preset -> (function of `module`, its keyword arguments as (key, value) pairs)
    presets: tuple = (("small", "small", ()), ("paper", "paper", ()))
    # keyword arguments of the `runs_with` strategy as (key, value) pairs (evolving spaces
    # start from their base model: ("initial", "base"))
    options: tuple = ()
    # what differs from the paper's method or space in a few words; "" when the row runs the
    # paper's method on the paper's space (at the reduced scale its presets state)
    variant: str = ""

    @property
    def status(self) -> str:
        """``faithful``, or ``variant: <what differs>`` (``nas show`` lists every difference)."""
        if not self.module:
            return "not yet"
        return f"variant: {self.variant}" if self.variant else "faithful"

    @property
    def one_shot(self) -> bool:
        """Whether ``runs_with`` is a one-shot (weight-sharing) strategy."""
        return self.runs_with in ONE_SHOT


def _row(number, name, title, space, strategy, paper, module=None, runs_with=None, note="",
         presets: dict | None = None, options: dict | None = None, variant: str = "") -> Row:
    row = Row(number, name, title, space, strategy, paper, module, runs_with, note,
              options=tuple(sorted((options or {}).items())), variant=variant)
    if presets:
        row = dataclasses.replace(row, presets=tuple(
            (preset, fn, tuple(sorted(kwargs.items()))) for preset, (fn, kwargs) in
            presets.items()))
    return row


# NASNet and AmoebaNet share model_spaces/nasnet_search.py: normal and reduction cells of 5
# blocks over the 13 operations (model_spaces/nasnet.py is the normal-cell-only space the
# mutator tests and benchmarks/space.py measure)
_NASNET_NOTE = ("model_spaces/nasnet_search.py: normal and reduction cells of B=5 blocks, each "
                "two hidden states, two of the 13 ops, added; unused states concatenated; "
                "N normal cells then a reduction, 3 stacks; scale: N=1, F=8 (the paper: N=6, "
                "F=32); blocks add (the reported cells' combination; NASNet's controller "
                "may also concatenate)")


def _proxyless(variant: str, leaf_blocks: bool = False) -> dict:
    """ProxylessNAS, FairNAS, SCARLET-NAS and Single-Path NAS share
    model_spaces/proxylessnas.py, one variant each (``leaf_blocks``: see _LEAF)."""
    extra = {"leaf_blocks": True} if leaf_blocks else {}
    return {preset: (preset, {"variant": variant, **extra}) for preset in PRESETS}


# The rows run by a continuous relaxation build their MBConvs as opaque nodes (the same models
# and functions): spliced blocks make a layer's nodes depend on the previous layer's choice
# too (its residual reads them), which the relaxation refuses (RelaxError: "node 'layers.1' is
# not computed as labels ['layer2'] predict one at a time").
_LEAF = "blocks as opaque nodes (model_spaces/_mobile.py: LeafMBConv) so the relaxation mixes "

ROWS: tuple[Row, ...] = (
    _row(1, "mnasnet", "MnasNet", "MobileNetV2 blocks: kernel, expansion, layers, SE", "RL",
         "Tan et al., CVPR 2019", "model_spaces.mnasnet", "PolicyBasedRL",
         "conv type, skip op and filter sizes fixed (MnasNet-A1's); the reward "
         "ACC x (LAT / target) ** -0.07 with LAT the latency predicted from the operator "
         "table measured on this machine and the target the median of 16 random models' "
         "(nas.COST_TERMS)"),
    _row(2, "enas_cnn", "ENAS-CNN", "ENAS micro cell and macro space", "RL, weight sharing",
         "Pham et al., ICML 2018", "model_spaces.enas", "ENAS",
         "micro cell (macro space: model_spaces.enas.macro_space); an LSTM controller samples "
         "a path per batch of the shared weights and learns by REINFORCE"),
    _row(3, "nasnet", "NASNet", "NASNet cell", "RL", "Zoph et al., CVPR 2018",
         "model_spaces.nasnet_search", "PolicyBasedRL",
         _NASNET_NOTE + "; an LSTM controller learns by PPO, as the paper's: the clipped "
         "surrogate (epsilon 0.2) over batches of 4 told architectures, 4 epochs each, the "
         "old policy the one that drew them (the paper: batches of many workers' models, "
         "20,000 models; here the launcher's budget)",
         options={"algorithm": "ppo"}),
    _row(4, "amoebanet", "AmoebaNet", "NASNet cell", "regularized evolution",
         "Real et al., AAAI 2019", "model_spaces.nasnet_search", "RegularizedEvolution",
         _NASNET_NOTE + "; aging evolution, each child one hidden-state or op mutation of one "
         "cell (P=8, S=3 here; the paper: P=100, S=25; an identity mutation would repeat its "
         "parent, which the engine does not retrain)"),
    _row(5, "spos", "SPOS", "ShuffleNetV2 blocks", "evolution over a super-net",
         "Guo et al., ECCV 2020", "model_spaces.spos", "SPOS",
         "uniform single paths train the super-net, then evolution ranks candidates with "
         "inherited weights (8 x 3 of them; the paper: 50 x 20)"),
    _row(6, "wann", "Weight Agnostic Networks",
         "evolving: insert node, add connection, change activation", "evolution",
         "Gaier & Ha, NeurIPS 2019", "model_spaces.wann", "WANN",
         "nodes: layers of 16 units (the paper: single units); untrained, scored over shared "
         "weights [-2, -1, -0.5, 0.5, 1, 2] (WANNTrainer), ranked by non-dominated fronts over "
         "(mean acc, connections) in 80% of the tournaments, (mean, max acc) in 20%, crowding "
         "distance in a front; retrained as trained weights, one a connection; population 16"),
    _row(7, "path_level", "Path-level NAS",
         "DenseNet-BC tree cells grown by replication and split", "RL",
         "Cai et al., ICML 2018", "model_spaces.path_level", "PathLevelRL",
         "DenseNet-BC whose 3x3 convs become one shared tree-structured cell, grown by the "
         "paper's path-level transformations (replication-add, split-concat, a node inserted "
         "with an identity edge, a new edge's op; model_spaces/path_tree.py); the paper's "
         "meta-controller: a bidirectional tree-LSTM encodes the cell and decides per node, "
         "by REINFORCE (strategies/multi_trial/path_level_rl.py); each transformed network "
         "starts from the trained start network's weights through the function-preserving "
         "transfers (a new edge's conv identity-initialised; a pooling cannot be); trained as "
         "the paper's: SGD, Nesterov momentum 0.9, lr 0.1 cosine, weight decay 1e-4, batch 64. "
         "Scale: k=8, 2 blocks of 2 layers, nodes to depth 2, two branches a node, 2 epochs a "
         "network (the paper: DenseNet-BC L=100, k=12; PyramidNet too)"),
    _row(8, "large_scale_evolution", "Large-Scale Evolution",
         "evolving: add/remove/alter layers and skips", "evolution", "Real et al., ICML 2017",
         "model_spaces.large_scale_evolution", "RegularizedEvolution",
         "the paper's structural mutations (insert/remove a conv, alter channels, kernel, "
         "stride, insert/remove a skip) and its learning-rate mutation, from the minimal "
         "network (a linear classifier); weight inheritance as the paper's: each child "
         "starts from its parent's trained tensors wherever the mutation kept a layer's "
         "shape, changed layers fresh (RegularizedEvolution(inherit=True), "
         "engine/trainers/inheritance.py); the paper's selection: two members drawn, the "
         "worse killed, the better's child joins (RegularizedEvolution(kill=\"worse\", "
         "sample_size=2)). Scale: a population of 8 and as many children (the paper: "
         "1000, 250 workers, 25,600 steps per child); the identity and reset-weights "
         "mutations are left out (an identity would repeat its parent, which the engine "
         "does not retrain)",
         options={"initial": "base", "inherit": True, "kill": "worse", "sample_size": 2}),
    _row(9, "efficientnet", "EfficientNet", "MnasNet's space, then compound scaling", "RL",
         "Tan & Le, ICML 2019", "model_spaces.efficientnet", "CompoundScaling",
         "MnasNet's RL (ACC x (FLOPS / T) ** -0.07, T: B0's) finds B0 in MnasNet's space (per "
         "stage kernel, expansion, SE, layers B0's -1/0/+1; conv op, skip op, filters fixed as "
         "mnasnet's); B0 fixed, the (alpha, beta, gamma) with alpha*beta^2*gamma^2 within 10% of"
         " 2 train (depth: ceil(d x B0's layers)); the best retrains. Scale: 2 B0 models, phi ="
         " 1, 8 grid points, widths / 4 (docs/spaces.md)", options={"b0_models": 2}),
    _row(10, "pnas", "Progressive NAS", "NASNet-like cell grown block by block",
         "surrogate-guided progressive search", "Liu et al., ECCV 2018", "model_spaces.pnas",
         "Progressive", "the beam of the K best cells of b blocks expanded by one block, ranked by "
         "the paper's surrogate: an ensemble of 5 MLPs over the blocks' token embeddings (each "
         "on 4/5 of the told cells, the mean used), refitted at each level; scale: K=4 of 64 "
         "expansions, 5 levels in 20 models (the paper: K=256), 8 filters, 1 cell a stack",
         options={"depth_label": "blocks", "beam": 4, "n_candidates": 64,
                  "surrogate": "ensemble"}),
    _row(11, "enas_rnn", "ENAS-RNN", "recurrent cell", "RL, weight sharing",
         "Pham et al., ICML 2018", "model_spaces.recurrent", "ENAS",
         "classifies digit rows as sequences (the paper: language models)",
         {"small": ("enas_small", {}), "paper": ("enas_paper", {})}),
    _row(12, "genetic_cnn", "Genetic CNN", "binary connection strings between stage nodes",
         "evolution", "Xie & Yuille, ICCV 2017", "model_spaces.genetic_cnn",
         "RegularizedEvolution"),
    _row(13, "oneshot", "Simplified One-Shot", "one-shot cell", "random, weight sharing",
         "Bender et al., ICML 2018", "model_spaces.oneshot", "PathDropout",
         "the whole one-shot model trains with scheduled path dropout (each of a choice "
         "point's k paths dropped with rate ** (1/k), the rate linear from 0 to r = 0.5, a mask "
         "per example, at least one path kept), ghost BatchNorm (ghost batches of 16 of 64) "
         "and L2 (1e-4) on the weights the batch used only; then 24 random architectures are "
         "ranked on it with the other paths zeroed out (BatchNorm on batch statistics), the "
         "best retrains. Scale: C=8, 3 cells, --epochs (the paper: wider, deeper, CIFAR-10)",
         options={"final_rate": 0.5, "ghost_batch": 16, "weight_decay": 1e-4}),
    _row(14, "darts", "DARTS", "DARTS cell (normal + reduction)", "differentiable",
         "Liu et al., ICLR 2019", "model_spaces.darts", "DARTS",
         "first-order DARTS: a mixed op over the 8 ops (none included) on every edge of the "
         "normal and the reduction cell, softmax-weighted by alpha; the derived cell keeps "
         "each node's top-2 edges by strongest non-none op (model_spaces/darts.py: "
         "DERIVATION); weights step on half of the training split, alphas on the other half "
         "(retiarii/arch_split.py), the validation split is what it reports. Scale: C=8, 3 "
         "cells (the paper's search: C=16, 8 cells, 50 epochs; its evaluation: C=36, 20 "
         "cells, 600 epochs), --epochs segments; no BN-affine=False nor the second-order "
         "step by default (DARTS(first_order=False) takes it)",
         variant=""),
    _row(15, "darts_rnn", "DARTS (language models)", "recurrent cell", "differentiable",
         "Liu et al., ICLR 2019", "model_spaces.recurrent", "DARTS",
         "first-order DARTS on the recurrent cell: a mixed op over (none, tanh, relu, sigmoid, "
         "identity) on every edge j -> i of the 8 nodes, softmax-weighted by alpha; each node "
         "derives its strongest (predecessor, activation) (model_spaces/recurrent_relax.py); "
         "weights and alphas step on halves of the training split. Scale and task: digit rows "
         "as sequences of 8 steps classified from the last state (the paper: Penn Treebank "
         "language model, hidden 300 in search, 850 in evaluation), hidden 32; the search "
         "cell batch-normalizes its states as DARTS' does",
         {"small": ("darts_small", {}), "paper": ("darts_paper", {})},
         options={"arch_lr": 3e-3},  # the paper's architecture learning rate for its RNN
         variant=""),
    _row(16, "fbnet", "FBNet", "FBNet blocks", "differentiable (Gumbel)", "Wu et al., CVPR 2019",
         "model_spaces.fbnet", "GumbelDARTS",
         "Gumbel-softmax over each layer's 9 blocks, temperature annealed; the latency loss "
         "CE x 0.2 x log(LAT) ** 0.6 with LAT the expected latency (in us) from the lookup "
         "table of the operator table measured on this machine (nas.COST_TERMS); "
         + _LEAF + "whole blocks",
         {preset: (preset, {"leaf_blocks": True}) for preset in PRESETS}),
    _row(17, "proxylessnas", "ProxylessNAS", "ProxylessNAS space", "differentiable and RL",
         "Cai et al., ICLR 2019", "model_spaces.proxylessnas", "ProxylessNAS",
         "its differentiable variant: binary gates, one path per weight step, two per "
         "architecture step; the expected-latency term from the operator table measured on "
         "this machine (nas.LATENCY_TERM); " + _LEAF + "whole blocks",
         _proxyless("proxylessnas", leaf_blocks=True)),
    _row(18, "fairnas", "FairNAS", "ProxylessNAS space",
         "evolution after fair super-net training", "Chu et al., ICCV 2021",
         "model_spaces.proxylessnas", "FairNAS",
         "19 layers, no skip; strict fairness: each step draws 6 paths from one permutation "
         "per layer (every block once), sums their gradients and steps once; NSGA-II over "
         "accuracy and the latency of the operator table measured on this machine "
         "(nas.LATENCY_OBJECTIVE); selected: the most accurate candidate", _proxyless("fairnas")),
    _row(19, "scarlet_nas", "SCARLET-NAS", "ProxylessNAS space",
         "evolution after fair super-net training", "Chu et al., 2019 (arXiv:1908.06022)",
         "model_spaces.proxylessnas", "FairNAS",
         "FairNAS's space + skip; the skip is the scalable skip (a linearly equivalent "
         "transformation, LET: a learnable 1x1 conv without activation) in the super-net and, "
         "as this space holds it, in the retrained model too (the paper's stand-alone model: "
         "the identity); FairNAS's strict fairness (7 paths a step); NSGA-II over accuracy "
         "and latency", _proxyless("scarlet_nas")),
    _row(20, "single_path_nas", "Single-Path NAS", "MobileNetV2 kernels as a super-kernel",
         "differentiable", "Stamoulis et al., ECML-PKDD 2019", "model_spaces.proxylessnas",
         "SinglePathNAS", "one super-kernel per layer (the 3x3 the 5x5's centre, expansion 3 "
         "the first channels of 6), thresholds on squared weight norms with hard indicators "
         "and straight-through sigmoid gradients, learnt with the weights on the training "
         "data by CE + lambda log(R), R the operator table's latency of the architecture the "
         "indicators select (lambda 1.0 here); the derived architecture retrains from scratch. "
         "Scale: ProxylessNAS's 21-layer layout (the paper's MobileNetV2 macro-architecture) "
         "at widths / 8 on 8x8 digits, a few epochs; the thresholds learn with Adam, the "
         "weights with the trainer's optimizer (the paper: one RMSProp)",
         _proxyless("single_path_nas")),
    _row(21, "nasbench101", "NAS-Bench-101", "cell of up to 7 nodes, 9 edges", "any",
         "Ying et al., ICML 2019", "model_spaces.nasbench101", "RegularizedEvolution"),
    _row(22, "nasbench201", "NAS-Bench-201", "cell of 4 nodes, 5 ops per edge", "any",
         "Dong & Yang, ICLR 2020", "model_spaces.nasbench201", "RegularizedEvolution"),
    _row(23, "once_for_all", "Once-for-All", "elastic kernel, depth, width",
         "predictor-guided evolution", "Cai et al., ICLR 2020", "model_spaces.once_for_all",
         "OnceForAll", "progressive shrinking in order: the largest network, then elastic "
         "kernel (7, 5, 3 through learnt kernel transformation matrices), then elastic depth "
         "(a unit's first d layers), then elastic width (hidden channels sorted by importance, "
         "the first e * C kept), each phase drawing sub-networks only from its set, with "
         "knowledge distillation from the largest network after phase 1; then an MLP accuracy "
         "predictor trained on measured sub-networks (BatchNorm recalibrated) guides an "
         "evolution under a latency constraint from the operator table (halfway between the "
         "space's least and greatest latency unless max_latency is given). Scale: 2 units of "
         "widths 12 and 16 on 8x8 digits (the paper: 5 units on ImageNet, elastic resolution "
         "too, not searched here); --epochs segments per phase, one sub-network per batch, "
         "depth and width each in one phase (the paper: two stages each), 16 measured "
         "sub-networks and 16 x 5 candidates (the paper: 16K and 100 x 500)",
         options={"predictor_samples": 16}),
    _row(24, "hierarchical", "Hierarchical Representation", "motifs of motifs", "evolution",
         "Liu et al., ICLR 2018", "model_spaces.hierarchical", "HierarchicalEvolution",
         "6 level-2 motifs of 4 nodes over 6 primitives and none, a level-3 cell of 5 nodes; "
         "a node concatenates its inputs, then a 1x1 conv; aging evolution from trivial genotypes "
         "each diversified by 1000 random mutations, the paper's mutation (level, motif, successor,"
         " predecessor, new op); scale: C=4, P=8, S=3 (the paper: C=16, P=200, tournaments of 5%)",
         options={"initial": "base"}),
    _row(25, "textnas", "TextNAS", "text cell over embeddings", "RL", "Wang et al., AAAI 2020",
         "model_spaces.textnas", "PolicyBasedRL",
         "on digits, pixels read as 64 tokens; token input in textnas_space"),
    _row(26, "chamnet", "ChamNet", "MobileNetV2 blocks", "predictor-guided search",
         "Dai et al., CVPR 2019", "model_spaces.chamnet", "ChamNet",
         "a Gaussian process over the stages' widths, depths, expansions and the resolution "
         "predicts accuracy, the latency lookup table of the operator table measured on this "
         "machine predicts latency, and a genetic search proposes the best-predicted model "
         "under the latency constraint (the median predicted latency of 16 random models; "
         "nas.COST_TERMS), random ones first; scale: 4 random models, a genetic search of 32 "
         "x 10 generations per proposal, widths / 4, grids ours (the paper: ranges)",
         options={"n_startup": 4}),
    _row(27, "neural_predictor", "Neural Predictor", "NAS-Bench-101 cell", "predictor",
         "Wen et al., ECCV 2020", "model_spaces.nasbench101", "NeuralPredictor",
         "the paper's bidirectional GCN over the pruned cell's adjacency and one-hot ops "
         "(model_spaces.nasbench101.cell_graph), trained on N random cells, ranks a random "
         "sample and the top K train; scale: N=5, K=3 of 200 candidates, 100 predictor "
         "epochs (the paper: N=172, K of the whole benchmark, 300 epochs)",
         options={"n_train": 5, "top_k": 3, "n_candidates": 200, "epochs": 100}),
)

_BY_NAME = {row.name: row for row in ROWS}


def get(name: str) -> Row:
    """The row called ``name`` (``retiarii nas list`` shows the names)."""
    if name not in _BY_NAME:
        raise KeyError(f"no NAS solution called {name!r}; the names are: "
                       f"{', '.join(_BY_NAME)}")
    return _BY_NAME[name]


def implemented() -> list[Row]:
    return [row for row in ROWS if row.module]


def _check(row: Row, preset: str) -> None:
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r} is not one of {PRESETS}")
    if not row.module:
        raise RowNotImplemented(
            f"{row.name} ({row.title}, {row.paper}) is not implemented yet: its space is not "
            f"in model_spaces/ (implemented: {', '.join(r.name for r in implemented())})")


def build_space(name: str, preset: str = "small", **shape: Any):
    """The ModelSpace of row ``name`` at ``preset``, for the digits' shapes unless ``shape``
    (in_channels, num_classes, image_size) says otherwise."""
    row = get(name)
    _check(row, preset)
    module = importlib.import_module(row.module)
    fn, kwargs = {p: (f, k) for p, f, k in row.presets}[preset]
    builder: Callable = getattr(module, fn)
    return builder(**{**DIGITS, **dict(kwargs), **shape})


class _Presets:
    """``SPACES.<name>.<preset>``: spaces as import references workers resolve (``"retiarii.nas:
    SPACES.nasbench201.small"``), built once; ``options(name)``: a row's extra builder arguments."""

    def __init__(self, name: str | None = None, options: Callable = lambda name: ()):
        self._name, self._built, self._options = name, {}, options

    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            raise AttributeError(attr)
        if self._name is None:
            get(attr)  # a clear KeyError for an unknown row
            return self._built.setdefault(attr, _Presets(attr, self._options))
        if attr not in self._built:
            if attr not in PRESETS:
                raise AttributeError(f"{self._name} has presets {PRESETS}, not {attr!r}")
            self._built[attr] = build_space(self._name, attr, **dict(self._options(self._name)))
        return self._built[attr]


SPACES = _Presets()


# The launcher's settings of a row's strategy over the registry's (budgets that fit the small
# preset, seconds a segment; the papers' settings are in each strategy's docstring)
_LAUNCHER = {
    # 8 x 3 candidates ranked with inherited weights (SPOS: 50 x 20), each on 2 validation
    # batches after recalibrating its BatchNorm statistics: each new candidate builds its
    # path, seconds apiece on the small mobile spaces
    "SPOS": {"search_population": 8, "search_generations": 3, "eval_batches": 2},
    "FairNAS": {"search_population": 8, "search_generations": 3, "eval_batches": 2},
    "ENAS": {"controller_steps": 20},
    # populations that the default budgets (default_models) leave room to evolve
    "RegularizedEvolution": {"population_size": 8, "sample_size": 3},
    "HierarchicalEvolution": {"population_size": 8, "sample_size": 3},
    "WANN": {"population_size": 16, "sample_size": 4},
}

# Budgets set by the method: 2 B0s + 8 grid points; 5 levels of K=4; 8 WANN generations
MODELS = {"efficientnet": 10, "pnas": 20, "wann": 128}


def default_models(name: str, workers: int = 2, batch_models: int = 8) -> int:
    """A multi-trial row's default ``max_models``: :data:`MODELS`, else twice (at least 8) what
    its strategy draws before it learns (``startup_need``): half of them the method's choices."""
    from .engine.driver.experiment_checks import startup_need

    if name in MODELS:
        return MODELS[name]
    return max(8, 2 * (startup_need(strategy(name), workers, batch_models) or 0))


# Rows whose architecture steps on a split of the training data (retiarii.arch_split)
ARCH_SPLIT = {"darts", "darts_rnn"}
# Strategies scoring untrained models (retiarii/weight_agnostic.py): (metrics, modes) they rank by
WEIGHT_AGNOSTIC = {"WANN": (("val_acc", "connections", "val_acc_max"), ("max", "min", "max"))}


# the registry's one-shot strategies (Row.runs_with of the rows the one-shot host runs)
ONE_SHOT = tuple(e.class_name for e in registry.ONE_SHOT.values())


def strategy(name: str, seed: int = 0, epochs: int = 2, options: dict | None = None):
    """The strategy the row runs with (see ``Row.runs_with``).

    Args:
        seed: seeds the search.
        epochs: a one-shot row's segments (epochs of its super-network); multi-trial rows
            train each model for the trainer's epochs instead.
        options: keyword arguments of the strategy that replace the row's and the
            launcher's (``{"search_population": 4}`` for a shorter SPOS search).
    """
    row = get(name)
    _check(row, "small")
    options = {**_LAUNCHER.get(row.runs_with, {}), **dict(row.options), **(options or {})}
    # a one-shot row's epochs are its segments; a multi-trial row's go to the trainer
    return registry.make_strategy(row.runs_with, seed, epochs if row.one_shot else None,
                                  **options)


def experiment(name: str, preset: str = "small", max_models: int | None = None,
               epochs: int = 2, store: str | None = None, workers: int = 2, seed: int = 0,
               options: dict | None = None, **kwargs: Any):
    """An :class:`~retiarii.Experiment` searching row ``name`` on digits.

    A one-shot row (``Row.one_shot``: ENAS, SPOS, DARTS...) runs its strategy for ``epochs``
    segments on one worker (the engine's one-shot host): the models it evaluates on the
    shared weights and the architecture it selects are recorded in the store
    (``retiarii status`` / ``export`` read them). A multi-trial row trains up to
    ``max_models`` models for ``epochs`` epochs each.

    Args:
        name: a row name (``retiarii nas list``).
        preset: ``"small"`` (trains in seconds) or ``"paper"`` (the published sizes: slow).
        max_models: multi-trial rows: models to train (default :func:`default_models`). A
            one-shot row's segments decide how many models it evaluates: giving it is an error.
        epochs: epochs per model (multi-trial), or segments of the search (one-shot).
        workers, seed: worker processes; seed of the strategy and the trials.
        store: the SQLite file (default ``runs/nas-{name}-{preset}.db``).
        options: the strategy's settings that replace the row's (see :func:`strategy`).
        kwargs: passed on to :class:`~retiarii.Experiment` (``executor``, ``progress``...).

    Raises:
        ValueError: ``max_models`` given for a one-shot row.
    """
    from .engine.driver.experiment import Experiment
    from .engine.trainers.trainer import ClassifierTrainer

    row = get(name)
    _check(row, preset)
    if row.one_shot and max_models is not None:
        raise ValueError(f"max_models={max_models}: {name} runs the one-shot {row.runs_with}, "
                         f"whose segments (epochs={epochs}) decide how many models it "
                         f"evaluates; leave max_models out")
    kwargs["max_models"] = max_models  # None for a one-shot row (refused above otherwise)
    ref = f"retiarii.nas:SPACES.{name}.{preset}"
    # the paper's optimizer family where the space module states it (path_level: Nesterov SGD)
    recipe = getattr(importlib.import_module(row.module), "TRAINER", {})
    trainer = ClassifierTrainer(dataset="digits", epochs=epochs, **recipe)
    if row.runs_with in WEIGHT_AGNOSTIC:  # scored over a sweep of shared values, not trained
        from .weight_agnostic import WANNTrainer

        trainer = WANNTrainer(dataset="digits")
        kwargs.setdefault("metric", list(WEIGHT_AGNOSTIC[row.runs_with][0]))
        kwargs.setdefault("mode", list(WEIGHT_AGNOSTIC[row.runs_with][1]))
    store = store or f"runs/nas-{name}-{preset}.db"
    options = nas_latency.cost_term(name, getattr(SPACES, name), preset, store,
                                    dict(options or {}), kwargs)  # the paper's cost term
    if name in ARCH_SPLIT:  # alphas step on a split of the training data
        from .arch_split import ArchSplitTrainer

        trainer = ArchSplitTrainer(dataset="digits", epochs=epochs)
    exp = Experiment(ref, strategy(name, seed, epochs, options), trainer,
                     store=store, workers=workers, seed=seed, **kwargs)
    if not row.one_shot and max_models is None:  # as many models a job as the engine trains
        exp.max_models = default_models(name, workers, exp.batch_models if exp.optimize else 1)
    return exp


def runs(row: Row) -> str:
    """What the strategy column says runs: ``"RL (PolicyBasedRL)"``, ``"... (DARTS, one-shot)"``."""
    if not row.runs_with:
        return row.strategy
    return f"{row.strategy} ({row.runs_with}{', one-shot' if row.one_shot else ''})"


def table() -> list[list[str]]:
    """The rows as ``[number, name, space, strategy (what runs: runs()), paper, status]``."""
    return [[str(r.number), r.name, r.space, runs(r), r.paper, r.status] for r in ROWS]
