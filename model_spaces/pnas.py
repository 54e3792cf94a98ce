"""The Progressive NAS space (Liu et al., "Progressive Neural Architecture Search", ECCV 2018):
a cell of 1 to 5 blocks, grown block by block by the search.

A cell reads the outputs of the two previous cells (``s0``, ``s1``, each through a 1x1
ReLU-conv-BN). ``"blocks"`` (1..5) says how many blocks it has; block k picks two inputs
among ``s0``, ``s1`` and blocks 0 .. k-1 (``"b{k}/input_a"``, ``"b{k}/input_b"``), one of 8
ops for each (``"b{k}/op_a"``, ``"b{k}/op_b"``) and adds them; the cell concatenates its
blocks::

    s0  s1  b0 .. b{k-1}       8 ops: identity, avg pool 3x3, max pool 3x3, 1x7 then 7x1
      └─ a ─┘  └─ b ─┘                conv, sep conv 3x3 / 5x5 / 7x7, dilated conv 3x3
     op_a(a) + op_b(b) = b_k                out = cat(b0, ..., b{blocks-1})

One cell architecture serves every cell; a reduction cell is the same cell with stride 2 on
the ops reading ``s0`` or ``s1`` (as in PNAS). The next cells' 1x1 preprocessing and the
classifier are lazy (their input width, ``blocks * C``, depends on the sample). The choices
of block k exist only when ``blocks > k``, which is what :class:`~retiarii.strategies.
Progressive` (``depth_label="blocks"``) grows one block per stage.

Size: ``sum_{b=1..5} prod_{k<b} (k + 2) ** 2 * 8 ** 2`` = 256 + 147,456 + 150,994,944 +
241,591,910,400 + 556,627,761,561,600 = 556,869,504,614,656, about 5.6e14 (:func:`count`;
input pairs and op pairs counted ordered, no symmetric cell removed).

Presets: :func:`paper` has PNASNet-5's CIFAR-10 shape (N = 3 cells per stack, F = 48
filters); :func:`small` one cell per stack of 8 filters.

Example::

    >>> small().size() == count()
    True
"""
from __future__ import annotations

import torch
from torch import nn

import retiarii as rt
from retiarii import ops

OP_NAMES = ("identity", "avg_pool_3x3", "max_pool_3x3", "conv_1x7_7x1", "sep_conv_3x3",
            "sep_conv_5x5", "sep_conv_7x7", "dil_conv_3x3")
MAX_BLOCKS = 5


def count(max_blocks: int = MAX_BLOCKS) -> int:
    total, cells = 0, 1
    for k in range(max_blocks):
        cells *= (k + 2) ** 2 * len(OP_NAMES) ** 2
        total += cells
    return total


def make_op(name: str, c: int, stride: int) -> nn.Module:
    """(B, C, H, W) -> (B, C, H/stride, W/stride)."""
    if name == "identity":
        if stride == 1:
            return nn.Identity()
        return nn.Sequential(nn.Conv2d(c, c, 1, stride, bias=False), nn.BatchNorm2d(c))
    if name == "avg_pool_3x3":
        return nn.AvgPool2d(3, stride, 1, count_include_pad=False)
    if name == "max_pool_3x3":
        return nn.MaxPool2d(3, stride, 1)
    if name == "conv_1x7_7x1":
        return nn.Sequential(nn.ReLU(), nn.Conv2d(c, c, (1, 7), (1, stride), (0, 3), bias=False),
                             nn.Conv2d(c, c, (7, 1), (stride, 1), (3, 0), bias=False),
                             nn.BatchNorm2d(c))
    if name.startswith("sep_conv_"):
        k = int(name[-1])
        return nn.Sequential(nn.ReLU(), nn.Conv2d(c, c, k, stride, k // 2, groups=c, bias=False),
                             nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c))
    if name == "dil_conv_3x3":
        return nn.Sequential(nn.ReLU(), nn.Conv2d(c, c, 3, stride, 2, dilation=2, groups=c,
                                                  bias=False),
                             nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c))
    raise ValueError(f"unknown op {name!r}; expected one of {OP_NAMES}")


@rt.leaf
class PNASOp(nn.Module):
    """One op of a block, by name: (B, C, H, W) -> (B, C, H/stride, W/stride)."""

    def __init__(self, name: str, c: int, stride: int):
        super().__init__()
        self.op = make_op(name, c, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)


def preprocess(c: int, stride: int) -> nn.Module:
    """ReLU, lazy 1x1 conv (the input's width depends on the previous cell), BN; traced
through, so the conv's size settles per model (its output node is ``"{name}.2"``)."""
    return nn.Sequential(nn.ReLU(), nn.LazyConv2d(c, 1, stride=stride, bias=False),
                         nn.BatchNorm2d(c))


