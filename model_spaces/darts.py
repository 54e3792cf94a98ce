"""The DARTS cell space (Liu et al., ICLR 2019): normal and reduction cells of 4 nodes.

A cell reads the outputs of the two previous cells (``s0``, ``s1``, each through a 1x1
preprocessing; in a cell that follows a reduction, ``s0`` is halved by a factorized reduce).
Every pair of states ``i < j`` (``s0``, ``s1``, then the nodes) is an **edge** carrying one
of DARTS' 8 operations, ``none`` (the zero op) included; intermediate node ``k`` (0..3) sums
its ``k + 2`` incoming edges and the cell concatenates its 4 nodes (4C channels)::

    s0  s1  n0 .. n{k-1}          8 ops: none, max_pool_3x3, avg_pool_3x3, skip_connect,
     │   │   │       │                   sep_conv_3x3, sep_conv_5x5, dil_conv_3x3, dil_conv_5x5
    n_k = op_{0,k}(s0) + op_{1,k}(s1) + sum_m op_{m+2,k}(n_m)       out = cat(n0, n1, n2, n3)

In a reduction cell an op reading ``s0`` or ``s1`` has stride 2 (skip_connect becomes a
factorized reduce, none a strided zero), as in DARTS. Normal cells share one architecture
and reduction cells another: the label of edge ``i -> k`` is ``"normal/n{k}/e{i}"`` or
``"reduce/n{k}/e{i}"`` (``i``: 0 and 1 are s0 and s1, 2 + m node m).

This is DARTS' relaxed cell: a continuous relaxation of the space
(:class:`~retiarii.optim.relax.Relaxation`) puts on every edge the mixed operation
``sum_o softmax(alpha)_o * o(x)`` over the 8 ops, and the space's ``derivation``
(:data:`DERIVATION`) turns the learnt weights into the paper's discrete cell: each node keeps
its 2 incoming edges whose strongest non-``none`` op weighs most, with that op, and every
other edge becomes ``none``. Sampled directly, the space holds any op (or none) on each of
the 14 edges of a cell (8 ** 14 per cell); the cells DARTS derives, 2 non-``none`` inputs
per node, are ``prod_k C(k + 2, 2) * 7**2 = 180 * 7**8`` = 1,037,664,180 per cell and about
1.08e18 for the pair, the "~10^18" quoted for the DARTS space (e.g. by NAS-Bench-301, Siems
et al. 2020); :func:`genotype_sample` draws one of those uniformly.

``retiarii nas run darts`` runs DARTS on it (``retiarii.strategies.DARTS``, first order, its
architecture steps on a split of the training data: :mod:`retiarii.arch_split`).

Presets: :func:`paper` is the evaluation network (C=36, 20 cells, reductions at 1/3 and 2/3);
:func:`small` is C=8 with 3 cells (normal, reduction, reduction) for the 8x8 digits.

Example::

    >>> space = small()
    >>> space.size() == 8 ** 28
    True
    >>> sample = genotype_sample(random.Random(0))      # a cell DARTS could derive
    >>> net = space.build(sample)
"""
from __future__ import annotations

import random

import torch
from torch import nn

import retiarii as rt
from retiarii import ops
from retiarii.optim.derivation import EdgeDerivation

# DARTS' primitives, in its order; "none" is the zero op of the relaxation
OP_NAMES = ("none", "max_pool_3x3", "avg_pool_3x3", "skip_connect", "sep_conv_3x3",
            "sep_conv_5x5", "dil_conv_3x3", "dil_conv_5x5")
NODES = 4
KINDS = ("normal", "reduce")


def edge_label(kind: str, node: int, src: int) -> str:
    """The label of the edge from state ``src`` (0, 1: s0, s1; 2 + m: node m) into ``node``."""
    return f"{kind}/n{node}/e{src}"


# each node keeps its top-2 incoming edges by strongest non-none op (DARTS, section 2.4)
DERIVATION = EdgeDerivation(nodes=tuple(
    (f"{kind}/n{k}", tuple(edge_label(kind, k, i) for i in range(k + 2)))
    for kind in KINDS for k in range(NODES)), keep=2, none="none")


