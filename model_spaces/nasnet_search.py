"""The NASNet search space (Zoph et al., "Learning Transferable Architectures", CVPR 2018), which
AmoebaNet (Real et al., AAAI 2019) searches too: normal and reduction cells over 13 operations.

A cell reads the two previous cells' outputs (``h0``, ``h1``, each through a 1x1 ReLU-conv-BN,
``pre0`` / ``pre1``; after a reduction, ``pre0`` has stride 2, since ``h0`` is at twice the
resolution). Each of its B = 5 blocks picks two hidden states among ``pre0``, ``pre1`` and
the blocks before it (``"{cell}/b{i}/input_a"``, ``"input_b"``), one of the 13 operations for
each (``"op_a"``, ``"op_b"``) and adds the results; the cell concatenates its *unused* hidden
states, the blocks no other block reads (as NASNet and AmoebaNet do)::

    pre0 pre1 b0 .. b{i-1}          13 ops: identity, 1x3 then 3x1 conv, 1x7 then 7x1 conv,
      └─ a ─┘  └─ b ─┘                      3x3 dilated conv, 3x3 avg pool, 3x3/5x5/7x7 max
    b_i = op_a(a) + op_b(b)                 pool, 1x1 conv, 3x3 conv, 3x3/5x5/7x7 depthwise-
    out = cat(unused b_i)                   separable conv

In a reduction cell the ops reading ``pre0`` or ``pre1`` have stride 2 (identity becomes a
stride-2 1x1 conv) and the cell's width C doubles; blocks read in a reduction cell are at the
reduced resolution already. All normal cells share one architecture and all reduction cells
another (labels ``"normal/..."`` and ``"reduce/..."``). NASNet's controller may also pick
concatenation as a block's combination; the reported cells (NASNet-A, B, C), the released
code and AmoebaNet add, which is what blocks do here.

The network is CIFAR's NASNet: a 3x3 conv stem, N normal cells, a reduction cell, N normal, a
reduction, N normal, global pooling, a classifier. The widths of ``pre0``, ``pre1`` and the
classifier depend on how many blocks a cell leaves unused: they are lazy, sized per model.

Size: per cell ``prod_{i<5} (i + 2)**2 * 13**2`` = 71,465,842,174,521,600 (:func:`count`;
ordered pairs, no symmetric cell removed), squared for the two cells (about 5.1e33).

Presets: :func:`paper` is NASNet-A's CIFAR-10 shape (N = 6, F = 32); :func:`small` N = 1 of
F = 8 (5 cells: normal, reduction, normal, reduction, normal) for the 8x8 digits.

Example::

    >>> space = small()
    >>> space.size() == count() ** 2
    True
    >>> model = space.instantiate(space.random_sample(seed=0).sample)
    >>> model.to_module()(torch.zeros(2, 1, 8, 8)).shape
    torch.Size([2, 10])
"""
from __future__ import annotations

import torch
from torch import nn

import retiarii as rt

from .pnas import PNASCell, PNASNet

OP_NAMES = ("identity", "conv_1x3_3x1", "conv_1x7_7x1", "dil_conv_3x3", "avg_pool_3x3",
            "max_pool_3x3", "max_pool_5x5", "max_pool_7x7", "conv_1x1", "conv_3x3",
            "sep_conv_3x3", "sep_conv_5x5", "sep_conv_7x7")
BLOCKS = 5
KINDS = ("normal", "reduce")


def count(blocks: int = BLOCKS) -> int:
    """Samples of one cell: per block, an ordered pair of inputs and an ordered pair of ops."""
    total = 1
    for i in range(blocks):
        total *= (i + 2) ** 2 * len(OP_NAMES) ** 2
    return total


def _relu_conv_bn(c: int, kernel, stride, padding, dilation: int = 1) -> list[nn.Module]:
    return [nn.ReLU(), nn.Conv2d(c, c, kernel, stride, padding, dilation, bias=False),
            nn.BatchNorm2d(c)]


def _separable(c: int, k: int, stride: int) -> list[nn.Module]:
    """ReLU, depthwise k x k (the stride), pointwise 1x1, BN; twice, as NASNet applies it."""
    layers = []
    for s in (stride, 1):
        layers += [nn.ReLU(), nn.Conv2d(c, c, k, s, k // 2, groups=c, bias=False),
                   nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)]
    return layers


