"""NAS-Bench-101 (Ying et al., ICML 2019): a cell DAG of up to 7 vertices and 9 edges.

A cell has an input vertex, ``V - 2`` intermediate vertices (each one op of conv3x3-BN-ReLU,
conv1x1-BN-ReLU, maxpool3x3) and an output vertex; any of the ``V * (V - 1) / 2`` forward
edges may be present, at most ``max_edges`` of them. The base model is the fully connected
cell; :class:`CellMutator` picks the ops and the edges, then removes what is not on a path
from input to output (the benchmark's pruning)::

    in ─proj1─▶ Σ1 ─op1─▶ v1 ──▶ Σ2 ─op2─▶ v2 ─ ... ─▶ Σout = cell output
     └─proj2────────────────────▲                        ▲
     └─proj_out──────────────────────────────────────────┘   (every i < j edge, before mutation)

An intermediate vertex sums its inputs (the input vertex through a 1x1 projection, as in the
benchmark); the output sums the vertices that feed it plus the projected input when the
(input, output) edge is chosen. NOTE: the benchmark *concatenates* at the output and splits
the channels among the vertices feeding it; summing keeps every vertex at the cell's width
and the space of cells unchanged (the trained numbers of the published tables do not apply).

Size convention. The published 423,624 is the number of *unique* cells (V=7, <= 9 edges)
after pruning and graph isomorphism. Our samples are *labelled* specs: 5 op choices (asked
for every intermediate vertex) and the 21 edge bits, asked in order until 9 edges are chosen,
so ``size() = 3**5 * sum(C(21, k) for k <= 9) = 169,093,980`` (:func:`count`); specs that
prune to the same cell build the same structure, which the engine deduplicates by hash. A
spec with no input-to-output path (invalid in the benchmark) builds the cell whose only edge
is input -> output.

The network: a 3x3 conv stem, 3 stacks of ``cells_per_stack`` cells, 2x2 max pooling and
doubled width between stacks, global pooling and a linear classifier (all cells share the
one spec: the choices are tied by label). Presets: :func:`paper` (128 channels, 3 cells per
stack) and :func:`small` (8 channels, 1 cell per stack).

Example::

    >>> space = small()
    >>> model = space.instantiate(space.random_sample(seed=0).sample)
    >>> model.to_module()(torch.zeros(2, 1, 8, 8)).shape
    torch.Size([2, 10])
"""
from __future__ import annotations

import math

import torch
from torch import nn

import retiarii as rt
from retiarii import ops
from retiarii.nasbench_tables import prune  # noqa: F401 (the benchmark's pruning; nasbench101.prune)

OP_NAMES = ("conv3x3-bn-relu", "conv1x1-bn-relu", "maxpool3x3")
PUBLISHED_UNIQUE = 423_624


