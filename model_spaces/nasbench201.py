"""NAS-Bench-201 (Dong & Yang, ICLR 2020): one cell of 4 nodes, 5 candidate ops per edge.

The cell is a DAG on nodes 0..3; node ``j`` is the sum over ``i < j`` of ``op_ij(node i)``
and node 3 is the cell's output. Each of the 6 edges picks one of 5 ops::

    node0 ──op01──▶ node1 ──op12──▶ node2 ──op23──▶ node3      ops: none (zero),
      │ └────────op02──────────────▶  ▲               ▲             skip_connect,
      │            └──────op13────────┼───────────────┤             nor_conv_1x1,
      └─────────────────────op03──────┴───────────────┘             nor_conv_3x3,
                                    (op13: node1 -> node3)          avg_pool_3x3

so the space has exactly 5 ** 6 = 15,625 cells, the size the paper publishes (it counts
isomorphic cells separately, as we do). The network (the paper's macro skeleton) is a 3x3
conv stem, three stages of ``N`` cells with widths C, 2C, 4C, a residual block with stride 2
between stages, then BN-ReLU, global pooling and a linear classifier. Every cell shares the
one architecture: the 6 choices are labelled ``"edge_{i}{j}"`` in every cell (same label,
same decision). "nor_conv" is ReLU-Conv-BN, as in the paper.

Presets: :func:`paper` is the published network (C=16, N=5: 15 cells); :func:`small` (C=8,
N=1) trains on the 8x8 digits in about a second per epoch on a CPU. ``ops=`` narrows edges to
fewer candidates (one name fixes the edge): a sub-space of the same cells, e.g. the one our
tabular benchmark trains in full (``benchmarks/tabular.py``, :data:`TABLE_OPS`).

Example::

    >>> space = small()
    >>> space.size()
    15625
    >>> net = space.build(space.random_sample(seed=0).sample)
    >>> net(torch.zeros(2, 1, 8, 8)).shape
    torch.Size([2, 10])
"""
from __future__ import annotations

import torch
from torch import nn

import retiarii as rt

OP_NAMES = ("none", "skip_connect", "nor_conv_1x1", "nor_conv_3x3", "avg_pool_3x3")
EDGES = [(i, j) for j in range(1, 4) for i in range(j)]  # (0,1) (0,2) (1,2) (0,3) (1,3) (2,3)
EDGE_LABELS = tuple(f"edge_{i}{j}" for i, j in EDGES)
PUBLISHED_SIZE = 15_625

# The sub-space of the tabular benchmark (4 ** 5 = 1,024 cells, all trained): the cell keeps its
# input -> output edge as an identity shortcut (a residual cell, as in ResNet), and each other
# edge picks one of four ops; average pooling goes. Narrowed so that every model trains in under
# an hour on 2 cores (all 15,625 would take 7-15 hours there).
TABLE_OPS = {label: ("skip_connect",) if label == "edge_03" else OP_NAMES[:4]
             for label in EDGE_LABELS}


def _edge_ops(ops: dict | None) -> dict[str, tuple[str, ...]]:
    """``ops`` (edge label -> candidate op names; None: all five everywhere) checked."""
    if ops is None:
        return {label: OP_NAMES for label in EDGE_LABELS}
    if set(ops) != set(EDGE_LABELS):
        raise ValueError(f"ops= must name every edge, {EDGE_LABELS}; got {sorted(ops)}")
    out = {}
    for label in EDGE_LABELS:  # the order the cell asks its choices in, whatever ops= lists
        names = tuple(ops[label])
        unknown = [n for n in names if n not in OP_NAMES]
        if not names or unknown or len(set(names)) != len(names):
            raise ValueError(f"ops[{label!r}] = {names}: give distinct names of {OP_NAMES}")
        out[label] = names
    return out


class Zero(nn.Module):
    """The "none" op: the edge carries nothing (a zero tensor of the input's shape)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul(0.0)


class ReLUConvBN(nn.Module):
    """ReLU, k x k conv, BatchNorm: (B, C_in, H, W) -> (B, C_out, H / stride, W / stride)."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int, stride: int = 1):
        super().__init__()
        self.relu = nn.ReLU()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size, stride, padding=kernel_size // 2,
                              bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(self.relu(x)))