def make_op(name: str, c: int, stride: int) -> nn.Module:
    """One of the 13 operations: (B, C, H, W) -> (B, C, H/stride, W/stride)."""
    if name == "identity":
        return nn.Identity() if stride == 1 else nn.Sequential(
            nn.Conv2d(c, c, 1, stride, bias=False), nn.BatchNorm2d(c))
    if name in ("conv_1x3_3x1", "conv_1x7_7x1"):
        k = int(name[-1])
        return nn.Sequential(nn.ReLU(), nn.Conv2d(c, c, (1, k), (1, stride), (0, k // 2),
                                                  bias=False),
                             nn.Conv2d(c, c, (k, 1), (stride, 1), (k // 2, 0), bias=False),
                             nn.BatchNorm2d(c))
    if name == "dil_conv_3x3":
        return nn.Sequential(*_relu_conv_bn(c, 3, stride, 2, dilation=2))
    if name == "avg_pool_3x3":
        return nn.AvgPool2d(3, stride, 1, count_include_pad=False)
    if name.startswith("max_pool_"):
        k = int(name[-1])
        return nn.MaxPool2d(k, stride, k // 2)
    if name in ("conv_1x1", "conv_3x3"):
        k = int(name[-1])
        return nn.Sequential(*_relu_conv_bn(c, k, stride, k // 2))
    if name.startswith("sep_conv_"):
        return nn.Sequential(*_separable(c, int(name[-1]), stride))
    raise ValueError(f"unknown op {name!r}; expected one of {OP_NAMES}")


@rt.leaf
class NASNetOp(nn.Module):
    """One op of a block, by name: (B, C, H, W) -> (B, C, H/stride, W/stride)."""

    def __init__(self, name: str, c: int, stride: int):
        super().__init__()
        self.op = make_op(name, c, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)


class NASNetCell(PNASCell):
    """The base cell: block i = sep_conv_3x3(pre0) + sep_conv_3x3(pre1), every block in the
    output: (h0, h1) -> (B, 5C, H', W') (PNAS's cell over NASNet's ops and 5 blocks)."""

    OP = NASNetOp
    BLOCKS = BLOCKS


class NASNet(PNASNet):
    """Stem, 3 stacks of ``n`` normal cells with a reduction cell between stacks (channels
    doubled), global pooling, lazy classifier; ``kinds``: (channels, reduction) per cell."""

    CELL = NASNetCell


def unused(genotype: list[tuple[int, str, int, str]]) -> list[int]:
    """The blocks no block reads (input index ``2 + i`` is block i): the cell's output.

    Example:
        >>> unused([(0, "identity", 1, "identity"), (2, "conv_1x1", 0, "identity")])
        [1]
    """
    read = {src - 2 for a, _, b, _ in genotype for src in (a, b) if src >= 2}
    return [i for i in range(len(genotype)) if i not in read]


class NASNetCellMutator(rt.Mutator):
    """One architecture for every cell of a kind (``"normal"`` or ``"reduce"``): per block
    ``"{kind}/b{i}/input_a"``, ``input_b`` (0: pre0, 1: pre1, 2 + j: block j), ``op_a`` and
    ``op_b``; then the blocks some block reads leave the cell's output."""

    def __init__(self, kind: str, cells: list[tuple[int, int]]):
        super().__init__(kind)
        self.kind, self.cells = kind, cells  # (index, channels) of the cells of this kind

    def mutate(self, targets):
        genotype = []
        for i in range(BLOCKS):
            a = self.choose(list(range(i + 2)), label=f"{self.kind}/b{i}/input_a")
            op_a = self.choose(list(OP_NAMES), label=f"{self.kind}/b{i}/op_a")
            b = self.choose(list(range(i + 2)), label=f"{self.kind}/b{i}/input_b")
            op_b = self.choose(list(OP_NAMES), label=f"{self.kind}/b{i}/op_b")
            genotype.append((a, op_a, b, op_b))
        out = set(unused(genotype))
        for index, c in self.cells:
            cell = f"cells.{index}"
            states = [f"{cell}.pre0.2", f"{cell}.pre1.2"] + [f"{cell}.b{j}" for j in range(BLOCKS)]
            for i, (a, op_a, b, op_b) in enumerate(genotype):
                for side, src, op, base in (("a", a, op_a, 0), ("b", b, op_b, 1)):
                    if (src, op) == (base, "sep_conv_3x3"):
                        continue  # the base's own edge
                    node = f"{cell}.b{i}_{side}"
                    stride = 2 if self.kind == "reduce" and src < 2 else 1
                    self.replace(node, NASNetOp(op, c, stride))
                    self.connect(states[src], node, port=0)
            for i in range(BLOCKS):
                if i not in out:
                    self.disconnect(f"{cell}.b{i}", f"{cell}.out")


def nasnet_search_space(channels: int, n: int, in_channels: int = 3, num_classes: int = 10,
                        image_size: int = 32) -> rt.ModelSpace:
    """The NASNet search space; see the module docstring."""
    net = NASNet(channels, n, in_channels, num_classes)
    mutators = []
    for kind in KINDS:
        cells = [(i, c) for i, (c, red) in enumerate(net.kinds) if red == (kind == "reduce")]
        mutators.append(NASNetCellMutator(kind, cells))
    return rt.ModelSpace(net, mutators,
                         example_input=torch.zeros(1, in_channels, image_size, image_size))


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8) -> rt.ModelSpace:
    """F = 8 filters, N = 1 normal cell per stack (5 cells with the two reductions)."""
    return nasnet_search_space(8, 1, in_channels, num_classes, image_size)


def paper(in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> rt.ModelSpace:
    """NASNet-A's CIFAR-10 shape: N = 6 normal cells per stack, F = 32 filters."""
    return nasnet_search_space(32, 6, in_channels, num_classes, image_size)
