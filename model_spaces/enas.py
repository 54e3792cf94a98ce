"""The ENAS convolutional spaces (Pham et al., "Efficient Neural Architecture Search via Parameter
Sharing", ICML 2018): the micro (cell) space and the macro (whole network) space.

**Micro** (:func:`micro_space`, the ``enas_cnn`` row). A cell reads the two previous cells'
outputs (``s0``, ``s1``) and has 5 nodes (the paper's B = 7 counts the two inputs); node k
picks two inputs among ``s0``, ``s1`` and nodes 0 .. k-1 (independently: one input may be
taken twice) and one op for each, and sums them. 5 ops: identity, sep conv 3x3 and 5x5, avg
and max pool 3x3. Normal cells share one architecture and reduction cells another; in a
reduction cell an op reading ``s0`` or ``s1`` has stride 2, as in DARTS (whose op modules
this file reuses). The cell concatenates its *loose ends* (the nodes no other node reads),
as in ENAS, so its width depends on the sample: the next cells' 1x1 preprocessing and the
classifier are lazy (``nn.LazyConv2d``, ``nn.LazyLinear``), sized by the shape check.

Size (micro): ``prod_k (k + 2) ** 2 * 5 ** 2`` per cell = 720 ** 2 * 5 ** 10 =
5,062,500,000,000 (ordered pairs of inputs and of ops), squared for the two cells (about
2.6e25). The paper counts ``(5 x (B - 2)!) ** 4`` = 1.3e11 for both cells with its own
convention.

**Macro** (:func:`macro_space`). L layers in sequence (with 2x2 average pooling after
layers L/3 and 2L/3); layer l applies one of 6 ops (conv 3x3 and 5x5, sep conv 3x3 and 5x5,
max and avg pool 3x3) to layer l - 1 and adds the outputs of any chosen earlier layers
0 .. l-2 (layer 0 the stem; pooled to the resolution where needed). NOTE: ENAS concatenates
the skip inputs and projects them; a sum keeps the width fixed. Size: ``6 ** L * 2 **
(L (L - 1) / 2)``; the paper's L = 12 gives 6 ** 12 * 2 ** 66 = 1.6e29, the number it states.

Presets: micro :func:`paper` is the usual CIFAR-10 evaluation network (20 cells of C = 36,
as in DARTS' evaluation), :func:`small` 3 cells of C = 8; macro :func:`macro_paper` has the
paper's 12 layers at width 64 (CIFAR-10 shapes), :func:`macro_small` 6 layers of width 8.

Example::

    >>> small().size() == 5_062_500_000_000 ** 2
    True
    >>> macro_paper().size() == 6 ** 12 * 2 ** 66
    True
"""
from __future__ import annotations

import torch
from torch import nn

import retiarii as rt
from retiarii import ops
from model_spaces.darts import SepConv, make_op as darts_op
from model_spaces.nasbench101 import ConvBNReLU

MICRO_OPS = ("identity", "sep_conv_3x3", "sep_conv_5x5", "avg_pool_3x3", "max_pool_3x3")
MACRO_OPS = ("conv_3x3", "conv_5x5", "sep_conv_3x3", "sep_conv_5x5", "max_pool_3x3",
             "avg_pool_3x3")
NODES = 5
MICRO_SIZE = 5_062_500_000_000 ** 2
PUBLISHED_MACRO_SIZE = 6 ** 12 * 2 ** 66


# ---- micro ----------------------------------------------------------------------------------


def micro_op(name: str, channels: int, stride: int) -> nn.Module:
    """(B, C, H, W) -> (B, C, H/stride, W/stride)."""
    return darts_op("skip_connect" if name == "identity" else name, channels, stride)


def preprocess(c: int, stride: int) -> nn.Module:
    """ReLU, lazy 1x1 conv (its input width is the previous cell's loose ends), BN; traced
    through, so its output node is ``"{name}.2"``."""
    return nn.Sequential(nn.ReLU(), nn.LazyConv2d(c, 1, stride=stride, bias=False),
                         nn.BatchNorm2d(c))


