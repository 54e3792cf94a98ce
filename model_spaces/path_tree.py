"""Path-level NAS's tree-structured cell (Cai et al., ICML 2018) and its function-preserving transformations.

A cell is a tree, written as JSON-able nested lists so that it can be a module's constructor
argument (the IR stores it)::

    ["op", name]                      a primitive edge, c_in -> c_out
    ["add", [t1, t2, ...]]            every branch reads the input; the mean of their outputs
    ["concat", [t1, t2, ...]]         every branch reads the input; outputs concatenated
    ["seq", [t1, t2]]                 t1 then t2 (a node inserted after an edge)

A node is named by its path from the root: ``"r"``, ``"r.0"`` (the first branch or part of r),
``"r.1.0"``... The transformations, each on the node at a path:

* ``replicate``: t -> ``["add", [t, t]]`` (the paper's replication-add);
* ``split``: a conv-like ``["op", name]`` of C filters -> ``["concat", [op(C/2), op(C - C/2)]]``
  (the paper's split-concat);
* ``deepen``: t -> ``["seq", [t, ["op", "identity"]]]`` (a new node on the path, an identity
  edge: the tree grows deeper);
* ``change_op``: an identity edge becomes another primitive (the paper's new edges).

The first three preserve the network's function when the new cell's weights come from the old
one's (:func:`transfer`): replicated branches are copies (their mean is the original output);
split branches take the original filters (and their BatchNorm channels), in order; a deepening
adds an identity. ``change_op`` does too where the new operation can be the identity
(:func:`identity_init`: the convolutions, plain and depthwise-separable, Net2DeeperNet's way);
average and max pooling cannot, and change the function.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

PRIMITIVES = ("conv_3x3", "conv_1x1", "sep_conv_3x3", "sep_conv_5x5", "sep_conv_7x7",
              "avg_pool_3x3", "max_pool_3x3", "identity")
WIDTH_KEEPING = ("avg_pool_3x3", "max_pool_3x3", "identity")
KINDS = ("replicate", "split", "deepen", "change_op")


class PathOp(nn.Module):
    """One primitive: (B, C_in, H, W) -> (B, C_out, H, W)."""

    def __init__(self, name: str, c_in: int, c_out: int):
        super().__init__()
        if name not in PRIMITIVES:
            raise ValueError(f"unknown primitive {name!r}; expected one of {PRIMITIVES}")
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


class Tree(nn.Module):
    """A tree node (see the module docstring): (B, C_in, H, W) -> (B, C_out, H, W)."""

    def __init__(self, tree: list, c_in: int, c_out: int):
        super().__init__()
        self.kind = tree[0]
        if self.kind == "op":
            self.parts = nn.ModuleList([PathOp(tree[1], c_in, c_out)])
        elif self.kind in ("add", "seq"):
            widths = [(c_in, c_out)] * len(tree[1]) if self.kind == "add" else \
                [(c_in, c_out), (c_out, c_out)]
            self.parts = nn.ModuleList([Tree(t, a, b) for t, (a, b) in zip(tree[1], widths)])
        elif self.kind == "concat":
            sizes = split_sizes(c_out, len(tree[1]))
            self.parts = nn.ModuleList([Tree(t, c_in, c) for t, c in zip(tree[1], sizes)])
        else:
            raise ValueError(f"unknown tree node {tree!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "op":
            return self.parts[0](x)
        if self.kind == "seq":
            return self.parts[1](self.parts[0](x))
        outs = [part(x) for part in self.parts]
        if self.kind == "add":  # (N, B, C, H, W) -> (B, C, H, W)
            return torch.stack(outs).mean(0)
        return torch.cat(outs, dim=1)  # N x (B, C_i, H, W) -> (B, sum C_i, H, W)


def split_sizes(channels: int, n: int) -> list[int]:
    """Filters per branch of a split: as even as possible, the first ones larger.

    Example:
        >>> split_sizes(9, 2)
        [5, 4]
    """
    return [channels // n + (i < channels % n) for i in range(n)]


def node(tree: list, path: str) -> list:
    """The subtree at ``path`` ("r", "r.0", ...)."""
    for index in path.split(".")[1:]:
        tree = tree[1][int(index)]
    return tree


def nodes(tree: list, path: str = "r") -> dict[str, list]:
    """Every node's path -> subtree, parents before children."""
    out = {path: tree}
    if tree[0] != "op":
        for i, sub in enumerate(tree[1]):
            out.update(nodes(sub, f"{path}.{i}"))
    return out


def width(tree: list, path: str, c_out: int) -> int:
    """The output channels of the node at ``path`` in a cell of ``c_out`` channels.

    Example:
        >>> width(["concat", [["op", "conv_3x3"], ["op", "conv_3x3"]]], "r.1", 5)
        2
    """
    for index in path.split(".")[1:]:
        if tree[0] == "concat":
            c_out = split_sizes(c_out, len(tree[1]))[int(index)]
        tree = tree[1][int(index)]
    return c_out


def kinds(tree: list, path: str, c_out: int) -> list[str]:
    """The transformations that apply at ``path`` of a cell of ``c_out`` channels (a split
    needs two filters or more)."""
    sub = node(tree, path)
    out = ["replicate", "deepen"]
    if sub[0] == "op" and sub[1] not in WIDTH_KEEPING and width(tree, path, c_out) >= 2:
        out.append("split")
    if sub == ["op", "identity"]:
        out.append("change_op")
    return [k for k in KINDS if k in out]


