"""A NASNet-like cell search space (Zoph et al. 2018), written as a base model plus mutators.

Normal cells and 5 operations only: the space of the mutator tests and of the build-cost
benchmark (benchmarks/space.py). The NASNet and AmoebaNet rows of ``retiarii nas`` search
the paper's space, model_spaces/nasnet_search.py (reduction cells, the 13 operations).

A network is a stem, ``num_cells`` normal cells and a classifier. A cell of ``num_blocks``
blocks reads the two previous cells' outputs (each through a 1x1 ReLU-conv-BN: ``pre0``,
``pre1``); block ``i`` picks two inputs among ``pre0``, ``pre1`` and the blocks before it,
applies one op to each, and sums them; the cell concatenates its blocks::

    pre0   pre1   b0 ... b{i-1}         5 candidate ops: sep_conv_3x3, sep_conv_5x5,
      └──┬──┘─────┘                                      avg_pool_3x3, max_pool_3x3, identity
     input a ─▶ op a ─┐
     input b ─▶ op b ─┴─▶ b_i = Sum(a, b)        cell output = cat(b0, ..., b{B-1}) (B*C ch)

Every cell shares one architecture (as in NASNet): each of the ``4 * num_blocks`` choices
is made once, by a mutator bound to that position in every cell (``shared=True``). A
sample maps ``"normal/b{i}_{a|b}/input"`` to a state name and ``"normal/b{i}_{a|b}/op"`` to
an op name; :func:`genotype_of` turns it into the genotype that :class:`NASNet` builds by
hand, which is how the tests check the space (same structural hash) and how the benchmark
measures the cost of building a model directly.

Example::

    >>> space = nasnet_space(channels=8, num_cells=2)
    >>> space.size()              # (2*5 * 3*5 * 4*5 * 5*5 * 6*5) ** 2
    5062500000000
    >>> net = space.build(space.random_sample(seed=0).sample)
    >>> net(torch.randn(1, 3, 32, 32)).shape
    torch.Size([1, 10])
"""
from __future__ import annotations

import torch
from torch import nn

import retiarii as rt
from retiarii import ops
from retiarii.mutators import InputMutator, OperatorMutator

OP_NAMES = ("sep_conv_3x3", "sep_conv_5x5", "avg_pool_3x3", "max_pool_3x3", "identity")


@rt.leaf
class SepConv(nn.Module):
    """ReLU, depthwise k x k conv, pointwise 1x1 conv, BatchNorm: (B, C, H, W) -> same."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.relu = nn.ReLU()
        self.depthwise = nn.Conv2d(channels, channels, kernel_size, padding=kernel_size // 2,
                                   groups=channels, bias=False)
        self.pointwise = nn.Conv2d(channels, channels, 1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.pointwise(self.depthwise(self.relu(x))))


@rt.leaf
class ReLUConvBN(nn.Module):
    """ReLU, 1x1 conv, BatchNorm: (B, C_in, H, W) -> (B, C_out, H, W)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.relu = nn.ReLU()
        self.conv = nn.Conv2d(c_in, c_out, 1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(self.relu(x)))


def make_op(name: str, channels: int) -> nn.Module:
    """One candidate op by name; every op keeps (B, C, H, W)."""
    if name == "sep_conv_3x3":
        return SepConv(channels, 3)
    if name == "sep_conv_5x5":
        return SepConv(channels, 5)
    if name == "avg_pool_3x3":
        return nn.AvgPool2d(3, 1, 1, count_include_pad=False)
    if name == "max_pool_3x3":
        return nn.MaxPool2d(3, 1, 1)
    if name == "identity":
        return nn.Identity()
    raise ValueError(f"unknown op {name!r}; expected one of {OP_NAMES}")


def default_genotype(num_blocks: int = 5) -> list[tuple[str, str, str, str]]:
    """The base cell: block i = sep_conv_3x3(previous block or pre1) + identity(pre0)."""
    return [("pre1" if i == 0 else f"b{i - 1}", "sep_conv_3x3", "pre0", "identity")
            for i in range(num_blocks)]


