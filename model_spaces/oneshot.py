"""The one-shot cell space of Bender et al., "Understanding and Simplifying One-Shot
Architecture Search", ICML 2018.

A cell reads the outputs of the two previous cells (``s0``, ``s1``, each through a 1x1
ReLU-conv-BN) and has ``num_blocks`` choice blocks. Choice block b keeps one or two inputs
among ``s0``, ``s1`` and blocks 0 .. b-1 and sums them, then applies one or two of 7 ops to
the sum and adds their outputs (the paper's "up to two inputs" and "up to two operations");
the cell concatenates its blocks::

    s0  s1  b0 .. b{b-1}            7 ops: identity, conv 1x1, sep conv 3x3 / 5x5 / 7x7,
     └─ keep 1 or 2 ─┘                     max pool 3x3, avg pool 3x3
        Σ ─▶ {op, op'} ─▶ Σ = b_b           out = cat(b0, ..., b{N-1})

The base model holds every input and every op (the one-shot model itself); a sample keeps
its chosen subsets (:class:`ChoiceBlockMutator`, labels ``"block{b}/inputs"`` and
``"block{b}/ops"``, keys like ``"0+2"`` and ``"identity+max_pool_3x3"``). All cells share one
architecture. Cells are grouped in 3 stacks with 2x2 max pooling between them (the paper
uses stride-2 cells; a pool keeps one cell type).

Size: block b has ``n (n + 1) / 2`` input subsets (n = b + 2 candidates) and 7 + 21 = 28 op
subsets; with the paper's 4 blocks, 3 * 6 * 10 * 15 * 28 ** 4 = 1,659,571,200 (the paper
states no count).

Bender et al. train the one-shot model once and rank random architectures with its shared
weights; ``retiarii nas run oneshot`` does the same with ``PathDropout``
(``retiarii/strategies/one_shot/path_dropout.py``): the whole one-shot model (``space.macro
["build"]``) trains with scheduled path dropout over every choice point, a block's inputs and
its ops (``OneShotNet.choice_points``; a cell's ``masks`` weigh the paths, a path no example
keeps is not computed), and a candidate is evaluated on it with the paths it does not use
zeroed out (``OneShotNet.paths_of``).

Presets: :func:`paper` 3 stacks of 3 cells of C = 32 on 32x32 (a CIFAR-10 size; the paper
sweeps widths); :func:`small` 3 stacks of one cell of C = 8.

Example::

    >>> small().size()
    1659571200
"""
from __future__ import annotations

import functools
import itertools

import torch
from torch import nn

import retiarii as rt
from retiarii import ops
from model_spaces.darts import ReLUConvBN, SepConv

OP_NAMES = ("identity", "conv_1x1", "sep_conv_3x3", "sep_conv_5x5", "sep_conv_7x7",
            "max_pool_3x3", "avg_pool_3x3")
BLOCKS = 4
SIZE = 3 * 6 * 10 * 15 * 28 ** 4


def make_op(name: str, channels: int) -> nn.Module:
    """(B, C, H, W) -> same."""
    if name == "identity":
        return nn.Identity()
    if name == "conv_1x1":
        return ReLUConvBN(channels, channels)
    if name.startswith("sep_conv_"):
        return SepConv(channels, int(name[-1]), 1)
    if name == "max_pool_3x3":
        return nn.MaxPool2d(3, 1, 1)
    if name == "avg_pool_3x3":
        return nn.AvgPool2d(3, 1, 1, count_include_pad=False)
    raise ValueError(f"unknown op {name!r}; expected one of {OP_NAMES}")


def subsets(items: list, most: int = 2) -> dict[str, tuple]:
    """Non-empty subsets of up to ``most`` items, keyed ``"a+b"``, singles first."""
    out = {}
    for k in range(1, most + 1):
        for combo in itertools.combinations(items, k):
            out["+".join(map(str, combo))] = combo
    return out


class OneShotCell(nn.Module):
    """Every choice block with every input and every op: (s0, s1) -> (B, N*C, H, W)."""

    def __init__(self, c_pp: int, c_p: int, channels: int, num_blocks: int):
        super().__init__()
        self.num_blocks = num_blocks
        self.pre0 = ReLUConvBN(c_pp, channels)
        self.pre1 = ReLUConvBN(c_p, channels)
        for b in range(num_blocks):
            setattr(self, f"in{b}", ops.Sum())
            for name in OP_NAMES:
                setattr(self, f"b{b}_{name}", make_op(name, channels))
            setattr(self, f"b{b}", ops.Sum())
        # path dropout (PathDropout sets it on its own copy; None when traced): choice point
        # -> (B, k) weights of its paths, "in{b}" over the b + 2 states, "ops{b}" over OP_NAMES
        self.masks: dict | None = None

    def forward(self, s0, s1):
        states = [self.pre0(s0), self.pre1(s1)]
        for b in range(self.num_blocks):
            if self.masks is not None:
                x = getattr(self, f"in{b}")(*_kept(self.masks[f"in{b}"],
                                                    [(lambda s=s: s) for s in states]))
                states.append(getattr(self, f"b{b}")(*_kept(self.masks[f"ops{b}"], [
                    functools.partial(getattr(self, f"b{b}_{name}"), x) for name in OP_NAMES])))
                continue
            x = getattr(self, f"in{b}")(*states)
            states.append(getattr(self, f"b{b}")(*(getattr(self, f"b{b}_{name}")(x)
                                                   for name in OP_NAMES)))
        return torch.cat(states[2:], dim=1)  # (B, C, H, W) x N -> (B, N*C, H, W)