class PNASCell(nn.Module):
    """Every block present, block k = sep_conv_3x3(s0) + sep_conv_3x3(s1): (s0, s1) ->
    (B, 5C, H', W'). ``reduction_prev``: s0 is at twice s1's resolution. ``OP`` and
    ``BLOCKS``: the op module and the block count (NASNet's cell sets its own,
    model_spaces/nasnet_search.py)."""

    OP: type = PNASOp
    BLOCKS = MAX_BLOCKS

    def __init__(self, c: int, reduction: bool, reduction_prev: bool):
        super().__init__()
        self.pre0 = preprocess(c, 2 if reduction_prev else 1)
        self.pre1 = preprocess(c, 1)
        stride = 2 if reduction else 1
        for k in range(self.BLOCKS):
            setattr(self, f"b{k}_a", self.OP("sep_conv_3x3", c, stride))
            setattr(self, f"b{k}_b", self.OP("sep_conv_3x3", c, stride))
            setattr(self, f"b{k}", ops.Sum())
        self.out = ops.Concat()

    def forward(self, s0, s1):
        s0, s1 = self.pre0(s0), self.pre1(s1)
        return self.out(*(getattr(self, f"b{k}")(getattr(self, f"b{k}_a")(s0),
                                                 getattr(self, f"b{k}_b")(s1))
                          for k in range(self.BLOCKS)))


class PNASNet(nn.Module):
    """Stem, 3 stacks of ``cells_per_stack`` cells with a reduction cell between stacks
    (channels doubled), global pooling, lazy classifier; ``CELL``: the cell module."""

    CELL: type = PNASCell

    def __init__(self, channels: int, cells_per_stack: int, in_channels: int,
                 num_classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels))
        self.cells = nn.ModuleList()
        self.kinds = []  # (channels, reduction) of every cell
        c, reduction_prev = channels, False
        for stack in range(3):
            if stack > 0:
                c *= 2
                self.cells.append(self.CELL(c, True, reduction_prev))
                self.kinds.append((c, True))
                reduction_prev = True
            for _ in range(cells_per_stack):
                self.cells.append(self.CELL(c, False, reduction_prev))
                self.kinds.append((c, False))
                reduction_prev = False
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.LazyLinear(num_classes)

    def forward(self, x):
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1)
        return self.fc(self.pool(s1).flatten(1))


class PNASCellMutator(rt.Mutator):
    """``"blocks"``, then each present block's inputs and ops, for every cell."""

    def __init__(self, kinds: list[tuple[int, bool]]):
        super().__init__("pnas")
        self.kinds = kinds

    def mutate(self, targets):
        blocks = self.choose(list(range(1, MAX_BLOCKS + 1)), label="blocks")
        genotype = []
        for k in range(blocks):
            for side in "ab":
                src = self.choose(list(range(k + 2)), label=f"b{k}/input_{side}")
                genotype.append((k, side, src, self.choose(list(OP_NAMES),
                                                           label=f"b{k}/op_{side}")))
        for i, (c, reduction) in enumerate(self.kinds):
            cell = f"cells.{i}"
            for k in range(blocks, MAX_BLOCKS):  # absent blocks leave the cell
                self.disconnect(f"{cell}.b{k}", f"{cell}.out")
                for name in (f"b{k}", f"b{k}_a", f"b{k}_b"):
                    self.delete_node(f"{cell}.{name}")
            states = [f"{cell}.pre0.2", f"{cell}.pre1.2"] + [f"{cell}.b{m}" for m in range(blocks)]
            for k, side, src, op in genotype:
                if (src, op) == ("ab".index(side), "sep_conv_3x3"):
                    continue  # the base's own edge
                node = f"{cell}.b{k}_{side}"
                self.replace(node, PNASOp(op, c, 2 if reduction and src < 2 else 1))
                self.connect(states[src], node, port=0)


def pnas_space(channels: int, cells_per_stack: int, in_channels: int = 3,
               num_classes: int = 10, image_size: int = 32) -> rt.ModelSpace:
    """The PNAS space; see the module docstring."""
    net = PNASNet(channels, cells_per_stack, in_channels, num_classes)
    return rt.ModelSpace(net, [PNASCellMutator(net.kinds)],
                         example_input=torch.zeros(1, in_channels, image_size, image_size))


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8) -> rt.ModelSpace:
    """8 filters, one cell per stack (5 cells with the two reductions)."""
    return pnas_space(8, 1, in_channels, num_classes, image_size)


def paper(in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> rt.ModelSpace:
    """PNASNet-5's CIFAR-10 shape: N = 3 cells per stack, F = 48 filters."""
    return pnas_space(48, 3, in_channels, num_classes, image_size)