class MicroCell(nn.Module):
    """A cell whose node k = sep_conv_3x3(s0) + sep_conv_3x3(s1) (the base; the mutator
    edits it): (s0, s1) -> (B, 5C, H', W') (every node a loose end)."""

    def __init__(self, c: int, reduction: bool, reduction_prev: bool):
        super().__init__()
        self.pre0 = preprocess(c, 2 if reduction_prev else 1)
        self.pre1 = preprocess(c, 1)
        stride = 2 if reduction else 1
        for k in range(NODES):
            setattr(self, f"n{k}_a", micro_op("sep_conv_3x3", c, stride))
            setattr(self, f"n{k}_b", micro_op("sep_conv_3x3", c, stride))
            setattr(self, f"n{k}", ops.Sum())
        self.out = ops.Concat()

    def forward(self, s0, s1):
        s0, s1 = self.pre0(s0), self.pre1(s1)
        nodes = [getattr(self, f"n{k}")(getattr(self, f"n{k}_a")(s0),
                                        getattr(self, f"n{k}_b")(s1)) for k in range(NODES)]
        return self.out(*nodes)  # (B, C, H', W') x loose ends -> (B, ends * C, H', W')


class MicroNet(nn.Module):
    """Stem, ``num_cells`` cells (reductions at 1/3 and 2/3 of the depth), classifier."""

    def __init__(self, channels: int, num_cells: int, in_channels: int, num_classes: int,
                 stem_multiplier: int = 3):
        super().__init__()
        c_stem = stem_multiplier * channels
        self.stem = nn.Sequential(nn.Conv2d(in_channels, c_stem, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(c_stem))
        c = channels
        self.reductions = [i for i in range(num_cells)
                           if num_cells >= 3 and i in (num_cells // 3, 2 * num_cells // 3)]
        self.widths = []
        self.cells = nn.ModuleList()
        reduction_prev = False
        for i in range(num_cells):
            reduction = i in self.reductions
            c = 2 * c if reduction else c
            self.cells.append(MicroCell(c, reduction, reduction_prev))
            self.widths.append(c)
            reduction_prev = reduction
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.LazyLinear(num_classes)

    def forward(self, x):
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1)
        return self.fc(self.pool(s1).flatten(1))


class MicroCellMutator(rt.Mutator):
    """One architecture for the given cells: ``"{label}/n{k}/input_a"`` (0, 1: s0, s1; 2 + m:
    node m), ``"{label}/n{k}/input_b"``, ``"{label}/n{k}/op_a"``, ``"{label}/n{k}/op_b"``."""

    def __init__(self, cells: list[str], widths: list[int], reduction: bool, label: str):
        super().__init__(label)
        self.cells, self.widths, self.reduction = cells, widths, reduction

    def mutate(self, targets):
        genotype = []
        for k in range(NODES):
            for side in "ab":
                src = self.choose(list(range(k + 2)), f"{self.label}/n{k}/input_{side}")
                op = self.choose(list(MICRO_OPS), f"{self.label}/n{k}/op_{side}")
                genotype.append((k, side, src, op))
        read = {src - 2 for _, _, src, _ in genotype if src >= 2}
        for cell, c in zip(self.cells, self.widths):
            for m in sorted(read):  # not a loose end: out of the concatenation
                self.disconnect(f"{cell}.n{m}", f"{cell}.out")
            states = [f"{cell}.pre0.2", f"{cell}.pre1.2"] + [f"{cell}.n{m}" for m in
                                                               range(NODES)]
            for k, side, src, op in genotype:
                if (src, op) == ("ab".index(side), "sep_conv_3x3"):
                    continue  # the base's own edge
                stride = 2 if self.reduction and src < 2 else 1
                node = f"{cell}.n{k}_{side}"
                self.replace(node, micro_op(op, c, stride))
                self.connect(states[src], node, port=0)


def micro_space(channels: int, num_cells: int, in_channels: int = 3, num_classes: int = 10,
                image_size: int = 32, stem_multiplier: int = 3) -> rt.ModelSpace:
    """The ENAS micro space; see the module docstring."""
    net = MicroNet(channels, num_cells, in_channels, num_classes, stem_multiplier)
    mutators = []
    for reduction, label in ((False, "normal"), (True, "reduce")):
        idx = [i for i in range(num_cells) if (i in net.reductions) == reduction]
        if idx:
            mutators.append(MicroCellMutator([f"cells.{i}" for i in idx],
                                             [net.widths[i] for i in idx], reduction, label))
    return rt.ModelSpace(net, mutators,
                         example_input=torch.zeros(1, in_channels, image_size, image_size))


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8) -> rt.ModelSpace:
    """C=8, 3 cells (normal, reduction, normal), stem of 16 channels."""
    return micro_space(8, 3, in_channels, num_classes, image_size, stem_multiplier=2)


def paper(in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> rt.ModelSpace:
    """20 cells of C=36 (CIFAR-10 shapes)."""
    return micro_space(36, 20, in_channels, num_classes, image_size)


# ---- macro ----------------------------------------------------------------------------------


def macro_op(name: str, channels: int) -> nn.Module:
    """(B, C, H, W) -> same."""
    if name.startswith("conv_"):
        return ConvBNReLU(channels, channels, int(name[-1]))
    if name.startswith("sep_conv_"):
        return SepConv(channels, int(name[-1]), 1)
    if name == "max_pool_3x3":
        return nn.MaxPool2d(3, 1, 1)
    if name == "avg_pool_3x3":
        return nn.AvgPool2d(3, 1, 1, count_include_pad=False)
    raise ValueError(f"unknown op {name!r}; expected one of {MACRO_OPS}")


class MacroNet(nn.Module):
    """Stem (layer 0), ``num_layers`` layers each summing its op and every skip, pooling after
    layers L/3 and 2L/3, classifier. ``skip{j}_{l}`` pools layer j to layer l's resolution."""

    def __init__(self, channels: int, num_layers: int, in_channels: int, num_classes: int):
        super().__init__()
        self.num_layers = num_layers
        self.reduce_after = sorted({num_layers // 3, 2 * num_layers // 3} - {0, num_layers})
        self.stem = ConvBNReLU(in_channels, channels, 3)
        for layer in range(1, num_layers + 1):
            setattr(self, f"op{layer}", macro_op("conv_3x3", channels))
            setattr(self, f"sum{layer}", ops.Sum())
            if layer in self.reduce_after:
                setattr(self, f"pool{layer}", nn.AvgPool2d(2, 2))
            for j in range(layer - 1):
                factor = self.factor(j, layer)
                if factor > 1:
                    setattr(self, f"skip{j}_{layer}", nn.AvgPool2d(factor, factor))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def factor(self, j: int, layer: int) -> int:
        """How much smaller layer ``layer``'s input is than layer ``j``'s output."""
        return 2 ** sum(1 for r in self.reduce_after if j <= r < layer)

    def forward(self, x):
        outs = [self.stem(x)]  # each layer's output before any pooling after it
        h = outs[0]
        for layer in range(1, self.num_layers + 1):
            skips = [getattr(self, f"skip{j}_{layer}")(outs[j]) if self.factor(j, layer) > 1
                     else outs[j] for j in range(layer - 1)]
            out = getattr(self, f"sum{layer}")(getattr(self, f"op{layer}")(h), *skips)
            outs.append(out)
            h = getattr(self, f"pool{layer}")(out) if layer in self.reduce_after else out
        return self.fc(self.pool(h).flatten(1))


class MacroMutator(rt.Mutator):
    """Each layer's op (``"layer{l}/op"``) and skips (``"layer{l}/skip{j}"`` in [0, 1])."""

    def __init__(self, net: MacroNet):
        super().__init__("macro")
        self.factors = {(j, k): net.factor(j, k) for k in range(1, net.num_layers + 1)
                        for j in range(k - 1)}
        self.num_layers, self.channels = net.num_layers, net.fc.in_features

    def mutate(self, targets):
        for layer in range(1, self.num_layers + 1):
            op = self.choose(list(MACRO_OPS), label=f"layer{layer}/op")
            if op != "conv_3x3":
                self.replace(f"op{layer}", macro_op(op, self.channels))
            for j in range(layer - 1):
                if self.choose([0, 1], label=f"layer{layer}/skip{j}"):
                    continue
                pooled = self.factors[j, layer] > 1
                src = f"skip{j}_{layer}" if pooled else "stem" if j == 0 else f"sum{j}"
                self.disconnect(src, f"sum{layer}")
                if pooled:
                    self.delete_node(src)


def macro_space(channels: int, num_layers: int, in_channels: int = 3, num_classes: int = 10,
                image_size: int = 32) -> rt.ModelSpace:
    """The ENAS macro space; see the module docstring."""
    net = MacroNet(channels, num_layers, in_channels, num_classes)
    return rt.ModelSpace(net, [MacroMutator(net)],
                         example_input=torch.zeros(1, in_channels, image_size, image_size))


def macro_small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8):
    """6 layers of width 8 (pooling after layers 2 and 4)."""
    return macro_space(8, 6, in_channels, num_classes, image_size)


def macro_paper(in_channels: int = 3, num_classes: int = 10, image_size: int = 32):
    """The paper's 12 layers (pooling after layers 4 and 8), width 64."""
    return macro_space(64, 12, in_channels, num_classes, image_size)