def genotype_of(sample: dict, num_blocks: int = 5) -> list[tuple[str, str, str, str]]:
    """A sample of :func:`nasnet_space` -> [(input a, op a, input b, op b)] per block."""
    return [tuple(sample[f"normal/b{i}_{side}/{what}"] for side in "ab"
                  for what in ("input", "op")) for i in range(num_blocks)]


class Cell(nn.Module):
    """A normal cell built from a genotype: (s0, s1) -> (B, num_blocks * C, H, W)."""

    def __init__(self, c_pp: int, c_p: int, channels: int, genotype: list):
        super().__init__()
        self.genotype = [tuple(block) for block in genotype]
        self.pre0 = ReLUConvBN(c_pp, channels)
        self.pre1 = ReLUConvBN(c_p, channels)
        for i, (_, op_a, _, op_b) in enumerate(self.genotype):
            setattr(self, f"b{i}_a", make_op(op_a, channels))
            setattr(self, f"b{i}_b", make_op(op_b, channels))
            setattr(self, f"b{i}", ops.Sum())

    def forward(self, s0: torch.Tensor, s1: torch.Tensor) -> torch.Tensor:
        states = {"pre0": self.pre0(s0), "pre1": self.pre1(s1)}
        for i, (in_a, _, in_b, _) in enumerate(self.genotype):
            a = getattr(self, f"b{i}_a")(states[in_a])
            b = getattr(self, f"b{i}_b")(states[in_b])
            states[f"b{i}"] = getattr(self, f"b{i}")(a, b)
        # (B, C, H, W) x num_blocks -> (B, num_blocks * C, H, W)
        return torch.cat([states[f"b{i}"] for i in range(len(self.genotype))], dim=1)


class NASNet(nn.Module):
    """Stem, ``num_cells`` cells of one genotype, global pooling, a linear classifier.

    Args:
        genotype: [(input a, op a, input b, op b)] per block (default: :func:`default_genotype`).
        channels: C, the width of every block.
        num_cells: how many cells, in sequence.
        in_channels, num_classes: of the images and the labels.
    """

    def __init__(self, genotype: list | None = None, channels: int = 8, num_cells: int = 2,
                 in_channels: int = 3, num_classes: int = 10):
        super().__init__()
        genotype = genotype or default_genotype()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels))
        c_pp, c_p = channels, channels
        self.cells = nn.ModuleList()
        for _ in range(num_cells):
            self.cells.append(Cell(c_pp, c_p, channels, genotype))
            c_pp, c_p = c_p, len(genotype) * channels
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_p, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1)
        return self.fc(self.pool(s1).flatten(1))  # (B, C', 1, 1) -> (B, num_classes)


def _states_before(block: int):
    """Candidate inputs of block ``block``'s ops: pre0, pre1 and the earlier blocks, all in
    the target's own cell."""
    def candidates(target):
        cell = target.name.rpartition(".")[0]
        return [f"{cell}.pre0", f"{cell}.pre1"] + [f"{cell}.b{j}" for j in range(block)]
    return candidates


def nasnet_space(channels: int = 8, num_cells: int = 2, num_blocks: int = 5,
                 in_channels: int = 3, num_classes: int = 10,
                 image_size: int = 32) -> rt.ModelSpace:
    """The NASNet-like normal-cell space; see the module docstring.

    Args:
        channels: C, the width of every block (small: models run on a CPU in milliseconds).
        num_cells: cells in sequence, all of one sampled architecture.
        num_blocks: B, blocks per cell (NASNet uses 5).
        in_channels, image_size: of the example input ``(1, in_channels, size, size)``.
        num_classes: outputs of the classifier.
    """
    base = NASNet(default_genotype(num_blocks), channels, num_cells, in_channels, num_classes)
    candidates = {name: make_op(name, channels) for name in OP_NAMES}
    mutators = []
    for i in range(num_blocks):
        for side in "ab":
            where = f"cells.*.b{i}_{side}"
            mutators.append(rt.apply_mutator(where, InputMutator(
                _states_before(i), shared=True, label=f"normal/b{i}_{side}/input")))
            mutators.append(rt.apply_mutator(where, OperatorMutator(
                candidates, shared=True, label=f"normal/b{i}_{side}/op")))
    return rt.ModelSpace(base, mutators,
                         example_input=torch.randn(1, in_channels, image_size, image_size))