def apply(tree: list, path: str, kind: str, c_out: int, op: str | None = None) -> list:
    """The tree after ``kind`` at ``path`` of a cell of ``c_out`` channels (a new tree;
    ``op``: change_op's primitive).

    Example:
        >>> apply(["op", "conv_3x3"], "r", "split", 8)
        ['concat', [['op', 'conv_3x3'], ['op', 'conv_3x3']]]
    """
    if kind not in kinds(tree, path, c_out):
        raise ValueError(f"{kind} does not apply at {path} of {tree}")
    sub = node(tree, path)
    new = {"replicate": lambda: ["add", [copy.deepcopy(sub), copy.deepcopy(sub)]],
           "split": lambda: ["concat", [list(sub), list(sub)]],
           "deepen": lambda: ["seq", [copy.deepcopy(sub), ["op", "identity"]]],
           "change_op": lambda: ["op", op]}[kind]()
    if kind == "change_op" and op not in PRIMITIVES:
        raise ValueError(f"change_op needs a primitive of {PRIMITIVES}, got {op!r}")
    if path == "r":
        return new
    out = copy.deepcopy(tree)
    parent, index = path.rsplit(".", 1)
    node(out, parent)[1][int(index)] = new
    return out


def _module_path(path: str) -> str:
    """A tree path's module name under the Tree root: "r.1.0" -> "parts.1.parts.0"."""
    return "".join(f"parts.{i}." for i in path.split(".")[1:])


def transfer(old: Tree, new: Tree, path: str, kind: str) -> None:
    """Fill ``new`` (the tree after ``kind`` at ``path``) from ``old``'s weights so that,
    for replicate, split and deepen, it computes ``old``'s function: tensors outside the
    transformed node are copied; under it, each replicated branch and the deepened node's
    first part copy the old node's, and each split branch takes its slice (dim 0, in branch
    order) of every tensor whose size differs (a separable conv's depthwise weights and
    BatchNorm's batch count: whole). ``change_op``: the new edge is identity-initialised
    where its operation allows (:func:`identity_init`; a pooling: not).
    """
    old_state, new_state = old.state_dict(), new.state_dict()
    prefix = _module_path(path)
    with torch.no_grad():
        for name, tensor in new_state.items():
            if not name.startswith(prefix):
                tensor.copy_(old_state[name])
                continue
            if kind == "change_op":
                continue  # identity-initialised below, where the op allows
            # under the node: "parts.{i}." + a name of the old node (split: of its leaf)
            _, branch, inner = name[len(prefix):].split(".", 2)
            if kind == "deepen" and branch != "0":
                continue  # the identity: no tensors (kept for a future change_op's)
            source = old_state[prefix + inner]
            if kind != "split" or source.shape == tensor.shape:
                tensor.copy_(source)
                continue
            start = sum(new_state[f"{prefix}parts.{j}.{inner}"].shape[0]
                        for j in range(int(branch)))
            tensor.copy_(source[start:start + tensor.shape[0]])  # (C, ...) -> (C_i, ...)
    if kind == "change_op":
        identity_init(new.get_submodule(prefix + "parts.0"))


def identity_init(op: PathOp) -> bool:
    """Set a new edge's ``op`` (c -> c channels) to compute the identity on the inputs an
    edge of a cell gets, Net2DeeperNet's way; True when it then does, False for pooling.

    A conv's kernel becomes a centred delta per channel pair (the identity matrix at the
    centre tap); a separable conv's depthwise kernel the centred delta, its pointwise conv the
    identity matrix; the BatchNorm passes its input through given its running statistics
    (scale sqrt(var + eps), shift mean: exact in eval mode; in training it normalizes the
    batch, as in Net2Net). The closing ReLU is the identity because every edge of a cell reads
    a ReLU's output (the cell's leaves end in ReLU; means, concatenations and pools of them stay
    >= 0). Average and max pooling have no weights and no setting that makes them the
    identity: the transformation then changes the function, which the paper accepts for a new
    edge's operation.

    Example:
        >>> op = PathOp("sep_conv_3x3", 4, 4).eval()
        >>> identity_init(op), bool(torch.allclose(op(torch.ones(1, 4, 5, 5)), torch.ones(1)))
        (True, True)
    """
    if not isinstance(op.op, nn.Sequential):  # a pooling (or the identity itself)
        return isinstance(op.op, nn.Identity)
    convs = [m for m in op.op if isinstance(m, nn.Conv2d)]
    bn = next(m for m in op.op if isinstance(m, nn.BatchNorm2d))
    if any(conv.in_channels != conv.out_channels for conv in convs):
        raise ValueError(f"identity_init: a new edge keeps its width, got {convs}")
    with torch.no_grad():
        for conv in convs:  # (C_out, C_in / groups, k, k): 1 at the centre tap of (o, o)
            conv.weight.zero_()
            k = conv.kernel_size[0] // 2
            channels = torch.arange(conv.out_channels)
            conv.weight[channels, 0 if conv.groups > 1 else channels, k, k] = 1.0
        bn.weight.copy_(torch.sqrt(bn.running_var + bn.eps))
        bn.bias.copy_(bn.running_mean)
    return True
