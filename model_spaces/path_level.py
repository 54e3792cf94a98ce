"""Path-level network transformation (Cai et al., "Path-Level Network Transformation for
Efficient Architecture Search", ICML 2018): an evolving space whose layers grow into trees of
branches by *replication* and *split*.

The base network is a stem, ``num_layers`` 3x3 conv layers (each a leaf :class:`PathOp`) and
a classifier. Every step of :class:`PathMutator` (open-ended: while ``"path/grow{i}"`` says
True) picks a leaf op (``"path/leaf{i}"``) and one transformation (``"path/kind{i}"``)::

    replicate:   a ─▶ op ─▶ b       becomes   a ─┬─▶ op  ─┬─▶ mean ─▶ b     (the "add" node)
                                                 └─▶ op' ─┘
    split:       a ─▶ conv(C) ─▶ b  becomes   a ─┬─▶ conv(C/2) ─┬─▶ cat ─▶ b (the "concat"
                                                 └─▶ conv(C/2) ─┘               node)
    change_op:   a ─▶ op ─▶ b       becomes   a ─▶ op'' ─▶ b  (``"path/op{i}"``)

Replication and split are the paper's function-preserving transformations (with weights
copied, or divided among the branches, the network computes the same function; here every
model trains from scratch, so only the structure matters); change_op then makes a branch
another primitive, as the paper's tree cells allow. Branches can be transformed again, so a
layer grows into a tree. Primitives: conv 1x1 and 3x3, sep conv 3x3 / 5x5 / 7x7 (each with
BatchNorm and ReLU), avg and max pool 3x3 and identity (the last three only where a leaf
keeps its width).

Unbounded space (``size()`` is ``math.inf``). The paper's meta-controller is a tree-structured
RL agent; the row runs ``PolicyBasedRL`` over the transformation choices. Presets:
:func:`small` 3 layers of 16 channels; :func:`paper` 6 layers of 64 channels on CIFAR-10
shapes (the paper transforms DenseNet and PyramidNet cells; this base is a plain
conv stack).

Example::

    >>> space = small()
    >>> model = space.instantiate({"path/grow0": True, "path/leaf0": "layers.1",
    ...                            "path/kind0": "split", "path/grow1": False})
    >>> sorted(n.name for n in model.graph.nodes if n.name.startswith("path_0"))
    ['path_0_branch', 'path_0_merge']
"""
from __future__ import annotations

import torch
from torch import nn

import retiarii as rt
from retiarii import ops

PRIMITIVES = ("conv_3x3", "conv_1x1", "sep_conv_3x3", "sep_conv_5x5", "sep_conv_7x7",
              "avg_pool_3x3", "max_pool_3x3", "identity")
WIDTH_KEEPING = ("avg_pool_3x3", "max_pool_3x3", "identity")
KINDS = ("replicate", "split", "change_op")


@rt.leaf
class PathOp(nn.Module):
    """One primitive: (B, C_in, H, W) -> (B, C_out, H, W)."""

    def __init__(self, name: str, c_in: int, c_out: int):
        super().__init__()
        if name in WIDTH_KEEPING and c_in != c_out:
            raise ValueError(f"{name} keeps the width; got {c_in} -> {c_out} channels")
        if name.startswith("sep_conv_"):
            k = int(name[-1])
            self.op = nn.Sequential(nn.Conv2d(c_in, c_in, k, padding=k // 2, groups=c_in,
                                              bias=False),
                                    nn.Conv2d(c_in, c_out, 1, bias=False),
                                    nn.BatchNorm2d(c_out), nn.ReLU())
        elif name.startswith("conv_"):
            k = int(name[-1])
            self.op = nn.Sequential(nn.Conv2d(c_in, c_out, k, padding=k // 2, bias=False),
                                    nn.BatchNorm2d(c_out), nn.ReLU())
        elif name == "avg_pool_3x3":
            self.op = nn.AvgPool2d(3, 1, 1, count_include_pad=False)
        elif name == "max_pool_3x3":
            self.op = nn.MaxPool2d(3, 1, 1)
        else:
            self.op = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)


class ConvStack(nn.Module):
    """Stem, ``num_layers`` conv 3x3 leaves (max pooling after every third), classifier."""

    def __init__(self, channels: int, num_layers: int, in_channels: int, num_classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels), nn.ReLU())
        layers = []
        for i in range(num_layers):
            layers.append(PathOp("conv_3x3", channels, channels))
            if i % 3 == 2 and i < num_layers - 1:
                layers.append(nn.MaxPool2d(2, 2))
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x):
        return self.fc(self.pool(self.layers(self.stem(x))).flatten(1))


class PathMutator(rt.Mutator):
    """Replication, split and op changes of leaf ops, one per step (module docstring)."""

    open_ended = True

    def __init__(self):
        super().__init__("path")

    def _leaves(self) -> dict:
        return {n.name: n for n in self.graph.nodes if n.kind == "module" and n.op.spec
                and n.op.spec["cls"].endswith(":PathOp")}

    @staticmethod
    def _args(node) -> tuple[str, int, int]:
        name, c_in, c_out = node.op.spec["args"]
        return name, c_in, c_out

    def _kinds(self, node) -> list[str]:
        name, _, c_out = self._args(node)
        can_split = name not in WIDTH_KEEPING and c_out >= 2
        return [k for k in KINDS if k != "split" or can_split]

    def _branches(self, i: int, node, ops_: list, merge: nn.Module) -> None:
        """``node`` becomes the first of ``ops_`` and a new node the second, both reading
        ``node``'s input, merged by ``merge`` into what ``node`` fed."""
        users = self.graph.out_edges(node)
        src = node.inputs[0]
        self.replace(node, ops_[0])
        branch = self.create_node(f"path_{i}_branch", ops_[1])
        total = self.create_node(f"path_{i}_merge", merge)
        self.connect(src, branch)
        for user, port in users:
            self.connect(total, user, port)
        self.connect(node, total)
        self.connect(branch, total)

    def mutate(self, targets):
        i = 0
        while self.choose([False, True], label=f"path/grow{i}"):
            node = self.choose(self._leaves(), label=f"path/leaf{i}")
            kind = self.choose(self._kinds(node), label=f"path/kind{i}")
            name, c_in, c_out = self._args(node)
            if kind == "replicate":
                self._branches(i, node, [PathOp(name, c_in, c_out)] * 2, ops.Mean())
            elif kind == "split":
                half = c_out // 2
                self._branches(i, node, [PathOp(name, c_in, half),
                                         PathOp(name, c_in, c_out - half)], ops.Concat())
            else:
                options = [p for p in PRIMITIVES if p != name and
                           (c_in == c_out or p not in WIDTH_KEEPING)]
                self.replace(node, PathOp(self.choose(options, label=f"path/op{i}"), c_in,
                                          c_out))
            i += 1


def path_level_space(channels: int, num_layers: int, in_channels: int = 3,
                     num_classes: int = 10, image_size: int = 32) -> rt.ModelSpace:
    """The path-level space; see the module docstring."""
    return rt.ModelSpace(ConvStack(channels, num_layers, in_channels, num_classes),
                         [PathMutator()],
                         example_input=torch.zeros(1, in_channels, image_size, image_size))


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8) -> rt.ModelSpace:
    """3 layers of 16 channels."""
    return path_level_space(16, 3, in_channels, num_classes, image_size)


def paper(in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> rt.ModelSpace:
    """6 layers of 64 channels (max pooling after the third)."""
    return path_level_space(64, 6, in_channels, num_classes, image_size)
