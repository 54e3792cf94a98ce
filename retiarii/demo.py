"""The built-in demo: a small CNN space on the digits data set bundled with scikit-learn.

``retiarii run demo`` searches it. It shows the three ways to write a space in one place: a
plain PyTorch base model, inline choices inside it (a LayerChoice per cell, a ValueChoice
width, a Repeat depth) and a graph mutator (an optional skip connection), plus a trainer
hyper-parameter (the learning rate) explored like any other choice.

Example::

    >>> from retiarii.demo import space
    >>> space.size()             # 2 widths x (4 + 16 + 64) cell programs x skip x 3 lrs
    1008
    >>> net = space.build(space.random_sample(0).sample)   # an nn.Module for 1x8x8 digits
"""
from __future__ import annotations

import torch
from torch import nn

import retiarii as rt


class SepConv(nn.Module):
    """Depthwise-separable 3x3 convolution: (B, C, H, W) -> (B, C, H, W)."""

    def __init__(self, channels: int):
        super().__init__()
        self.depthwise = rt.nn.Conv2d(channels, channels, 3, padding=1, groups=channels,
                                      bias=False)
        self.pointwise = rt.nn.Conv2d(channels, channels, 1, bias=False)

    def forward(self, x):
        return self.pointwise(self.depthwise(x))


class Cell(nn.Module):
    """op -> batch norm -> ReLU, keeping (B, C, H, W)."""

    def __init__(self, channels):
        super().__init__()
        self.op = rt.LayerChoice({
            "conv3x3": rt.nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            "conv5x5": rt.nn.Conv2d(channels, channels, 5, padding=2, bias=False),
            "sepconv": SepConv(channels),
            "maxpool": nn.MaxPool2d(3, stride=1, padding=1),
        })
        self.bn = rt.nn.BatchNorm2d(channels)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.bn(self.op(x)))


class DigitsNet(nn.Module):
    """stem -> 1..3 cells -> pool -> classifier, on (B, 1, 8, 8) digits."""

    def __init__(self, width=rt.ValueChoice([16, 32], label="width")):
        super().__init__()
        self.stem = rt.nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.stem_bn = rt.nn.BatchNorm2d(width)
        self.stem_act = nn.ReLU()
        self.cells = rt.Repeat(lambda i: Cell(width), depth=(1, 3), label="depth")
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.classifier = rt.nn.Linear(width, 10)

    def forward(self, x):
        x = self.stem_act(self.stem_bn(self.stem(x)))
        x = self.cells(x)
        return self.classifier(self.flatten(self.pool(x)))


class SkipMutator(rt.Mutator):
    """Optionally adds the stem's output to the cells' output (a residual connection).

    Before: stem_act -> cells... -> pool.   After ("yes"): pool reads stem_act + last cell.
    """

    def mutate(self, targets):
        (pool,) = targets
        if self.choose(["no", "yes"], label="skip") == "yes":
            last = pool.inputs[0]
            merge = self.create_node("skip_add", rt.ops.Sum())
            self.connect(last, merge)
            self.connect(self.graph["stem_act"], merge)
            self.connect(merge, pool, port=0)


def make_space() -> rt.ModelSpace:
    """The demo space: 2 widths x (4 + 16 + 64) cell programs x skip x 3 learning rates."""
    return rt.ModelSpace(
        DigitsNet(), [rt.apply_mutator("pool", SkipMutator(label="skip"))],
        example_input=torch.zeros(2, 1, 8, 8),
    ).with_hparams({"lr": rt.ValueChoice([0.003, 0.01, 0.03], label="lr")})


space = make_space()
