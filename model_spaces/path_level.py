"""Path-level network transformation (Cai et al., "Path-Level Network Transformation for
Efficient Architecture Search", ICML 2018): a DenseNet-BC whose 3x3 convolutions become one
tree-structured cell, grown by the paper's path-level transformations.

The base network is DenseNet-BC: a 3x3 stem, dense blocks of layers (BN-ReLU-1x1 conv to 4k
channels, then the *cell*, 4k -> k, its output concatenated to the layer's input), a
transition between blocks (BN-ReLU-1x1 conv halving the channels, 2x2 average pooling), BN-ReLU,
global pooling and a classifier. Every layer's cell starts as the 3x3 conv (``["op",
"conv_3x3"]``) and all cells share one structure, as the paper's searched cell.

Each step of :class:`CellMutator` (open-ended: while ``"path/grow{i}"`` says True) picks a node
of the cell's tree (``"path/node{i}"``: ``"r"``, ``"r.0"``, ...), one transformation
(``"path/kind{i}"``) and, for ``change_op``, the new primitive (``"path/op{i}"``); the trees and
transformations are :mod:`model_spaces.path_tree`'s::

    replicate:  t            ->  add[t, t]             (replication-add: the branches' mean)
    split:      op(C)        ->  concat[op(C/2), op(C/2)]   (split-concat of the filters)
    deepen:     t            ->  seq[t, identity]      (a new node: the tree grows deeper)
    change_op:  identity     ->  another primitive     (the new edge's operation)

So the meta-controller's actions (the row runs ``PolicyBasedRL`` over these choices) are the
paper's: where to replicate or split (a node's merge scheme, add or concat, and its branches,
one more per step), where to insert a node, and which operation a new edge takes. The first
three preserve the network's function when the transformed network takes the original's
weights (:func:`transfer_network`: copied, or the filters divided); the tests check it. Each
cell records its steps, so a transformed network trained by the engine starts from the start
network's checkpoint through them (:meth:`Cell.inherit_state`; the row's ``PathLevelRL`` asks
for it, as the paper's children inherit the start network's weights).
Primitives (the paper's): 1x1 and 3x3 conv, 3x3 / 5x5 / 7x7 depthwise-separable conv, 3x3
average and max pooling, identity.

Unbounded space (``size()`` is ``math.inf``). Presets: :func:`small` k = 8, 2 blocks of 2
layers (8x8 digits); :func:`paper` DenseNet-BC with k = 12, 3 blocks of 16 layers (L = 100,
CIFAR-10 shapes), the paper's first base network.

Example::

    >>> space = small()
    >>> model = space.instantiate({"path/grow0": True, "path/node0": "r",
    ...                            "path/kind0": "split", "path/grow1": False})
    >>> sorted({n.op.spec["args"][0][0] for n in model.graph.nodes
    ...         if n.kind == "module" and n.op.spec["cls"].endswith(":Cell")})
    ['concat']
"""
from __future__ import annotations

import torch
from torch import nn

import retiarii as rt
from model_spaces.path_tree import PRIMITIVES, Tree, apply, kinds, nodes, transfer

BASE_CELL = ["op", "conv_3x3"]