def make_op(name: str, channels: int) -> nn.Module:
    """One candidate op of an edge; every op keeps (B, C, H, W)."""
    if name == "none":
        return Zero()
    if name == "skip_connect":
        return nn.Identity()
    if name == "nor_conv_1x1":
        return ReLUConvBN(channels, channels, 1)
    if name == "nor_conv_3x3":
        return ReLUConvBN(channels, channels, 3)
    if name == "avg_pool_3x3":
        return nn.AvgPool2d(3, 1, 1, count_include_pad=False)
    raise ValueError(f"unknown op {name!r}; expected one of {OP_NAMES}")


class Cell(nn.Module):
    """The searched cell: (B, C, H, W) -> (B, C, H, W); edge (i, j) is ``self.edge_{i}{j}``, a
    choice among ``ops[label]`` (all five by default), or that op itself when it is the only one."""

    def __init__(self, channels: int, ops: dict | None = None):
        super().__init__()
        for label, names in _edge_ops(ops).items():
            edge = make_op(names[0], channels) if len(names) == 1 else rt.LayerChoice(
                {name: make_op(name, channels) for name in names}, label=label)
            setattr(self, label, edge)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nodes = [x]
        for j in range(1, 4):
            # node j = sum of the ops on its incoming edges
            total = getattr(self, f"edge_0{j}")(nodes[0])
            for i in range(1, j):
                total = total + getattr(self, f"edge_{i}{j}")(nodes[i])
            nodes.append(total)
        return nodes[3]


class ResidualReduction(nn.Module):
    """The block between stages: a stride-2 basic residual block, (B, C, H, W) ->
    (B, 2C, H/2, W/2); the shortcut is 2x2 average pooling then a 1x1 conv (the paper's)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.a = ReLUConvBN(c_in, c_out, 3, stride=2)
        self.b = ReLUConvBN(c_out, c_out, 3)
        self.pool = nn.AvgPool2d(2, 2)
        self.proj = nn.Conv2d(c_in, c_out, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) + self.proj(self.pool(x))


class NASBench201Net(nn.Module):
    """Stem, 3 stages of ``cells_per_stage`` cells (C, 2C, 4C) joined by residual reductions,
    BN-ReLU, global pooling, classifier.

    Args:
        channels: C, the width of the first stage (the paper: 16).
        cells_per_stage: N (the paper: 5).
        in_channels, num_classes: of the images and the labels.
        ops: edge label -> candidate op names (None: all five on every edge).
    """

    def __init__(self, channels: int = 16, cells_per_stage: int = 5, in_channels: int = 3,
                 num_classes: int = 10, ops: dict | None = None):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels))
        layers = []
        c = channels
        for stage in range(3):
            if stage > 0:
                layers.append(ResidualReduction(c, 2 * c))
                c *= 2
            layers += [Cell(c, ops) for _ in range(cells_per_stage)]
        self.layers = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.BatchNorm2d(c), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.layers(self.stem(x)))
        return self.fc(self.pool(x).flatten(1))  # (B, 4C, 1, 1) -> (B, num_classes)


def nasbench201_space(channels: int = 16, cells_per_stage: int = 5, in_channels: int = 3,
                      num_classes: int = 10, image_size: int = 32,
                      ops: dict | None = None) -> rt.ModelSpace:
    """The NAS-Bench-201 space around :class:`NASBench201Net`; see the module docstring."""
    return rt.ModelSpace(NASBench201Net(channels, cells_per_stage, in_channels, num_classes, ops),
                         example_input=torch.zeros(1, in_channels, image_size, image_size))


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8,
          ops: dict | None = None) -> rt.ModelSpace:
    """C=8, one cell per stage: trains on the 8x8 digits in seconds (``ops``: a sub-space)."""
    return nasbench201_space(8, 1, in_channels, num_classes, image_size, ops)


def paper(in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> rt.ModelSpace:
    """The published network: C=16, N=5 (CIFAR-10 shapes by default)."""
    return nasbench201_space(16, 5, in_channels, num_classes, image_size)


def full_sample(sample: dict, ops: dict | None = None) -> dict:
    """A sample of a sub-space (``ops``) with its fixed edges filled in: all six edges."""
    fixed = {label: names[0] for label, names in _edge_ops(ops).items() if len(names) == 1}
    return {label: sample[label] if label in sample else fixed[label] for label in EDGE_LABELS}


def arch_string(sample: dict) -> str:
    """A sample -> the benchmark's string, e.g. ``|nor_conv_3x3~0|+|none~0|skip_connect~1|+...``,
    to look a model up in the published NAS-Bench-201 tables."""
    nodes = []
    for j in range(1, 4):
        nodes.append("|" + "|".join(f"{sample[f'edge_{i}{j}']}~{i}" for i in range(j)) + "|")
    return "+".join(nodes)
