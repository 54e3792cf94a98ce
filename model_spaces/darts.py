"""The DARTS cell space (Liu et al., ICLR 2019): normal and reduction cells of 4 nodes.

A cell reads the outputs of the two previous cells (``s0``, ``s1``, each through a 1x1
preprocessing; in a cell that follows a reduction, ``s0`` is halved by a factorized reduce).
Intermediate node ``k`` (0..3) picks two *distinct* predecessors among ``s0``, ``s1`` and the
nodes before it and applies one op to each; the cell concatenates its 4 nodes (4C channels)::

    s0  s1  n0 .. n{k-1}          7 ops: max_pool_3x3, avg_pool_3x3, skip_connect,
     └── pick 2 ──┘                      sep_conv_3x3, sep_conv_5x5, dil_conv_3x3, dil_conv_5x5
    n_k = op_a(first) + op_b(second)        out = cat(n0, n1, n2, n3)

In a reduction cell an op reading ``s0`` or ``s1`` has stride 2 (skip_connect becomes a
factorized reduce), as in DARTS. The derived (discrete) architecture is what this space
holds: the "none" op of the continuous relaxation is not a candidate. Normal cells share one
architecture and reduction cells another (labels ``"normal/n{k}/..."``, ``"reduce/n{k}/..."``).

Size: per cell ``prod_k C(k + 2, 2) * 7**2 = 180 * 7**8`` = 1,037,664,180 and the two cells
together 1,037,664,180 ** 2 (about 1.08e18), the "~10^18" quoted for the DARTS space
(e.g. by NAS-Bench-301, Siems et al. 2020).

DARTS searches this space by gradient descent over a weight-sharing super-net, which is what
``retiarii nas run darts`` runs (``retiarii.strategies.DARTS``, first order, on the continuous
relaxation of every op and input choice).

Presets: :func:`paper` is the evaluation network (C=36, 20 cells, reductions at 1/3 and 2/3);
:func:`small` is C=8 with 3 cells (normal, reduction, normal) for the 8x8 digits.

Example::

    >>> space = small()
    >>> space.size() == 1_037_664_180 ** 2
    True
"""
from __future__ import annotations

import torch
from torch import nn

import retiarii as rt
from retiarii import ops

OP_NAMES = ("max_pool_3x3", "avg_pool_3x3", "skip_connect", "sep_conv_3x3", "sep_conv_5x5",
            "dil_conv_3x3", "dil_conv_5x5")
NODES = 4


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
    """A cell with node k = sep_conv_3x3(s0) + sep_conv_3x3(s1) (the base; the mutator edits
    it): (s0, s1) -> (B, 4C, H', W')."""

    def __init__(self, c_pp: int, c_p: int, c: int, reduction: bool, reduction_prev: bool):
        super().__init__()
        self.reduction = reduction
        self.pre0 = FactorizedReduce(c_pp, c) if reduction_prev else ReLUConvBN(c_pp, c)
        self.pre1 = ReLUConvBN(c_p, c)
        stride = 2 if reduction else 1
        for k in range(NODES):
            setattr(self, f"n{k}_a", make_op("sep_conv_3x3", c, stride))
            setattr(self, f"n{k}_b", make_op("sep_conv_3x3", c, stride))
            setattr(self, f"n{k}", ops.Sum())

    def forward(self, s0, s1):
        s0, s1 = self.pre0(s0), self.pre1(s1)
        nodes = [getattr(self, f"n{k}")(getattr(self, f"n{k}_a")(s0),
                                        getattr(self, f"n{k}_b")(s1)) for k in range(NODES)]
        return torch.cat(nodes, dim=1)  # (B, C, H', W') x 4 -> (B, 4C, H', W')


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
    """Chooses one cell architecture for the given cells (all normal or all reduction).

    For node k: ``"{label}/n{k}/inputs"`` is a pair ``"i,j"`` (i < j, 0 and 1 being s0 and s1,
    2 + m node m), ``"{label}/n{k}/op_a"`` and ``"{label}/n{k}/op_b"`` the ops on i and j.
    """

    def __init__(self, cells: list[str], channels: list[int], reduction: bool, label: str):
        super().__init__(label)
        self.cells, self.channels, self.reduction = cells, channels, reduction

    def mutate(self, targets):
        genotype = []
        for k in range(NODES):
            pairs = [f"{i},{j}" for j in range(k + 2) for i in range(j)]
            first, second = map(int, self.choose(pairs, f"{self.label}/n{k}/inputs").split(","))
            op_a = self.choose(list(OP_NAMES), f"{self.label}/n{k}/op_a")
            op_b = self.choose(list(OP_NAMES), f"{self.label}/n{k}/op_b")
            genotype.append(((first, op_a), (second, op_b)))
        for cell, c in zip(self.cells, self.channels):
            states = [f"{cell}.pre0", f"{cell}.pre1"] + [f"{cell}.n{m}" for m in range(NODES)]
            for k, edges in enumerate(genotype):
                for side, (src, op) in zip("ab", edges):
                    stride = 2 if self.reduction and src < 2 else 1
                    node = f"{cell}.n{k}_{side}"
                    if (src, op) != ((0, 1)[side == "b"], "sep_conv_3x3"):
                        self.replace(node, make_op(op, c, stride))
                        self.connect(states[src], node, port=0)


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
    return rt.ModelSpace(net, mutators,
                         example_input=torch.zeros(1, in_channels, image_size, image_size))


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8) -> rt.ModelSpace:
    """C=8, 3 cells (normal, reduction, normal), stem of 16 channels."""
    return darts_space(8, 3, in_channels, num_classes, image_size, stem_multiplier=2)


def paper(in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> rt.ModelSpace:
    """DARTS' CIFAR-10 evaluation network: C=36, 20 cells."""
    return darts_space(36, 20, in_channels, num_classes, image_size)