@rt.leaf
class Cell(nn.Module):
    """The tree-structured cell: (B, C_in, H, W) -> (B, C_out, H, W).

    ``steps``: the transformations ``[path, kind, op]`` that made ``tree`` from
    :data:`BASE_CELL`, in order; they let the cell take an ancestor's weights through the
    function-preserving transfers (:meth:`inherit_state`)."""

    def __init__(self, tree: list, c_in: int, c_out: int, steps: list | tuple = ()):
        super().__init__()
        self.c_in, self.c_out, self.steps = c_in, c_out, [list(s) for s in steps]
        self.tree = Tree(tree, c_in, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tree(x)

    def inherit_state(self, parent: dict[str, torch.Tensor]) -> bool:
        """Take the weights of an ancestor cell (``parent``: its state dict, names relative
        to the cell) through :func:`model_spaces.path_tree.transfer`, one step at a time, so
        that the cell computes the ancestor's function (up to a ``change_op``'s fresh edge).
        The ancestor is the tree after the longest prefix of ``steps`` whose tensors have
        ``parent``'s names and shapes; False (nothing copied) when no prefix has them.

        The engine's weight inheritance calls it (engine/trainers/inheritance.py)."""
        trees = [BASE_CELL]
        for path, kind, op in self.steps:
            trees.append(apply(trees[-1], path, kind, self.c_out, op))
        shapes = {k: tuple(v.shape) for k, v in parent.items()}
        for start in range(len(trees) - 1, -1, -1):
            old = Tree(trees[start], self.c_in, self.c_out)
            if {f"tree.{k}": tuple(v.shape) for k, v in old.state_dict().items()} == shapes:
                break
        else:
            return False
        old.load_state_dict({k[len("tree."):]: v for k, v in parent.items()})
        for (path, kind, _), tree in zip(self.steps[start:], trees[start + 1:]):
            new = Tree(tree, self.c_in, self.c_out)  # fresh weights where kind is change_op
            transfer(old, new, path, kind)
            old = new
        self.tree.load_state_dict(old.state_dict())
        return True


class DenseLayer(nn.Module):
    """BN-ReLU-1x1 conv (4k), the cell (4k -> k), concatenated: (B, C, H, W) -> (B, C+k, H, W)."""

    def __init__(self, c_in: int, growth: int):
        super().__init__()
        self.bn = nn.BatchNorm2d(c_in)
        self.relu = nn.ReLU()
        self.bottleneck = nn.Conv2d(c_in, 4 * growth, 1, bias=False)
        self.cell = Cell(BASE_CELL, 4 * growth, growth)

    def forward(self, x):
        return torch.cat([x, self.cell(self.bottleneck(self.relu(self.bn(x))))], dim=1)


class DenseNetBC(nn.Module):
    """Stem, ``blocks`` dense blocks of ``layers`` layers with transitions, classifier."""

    def __init__(self, growth: int, blocks: int, layers: int, in_channels: int,
                 num_classes: int):
        super().__init__()
        c = 2 * growth
        parts: list[nn.Module] = [nn.Conv2d(in_channels, c, 3, padding=1, bias=False)]
        for b in range(blocks):
            for _ in range(layers):
                parts.append(DenseLayer(c, growth))
                c += growth
            if b < blocks - 1:  # transition: half the channels, half the resolution
                parts += [nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c // 2, 1, bias=False),
                          nn.AvgPool2d(2)]
                c //= 2
        self.features = nn.Sequential(*parts, nn.BatchNorm2d(c), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x):
        return self.fc(self.pool(self.features(x)).flatten(1))


class CellMutator(rt.Mutator):
    """The path-level transformations of the shared cell, one per step (module docstring)."""

    open_ended = True

    def __init__(self):
        super().__init__("path")

    def _cells(self) -> list:
        return [n for n in self.graph.nodes if n.kind == "module" and n.op.spec
                and n.op.spec["cls"].endswith(":Cell")]

    def mutate(self, targets):
        cells = self._cells()
        growth = cells[0].op.spec["args"][2]  # every cell: 4k -> k channels
        tree, steps = BASE_CELL, []
        while self.choose([False, True], label=f"path/grow{len(steps)}"):
            i = len(steps)
            path = self.choose(list(nodes(tree)), label=f"path/node{i}")
            kind = self.choose(kinds(tree, path, growth), label=f"path/kind{i}")
            op = self.choose([p for p in PRIMITIVES if p != "identity"],
                             label=f"path/op{i}") if kind == "change_op" else None
            tree = apply(tree, path, kind, growth, op)
            steps.append([path, kind, op])
        if steps:  # every layer's cell takes the new structure, at that layer's widths
            for cell in cells:
                c_in, c_out = cell.op.spec["args"][1:3]
                self.replace(cell, Cell(tree, c_in, c_out, steps))


def transfer_network(old: nn.Module, new: nn.Module, path: str, kind: str) -> None:
    """Give ``new`` (the network after ``kind`` at ``path`` of its cell) ``old``'s weights:
    every cell through :func:`model_spaces.path_tree.transfer`, every other tensor by name.
    For replicate, split and deepen, ``new`` then computes ``old``'s function."""
    old_cells = {n: m for n, m in old.named_modules() if isinstance(m, Cell)}
    new_cells = {n: m for n, m in new.named_modules() if isinstance(m, Cell)}
    if old_cells.keys() != new_cells.keys():
        raise ValueError(f"the networks' cells differ: {sorted(old_cells)} vs "
                         f"{sorted(new_cells)}")
    for name, cell in new_cells.items():
        transfer(old_cells[name].tree, cell.tree, path, kind)
    old_state = old.state_dict()
    inside = tuple(f"{name}." for name in new_cells)
    with torch.no_grad():
        for name, tensor in new.state_dict().items():
            if not name.startswith(inside):
                tensor.copy_(old_state[name])


def path_level_space(growth: int, blocks: int, layers: int, in_channels: int = 3,
                     num_classes: int = 10, image_size: int = 32) -> rt.ModelSpace:
    """The path-level space; see the module docstring."""
    return rt.ModelSpace(DenseNetBC(growth, blocks, layers, in_channels, num_classes),
                         [CellMutator()],
                         example_input=torch.zeros(1, in_channels, image_size, image_size))


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8) -> rt.ModelSpace:
    """k = 8, 2 dense blocks of 2 layers."""
    return path_level_space(8, 2, 2, in_channels, num_classes, image_size)


def paper(in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> rt.ModelSpace:
    """DenseNet-BC (L = 100, k = 12): 3 dense blocks of 16 layers."""
    return path_level_space(12, 3, 16, in_channels, num_classes, image_size)