def _kept(mask: torch.Tensor, paths: list) -> list[torch.Tensor]:
    """Each path (a thunk giving (B, C, H, W)) times its column of ``mask`` (B, k); a path no
    example keeps is not computed, so its weights take no part in the batch."""
    return [path() * mask[:, j].view(-1, 1, 1, 1) for j, path in enumerate(paths)
            if bool(mask[:, j].any())]


class OneShotNet(nn.Module):
    """Stem, 3 stacks of ``cells_per_stack`` cells with 2x2 max pooling between, classifier."""

    def __init__(self, channels: int, cells_per_stack: int, num_blocks: int, in_channels: int,
                 num_classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels))
        self.cells = nn.ModuleList()
        self.pools = nn.ModuleList(nn.MaxPool2d(2, 2) for _ in range(2))
        self.cells_per_stack = cells_per_stack
        c_pp = c_p = channels
        for i in range(3 * cells_per_stack):
            if i > 0 and i % cells_per_stack == 0:
                c_pp = c_p  # both inputs of a stack's first cell are the pooled s1
            self.cells.append(OneShotCell(c_pp, c_p, channels, num_blocks))
            c_pp, c_p = c_p, num_blocks * channels
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_p, num_classes)

    def forward(self, x):
        s0 = s1 = self.stem(x)
        for i, cell in enumerate(self.cells):
            if i > 0 and i % self.cells_per_stack == 0:  # a new stack: both inputs pooled
                s0 = s1 = self.pools[i // self.cells_per_stack - 1](s1)
            s0, s1 = s1, cell(s0, s1)
        return self.fc(self.pool(s1).flatten(1))

    def choice_points(self) -> list[tuple[str, int]]:
        """``(name, k)`` of every choice point of the one-shot model: ``cells.{i}.in{b}`` (a
        block's k = b + 2 candidate inputs) and ``cells.{i}.ops{b}`` (its 7 ops)."""
        return [(f"cells.{i}.{kind}{b}", b + 2 if kind == "in" else len(OP_NAMES))
                for i in range(len(self.cells)) for b in range(self.cells[i].num_blocks)
                for kind in ("in", "ops")]

    def set_masks(self, masks: dict | None) -> None:
        """Weights ``{choice point: (B, k)}`` of the paths (None: every path, unweighted)."""
        for i, cell in enumerate(self.cells):
            cell.masks = None if masks is None else {
                key: masks[f"cells.{i}.{key}"] for key in
                (f"{kind}{b}" for b in range(cell.num_blocks) for kind in ("in", "ops"))}

    def paths_of(self, sample: dict) -> dict[str, list[int]]:
        """The paths architecture ``sample`` keeps at each choice point (every cell alike)."""
        out = {}
        for name, _ in self.choice_points():
            b = int(name.rsplit(".", 1)[1].lstrip("inops"))
            if ".in" in name:
                out[name] = [int(v) for v in str(sample[f"block{b}/inputs"]).split("+")]
            else:
                out[name] = [OP_NAMES.index(v) for v in str(sample[f"block{b}/ops"]).split("+")]
        return out


class ChoiceBlockMutator(rt.Mutator):
    """Keeps each block's chosen inputs and ops in every cell (one architecture)."""

    def __init__(self, num_cells: int, num_blocks: int):
        super().__init__("oneshot")
        self.num_cells, self.num_blocks = num_cells, num_blocks

    def mutate(self, targets):
        for b in range(self.num_blocks):
            inputs = self.choose(subsets(list(range(b + 2))), label=f"block{b}/inputs")
            chosen_ops = self.choose(subsets(list(OP_NAMES)), label=f"block{b}/ops")
            for i in range(self.num_cells):
                cell = f"cells.{i}"
                states = [f"{cell}.pre0", f"{cell}.pre1"] + [f"{cell}.b{m}" for m in range(b)]
                for k, state in enumerate(states):
                    if k not in inputs:
                        self.disconnect(state, f"{cell}.in{b}")
                for name in OP_NAMES:
                    if name not in chosen_ops:
                        self.disconnect(f"{cell}.b{b}_{name}", f"{cell}.b{b}")
                        self.delete_node(f"{cell}.b{b}_{name}")


def oneshot_space(channels: int, cells_per_stack: int, num_blocks: int = BLOCKS,
                  in_channels: int = 3, num_classes: int = 10,
                  image_size: int = 32) -> rt.ModelSpace:
    """The one-shot cell space; see the module docstring."""
    net = OneShotNet(channels, cells_per_stack, num_blocks, in_channels, num_classes)
    space = rt.ModelSpace(net, [ChoiceBlockMutator(3 * cells_per_stack, num_blocks)],
                          example_input=torch.zeros(1, in_channels, image_size, image_size))
    # the one-shot model PathDropout trains (a fresh one: its weights are the strategy's)
    space.macro = {"kind": "path_dropout", "build": functools.partial(
        OneShotNet, channels, cells_per_stack, num_blocks, in_channels, num_classes)}
    return space


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8) -> rt.ModelSpace:
    """3 stacks of one cell, C = 8."""
    return oneshot_space(8, 1, BLOCKS, in_channels, num_classes, image_size)


def paper(in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> rt.ModelSpace:
    """3 stacks of 3 cells, C = 32."""
    return oneshot_space(32, 3, BLOCKS, in_channels, num_classes, image_size)