@rt.leaf
class ConvBNReLU(nn.Module):
    """k x k conv, BatchNorm, ReLU: (B, C_in, H, W) -> (B, C_out, H, W)."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size, padding=kernel_size // 2, bias=False)
        self.bn = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


def make_op(name: str, channels: int) -> nn.Module:
    if name == "conv3x3-bn-relu":
        return ConvBNReLU(channels, channels, 3)
    if name == "conv1x1-bn-relu":
        return ConvBNReLU(channels, channels, 1)
    if name == "maxpool3x3":
        return nn.MaxPool2d(3, 1, 1)
    raise ValueError(f"unknown op {name!r}; expected one of {OP_NAMES}")


class Cell(nn.Module):
    """The fully connected cell of ``num_vertices`` vertices: (B, C_in, H, W) -> (B, C, H, W).

    Vertex v (1 .. V-2) is ``op{v}(sum{v}(proj{v}(x), v_1, ..., v_{v-1}))``; the output is
    ``out(proj_out(x), v_1, ..., v_{V-2})``.
    """

    def __init__(self, c_in: int, channels: int, num_vertices: int = 7):
        super().__init__()
        self.inner = num_vertices - 2
        for v in range(1, self.inner + 1):
            setattr(self, f"proj{v}", ConvBNReLU(c_in, channels, 1))
            setattr(self, f"sum{v}", ops.Sum())
            setattr(self, f"op{v}", make_op(OP_NAMES[0], channels))
        self.proj_out = ConvBNReLU(c_in, channels, 1)
        self.out = ops.Sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vertices = []
        for v in range(1, self.inner + 1):
            total = getattr(self, f"sum{v}")(getattr(self, f"proj{v}")(x), *vertices)
            vertices.append(getattr(self, f"op{v}")(total))
        return self.out(self.proj_out(x), *vertices)


class NASBench101Net(nn.Module):
    """Stem, 3 stacks of cells (C, 2C, 4C) with 2x2 max pooling between, pooling, classifier."""

    def __init__(self, channels: int = 128, cells_per_stack: int = 3, num_vertices: int = 7,
                 in_channels: int = 3, num_classes: int = 10):
        super().__init__()
        self.stem = ConvBNReLU(in_channels, channels, 3)
        layers, c_in, c = [], channels, channels
        for stack in range(3):
            if stack > 0:
                layers.append(nn.MaxPool2d(2, 2))
                c *= 2
            for _ in range(cells_per_stack):
                layers.append(Cell(c_in, c, num_vertices))
                c_in = c
        self.cells = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.cells(self.stem(x))).flatten(1))


class CellMutator(rt.Mutator):
    """Picks each intermediate vertex's op and the cell's edges, then prunes; bound to the
    ``out`` node of every cell, with one decision for all of them (tied labels).

    Labels: ``"op{v}"`` (one of :data:`OP_NAMES`) and ``"edge{i}{j}"`` (0 or 1, asked in
    order ``(0,1), (0,2), (1,2), (0,3) ...`` while fewer than ``max_edges`` are chosen).
    """

    def __init__(self, num_vertices: int = 7, max_edges: int = 9, label: str = "nb101"):
        super().__init__(label)
        self.num_vertices, self.max_edges = num_vertices, max_edges

    def mutate(self, targets):
        n, out = self.num_vertices, self.num_vertices - 1
        ops_of = {v: self.choose(list(OP_NAMES), label=f"op{v}") for v in range(1, out)}
        edges: set[tuple[int, int]] = set()
        for j in range(1, n):
            for i in range(j):
                if len(edges) < self.max_edges and self.choose([0, 1], label=f"edge{i}{j}"):
                    edges.add((i, j))
        kept, kept_edges = prune(n, edges)
        for target in targets:
            self._edit(target.name.rpartition(".")[0], ops_of, kept, kept_edges)

    def _edit(self, cell: str, ops_of: dict, kept: set, kept_edges: set) -> None:
        g, out = self.graph, self.num_vertices - 1

        def merge(j):  # the node summing vertex j's inputs
            return g[f"{cell}.out" if j == out else f"{cell}.sum{j}"]

        for j in range(1, out + 1):
            for i in range(j):
                if (i, j) in kept_edges:
                    continue
                src = g[f"{cell}.proj_out" if j == out else f"{cell}.proj{j}"] if i == 0 \
                    else g[f"{cell}.op{i}"]
                self.disconnect(src, merge(j))
        for v in range(1, out):
            if v in kept:
                if ops_of[v] != OP_NAMES[0]:
                    channels = g[f"{cell}.op{v}"].op.spec["args"][1]
                    self.replace(f"{cell}.op{v}", make_op(ops_of[v], channels))
            else:
                for name in ("op", "sum", "proj"):
                    self.delete_node(f"{cell}.{name}{v}")
            if v in kept and (0, v) not in kept_edges:
                self.delete_node(f"{cell}.proj{v}")
        if (0, out) not in kept_edges:
            self.delete_node(f"{cell}.proj_out")


# The node types of a cell graph (Neural Predictor's one-hot features): NAS-Bench-101's
# input, its three ops, output
NODE_TYPES = ("input", *OP_NAMES, "output")


def cell_graph(sample: dict) -> tuple[list[list[int]], list[str]]:
    """A sample -> the pruned cell as ``(adjacency, node types)``: ``adjacency[i][j] = 1`` for
    an edge i -> j among the kept vertices, renumbered in order (input first, output last).

    Example:
        >>> s = {f"op{v}": "maxpool3x3" for v in range(1, 6)} | {"edge01": 1, "edge16": 1}
        >>> cell_graph(s)
        ([[0, 1, 0], [0, 0, 1], [0, 0, 0]], ['input', 'maxpool3x3', 'output'])
    """
    ops_of = {int(label[2:]): op for label, op in sample.items() if label.startswith("op")}
    n = max(ops_of) + 2
    edges = {(int(label[4]), int(label[5])) for label, bit in sample.items()
             if label.startswith("edge") and bit}
    kept, kept_edges = prune(n, edges)
    order = sorted(kept)
    adjacency = [[int((i, j) in kept_edges) for j in order] for i in order]
    types = ["input" if v == 0 else "output" if v == n - 1 else ops_of[v] for v in order]
    return adjacency, types


def count(num_vertices: int = 7, max_edges: int = 9) -> int:
    """Samples of the space: 3 ops per intermediate vertex times the edge sets of at most
    ``max_edges`` of the ``V (V - 1) / 2`` edges (169,093,980 for V=7, 9 edges)."""
    pairs = num_vertices * (num_vertices - 1) // 2
    return len(OP_NAMES) ** (num_vertices - 2) * sum(math.comb(pairs, k)
                                                     for k in range(max_edges + 1))


class NASBench101Space(rt.ModelSpace):
    """The space, whose ``size()`` is :func:`count` (walking 169 million specs to count them
    would take hours; the tests check :func:`count` against the walk on smaller cells)."""

    num_vertices, max_edges = 7, 9

    def size(self, exact: bool = False) -> int:
        return count(self.num_vertices, self.max_edges)


def nasbench101_space(channels: int = 128, cells_per_stack: int = 3, num_vertices: int = 7,
                      max_edges: int = 9, in_channels: int = 3, num_classes: int = 10,
                      image_size: int = 32) -> NASBench101Space:
    """The NAS-Bench-101 space; see the module docstring."""
    base = NASBench101Net(channels, cells_per_stack, num_vertices, in_channels, num_classes)
    space = NASBench101Space(
        base, [rt.apply_mutator("cells.*.out", CellMutator(num_vertices, max_edges))],
        example_input=torch.zeros(1, in_channels, image_size, image_size))
    space.num_vertices, space.max_edges = num_vertices, max_edges
    return space


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8):
    """8 channels, one cell per stack: trains on the 8x8 digits in seconds."""
    return nasbench101_space(8, 1, 7, 9, in_channels, num_classes, image_size)


def paper(in_channels: int = 3, num_classes: int = 10, image_size: int = 32):
    """The published network: 128 stem channels, 3 cells per stack (CIFAR-10 shapes)."""
    return nasbench101_space(128, 3, 7, 9, in_channels, num_classes, image_size)
