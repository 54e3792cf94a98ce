"""Hierarchical representations (Liu et al., "Hierarchical Representations for Efficient
Architecture Search", ICLR 2018): motifs built of motifs.

Level 1 are 6 primitives (1x1 conv, 3x3 depthwise conv, 3x3 separable conv, 3x3 max and
average pooling, identity; every conv followed by BatchNorm and ReLU) and "none" (no edge).
Level 2 are 6 motifs, each a DAG of 4 nodes whose 6 edges (i -> j, i < j) are each a level-1
op or none. Level 3 is one motif, a DAG of 5 nodes whose 10 edges are each a level-2 motif or
none: the cell. A node concatenates what its edges bring depthwise, and a 1x1 conv takes the
k * C channels back to C, as the paper assembles motifs (a single edge passes as is); a
node whose edges are all none takes the node before it (so every genotype builds)::

    motif 2 (level 2):   0 ─sep3x3─▶ 1 ─max─▶ 3        cell (level 3):  0 ─m2─▶ 1 ─m5─▶ 4
                         └──identity─────────▲                           └────m1───────▲

Labels: ``"motif{m}/{i}-{j}"`` (m = 1..6; a primitive or ``"none"``) and ``"cell/{i}-{j}"``
(``"motif1"`` .. ``"motif6"`` or ``"none"``); the first candidates (identity, motif1) form
the paper's trivial genotype, where its evolution starts (the row runs
``HierarchicalEvolution(initial="base")``: each member of the initial population is the
trivial genotype diversified by 1000 random mutations, as the paper's). The cell is one
``@rt.leaf`` module built from the genotype (:class:`HierarchicalCell`), in every cell
position of the network.

Size: 7 ** (6 * 6) level-2 genotypes times 7 ** 10 cells = 7 ** 46 (about 7.6e38; the paper
states no count).

The network is the paper's: a 3x3 conv stem of C channels, then cell, sep conv stride 2
(2C), cell, sep conv stride 2 (4C), cell, global pooling, linear. Presets: :func:`paper`
C = 16 (the search-time width), :func:`small` C = 4, both with the published 6 motifs of 4
nodes and a 5-node cell.

Example::

    >>> small().size() == 7 ** 46
    True
"""
from __future__ import annotations

import torch
from torch import nn

import retiarii as rt

PRIMITIVES = ("identity", "conv_1x1", "dw_conv_3x3", "sep_conv_3x3", "max_pool_3x3",
              "avg_pool_3x3")
NONE = "none"
NUM_MOTIFS, MOTIF_NODES, CELL_NODES = 6, 4, 5
SIZE = 7 ** 46


def edges(num_nodes: int) -> list[tuple[int, int]]:
    return [(i, j) for j in range(1, num_nodes) for i in range(j)]


def primitive(name: str, c: int) -> nn.Module:
    """(B, C, H, W) -> same."""
    if name == "identity":
        return nn.Identity()
    if name == "conv_1x1":
        return nn.Sequential(nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
    if name == "dw_conv_3x3":
        return nn.Sequential(nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False),
                             nn.BatchNorm2d(c), nn.ReLU())
    if name == "sep_conv_3x3":
        return nn.Sequential(nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False),
                             nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
    if name == "max_pool_3x3":
        return nn.MaxPool2d(3, 1, 1)
    if name == "avg_pool_3x3":
        return nn.AvgPool2d(3, 1, 1, count_include_pad=False)
    raise ValueError(f"unknown primitive {name!r}; expected one of {PRIMITIVES}")


class Motif(nn.Module):
    """A DAG over ``num_nodes`` nodes: ``ops[(i, j)]`` maps node i into node j (absent: no
    edge); node 0 is the input, the last node the output. A node of several incoming edges
    concatenates them depthwise and a 1x1 conv brings the k * C channels back to C (the
    paper's merge); one edge passes as is. (B, C, H, W) -> same."""

    def __init__(self, num_nodes: int, ops: dict[tuple[int, int], nn.Module], channels: int):
        super().__init__()
        self.num_nodes = num_nodes
        self.pairs = sorted(ops)
        self.ops = nn.ModuleList(ops[pair] for pair in self.pairs)
        fan_in = {j: sum(k == j for _, k in self.pairs) for j in range(1, num_nodes)}
        self.merge = nn.ModuleDict({str(j): nn.Conv2d(n * channels, channels, 1, bias=False)
                                    for j, n in fan_in.items() if n > 1})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nodes = [x]
        for j in range(1, self.num_nodes):
            inputs = [op(nodes[i]) for (i, k), op in zip(self.pairs, self.ops) if k == j]
            if len(inputs) > 1:  # k x (B, C, H, W) -> (B, k*C, H, W) -> (B, C, H, W)
                nodes.append(self.merge[str(j)](torch.cat(inputs, dim=1)))
            else:
                nodes.append(inputs[0] if inputs else nodes[-1])
        return nodes[-1]