@rt.leaf
class ReLUConvBN(nn.Module):
    """ReLU, 1x1 conv, BN: (B, C_in, H, W) -> (B, C_out, H, W)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.op = nn.Sequential(nn.ReLU(), nn.Conv2d(c_in, c_out, 1, bias=False),
                                nn.BatchNorm2d(c_out))

    def forward(self, x):
        return self.op(x)


@rt.leaf
class FactorizedReduce(nn.Module):
    """(B, C_in, H, W) -> (B, C_out, H/2, W/2): two offset stride-2 1x1 convs, concatenated."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.relu = nn.ReLU()
        self.conv1 = nn.Conv2d(c_in, c_out // 2, 1, stride=2, bias=False)
        self.conv2 = nn.Conv2d(c_in, c_out - c_out // 2, 1, stride=2, bias=False)
        self.pad = nn.ConstantPad2d((0, 1, 0, 1), 0.0)  # the offset path reads pixels 1, 3, ...
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x):
        x = self.relu(x)
        shifted = self.pad(x)[:, :, 1:, 1:]
        return self.bn(torch.cat([self.conv1(x), self.conv2(shifted)], dim=1))


@rt.leaf
class Zero(nn.Module):
    """DARTS' ``none``: (B, C, H, W) -> zeros of (B, C, H/stride, W/stride)."""

    def __init__(self, stride: int):
        super().__init__()
        self.stride = stride

    def forward(self, x):
        return x[:, :, ::self.stride, ::self.stride].mul(0.0)


@rt.leaf
class DilConv(nn.Module):
    """ReLU, depthwise k x k conv (dilation d), pointwise 1x1, BN."""

    def __init__(self, c: int, k: int, stride: int, dilation: int):
        super().__init__()
        self.op = nn.Sequential(
            nn.ReLU(), nn.Conv2d(c, c, k, stride, padding=dilation * (k - 1) // 2,
                                 dilation=dilation, groups=c, bias=False),
            nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return self.op(x)


@rt.leaf
class SepConv(nn.Module):
    """Two stacked DilConvs of dilation 1 (the first carries the stride), as in DARTS."""

    def __init__(self, c: int, k: int, stride: int):
        super().__init__()
        self.first = DilConv(c, k, stride, 1)
        self.second = DilConv(c, k, 1, 1)

    def forward(self, x):
        return self.second(self.first(x))


def make_op(name: str, channels: int, stride: int) -> nn.Module:
    """One candidate op: (B, C, H, W) -> (B, C, H/stride, W/stride)."""
    if name == "none":
        return Zero(stride)
    if name == "max_pool_3x3":
        return nn.MaxPool2d(3, stride, 1)
    if name == "avg_pool_3x3":
        return nn.AvgPool2d(3, stride, 1, count_include_pad=False)
    if name == "skip_connect":
        return nn.Identity() if stride == 1 else FactorizedReduce(channels, channels)
    if name.startswith("sep_conv_"):
        return SepConv(channels, int(name[-1]), stride)
    if name.startswith("dil_conv_"):
        return DilConv(channels, int(name[-1]), stride, 2)
    raise ValueError(f"unknown op {name!r}; expected one of {OP_NAMES}")


class Cell(nn.Module):
    """A cell whose every edge is a sep_conv_3x3 (the base; the mutator edits it):
    (s0, s1) -> (B, 4C, H', W'). Edge ``i -> k`` is the module ``e{k}_{i}``."""

    def __init__(self, c_pp: int, c_p: int, c: int, reduction: bool, reduction_prev: bool):
        super().__init__()
        self.reduction = reduction
        self.pre0 = FactorizedReduce(c_pp, c) if reduction_prev else ReLUConvBN(c_pp, c)
        self.pre1 = ReLUConvBN(c_p, c)
        for k in range(NODES):
            for i in range(k + 2):
                stride = 2 if reduction and i < 2 else 1
                setattr(self, f"e{k}_{i}", make_op("sep_conv_3x3", c, stride))
            setattr(self, f"n{k}", ops.Sum())

    def forward(self, s0, s1):
        states = [self.pre0(s0), self.pre1(s1)]
        for k in range(NODES):
            edges = [getattr(self, f"e{k}_{i}")(states[i]) for i in range(k + 2)]
            states.append(getattr(self, f"n{k}")(*edges))
        return torch.cat(states[2:], dim=1)  # (B, C, H', W') x 4 -> (B, 4C, H', W')


class DARTSNet(nn.Module):
    """Stem, ``num_cells`` cells (reductions at 1/3 and 2/3 of the depth), pooling, classifier.

    Args:
        channels: C of the first cells (36 in DARTS' CIFAR-10 network).
        num_cells: cells in sequence (20 in DARTS).
        stem_multiplier: the stem has ``stem_multiplier * C`` channels (3 in DARTS).
    """

    def __init__(self, channels: int = 36, num_cells: int = 20, in_channels: int = 3,
                 num_classes: int = 10, stem_multiplier: int = 3):
        super().__init__()
        c_stem = stem_multiplier * channels
        self.stem = nn.Sequential(nn.Conv2d(in_channels, c_stem, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(c_stem))
        c_pp, c_p, c = c_stem, c_stem, channels
        self.cells = nn.ModuleList()
        reduction_prev = False
        self.reductions = [i for i in range(num_cells)
                           if num_cells >= 3 and i in (num_cells // 3, 2 * num_cells // 3)]
        for i in range(num_cells):
            reduction = i in self.reductions
            if reduction:
                c *= 2
            self.cells.append(Cell(c_pp, c_p, c, reduction, reduction_prev))
            reduction_prev = reduction
            c_pp, c_p = c_p, NODES * c
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_p, num_classes)

    def forward(self, x):
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1)
        return self.fc(self.pool(s1).flatten(1))


class DARTSCellMutator(rt.Mutator):
    """Chooses one op (or ``none``) per edge for the given cells (all normal or all
    reduction): label ``"{label}/n{k}/e{i}"`` for the edge from state i into node k."""

    def __init__(self, cells: list[str], channels: list[int], reduction: bool, label: str):
        super().__init__(label)
        self.cells, self.channels, self.reduction = cells, channels, reduction

    def mutate(self, targets):
        chosen = {(k, i): self.choose(list(OP_NAMES), edge_label(self.label, k, i))
                  for k in range(NODES) for i in range(k + 2)}
        for cell, c in zip(self.cells, self.channels):
            for (k, i), op in chosen.items():
                if op != "sep_conv_3x3":  # the base's op stays
                    stride = 2 if self.reduction and i < 2 else 1
                    self.replace(f"{cell}.e{k}_{i}", make_op(op, c, stride))


def darts_space(channels: int = 36, num_cells: int = 20, in_channels: int = 3,
                num_classes: int = 10, image_size: int = 32,
                stem_multiplier: int = 3) -> rt.ModelSpace:
    """The DARTS space around :class:`DARTSNet`; see the module docstring."""
    net = DARTSNet(channels, num_cells, in_channels, num_classes, stem_multiplier)
    widths = [cell.pre1.op[1].out_channels for cell in net.cells]  # C of each cell
    mutators = []
    for reduction, label in ((False, "normal"), (True, "reduce")):
        idx = [i for i in range(num_cells) if (i in net.reductions) == reduction]
        if idx:
            mutators.append(DARTSCellMutator([f"cells.{i}" for i in idx],
                                             [widths[i] for i in idx], reduction, label))
    space = rt.ModelSpace(net, mutators,
                          example_input=torch.zeros(1, in_channels, image_size, image_size))
    space.derivation = DERIVATION
    return space


def genotype_sample(rng: random.Random) -> dict:
    """A cell pair DARTS could derive, uniformly: per node 2 distinct inputs, each with one
    of the 7 ops other than ``none``; every other edge ``none``."""
    sample = {}
    for kind in KINDS:
        for k in range(NODES):
            kept = rng.sample(range(k + 2), 2)
            for i in range(k + 2):
                sample[edge_label(kind, k, i)] = rng.choice(OP_NAMES[1:]) if i in kept \
                    else "none"
    return sample


def genotype(sample: dict) -> dict[str, list[tuple[str, int]]]:
    """``{"normal": [(op, input), ...], "reduce": [...]}``: the non-``none`` edges of a sample,
    node by node (DARTS' Genotype notation)."""
    return {kind: [(sample[edge_label(kind, k, i)], i) for k in range(NODES)
                   for i in range(k + 2) if sample.get(edge_label(kind, k, i), "none") != "none"]
            for kind in KINDS}


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8) -> rt.ModelSpace:
    """C=8, 3 cells (normal, reduction, reduction), stem of 16 channels."""
    return darts_space(8, 3, in_channels, num_classes, image_size, stem_multiplier=2)


def paper(in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> rt.ModelSpace:
    """DARTS' CIFAR-10 evaluation network: C=36, 20 cells."""
    return darts_space(36, 20, in_channels, num_classes, image_size)