@rt.leaf
class HierarchicalCell(nn.Module):
    """The level-3 motif of a genotype: (B, C, H, W) -> same.

    Args:
        channels: C.
        motifs: per level-2 motif, its ops on the edges of :func:`edges` (4 nodes).
        cell: the level-3 motif: per edge of :func:`edges` (5 nodes), ``"motif{m}"`` or
            ``"none"``.
    """

    def __init__(self, channels: int, motifs, cell):
        super().__init__()
        level3 = {}
        for pair, name in zip(edges(CELL_NODES), cell):
            if name != NONE:
                genotype = motifs[int(name[len("motif"):]) - 1]
                level3[pair] = Motif(MOTIF_NODES, {p: primitive(op, channels) for p, op in
                                                   zip(edges(MOTIF_NODES), genotype)
                                                   if op != NONE}, channels)
        self.motif = Motif(CELL_NODES, level3, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.motif(x)


def trivial_genotype() -> tuple[list, list]:
    """Every level-2 edge identity, every level-3 edge motif 1."""
    motifs = [[PRIMITIVES[0]] * len(edges(MOTIF_NODES)) for _ in range(NUM_MOTIFS)]
    return motifs, ["motif1"] * len(edges(CELL_NODES))


class HierarchicalNet(nn.Module):
    """Stem, cell, sep conv /2, cell, sep conv /2, cell, global pooling, linear."""

    def __init__(self, channels: int, in_channels: int, num_classes: int):
        super().__init__()
        motifs, cell = trivial_genotype()
        c = channels
        self.stem = nn.Sequential(nn.Conv2d(in_channels, c, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(c), nn.ReLU())
        self.cell1 = HierarchicalCell(c, motifs, cell)
        self.down1 = self.downsample(c, 2 * c)
        self.cell2 = HierarchicalCell(2 * c, motifs, cell)
        self.down2 = self.downsample(2 * c, 4 * c)
        self.cell3 = HierarchicalCell(4 * c, motifs, cell)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4 * c, num_classes)

    @staticmethod
    def downsample(c_in: int, c_out: int) -> nn.Module:
        """3x3 separable conv, stride 2: (B, C_in, H, W) -> (B, C_out, H/2, W/2)."""
        return nn.Sequential(nn.Conv2d(c_in, c_in, 3, 2, 1, groups=c_in, bias=False),
                             nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out),
                             nn.ReLU())

    def forward(self, x):
        x = self.cell3(self.down2(self.cell2(self.down1(self.cell1(self.stem(x))))))
        return self.fc(self.pool(x).flatten(1))


class HierarchicalMutator(rt.Mutator):
    """Chooses the 6 motifs and the cell, then rebuilds the 3 cells from them."""

    def __init__(self, channels: int):
        super().__init__("hierarchical")
        self.widths = {"cell1": channels, "cell2": 2 * channels, "cell3": 4 * channels}

    def mutate(self, targets):
        motifs = [[self.choose(list(PRIMITIVES) + [NONE], label=f"motif{m}/{i}-{j}")
                   for i, j in edges(MOTIF_NODES)] for m in range(1, NUM_MOTIFS + 1)]
        cell = [self.choose([f"motif{m}" for m in range(1, NUM_MOTIFS + 1)] + [NONE],
                            label=f"cell/{i}-{j}") for i, j in edges(CELL_NODES)]
        if (motifs, cell) == trivial_genotype():
            return  # the base model itself
        for name, c in self.widths.items():
            self.replace(name, HierarchicalCell(c, motifs, cell))


def hierarchical_space(channels: int, in_channels: int = 3, num_classes: int = 10,
                       image_size: int = 32) -> rt.ModelSpace:
    """The hierarchical space; see the module docstring."""
    net = HierarchicalNet(channels, in_channels, num_classes)
    return rt.ModelSpace(net, [HierarchicalMutator(channels)],
                         example_input=torch.zeros(1, in_channels, image_size, image_size))


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8) -> rt.ModelSpace:
    """C = 4: cells of 4, 8, 16 channels."""
    return hierarchical_space(4, in_channels, num_classes, image_size)


def paper(in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> rt.ModelSpace:
    """C = 16: cells of 16, 32, 64 channels."""
    return hierarchical_space(16, in_channels, num_classes, image_size)
