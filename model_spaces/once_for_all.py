"""The Once-for-All space (Cai et al., ICLR 2020): elastic depth, kernel and width.

A MobileNetV3-Large skeleton: a 3x3 stem of 16 channels, a fixed first block, 5 searched
units, a 1x1 head conv, pooling and the classifier. Unit u has a depth of 2, 3 or 4 layers;
each of its layers has its own kernel (3, 5 or 7) and expansion ratio (3, 4 or 6)::

    stem ─▶ MBConv(k3, e1) ─▶ unit 1 ─▶ ... ─▶ unit 5 ─▶ 1x1 conv ─▶ pool ─▶ classifier
                              └ depth {2, 3, 4} x MBConv(kernel {3, 5, 7}, expansion {3, 4, 6})

    unit     1     2     3      4      5
    width    24    40    80     112    160      (first stride 2, 2, 2, 1, 2)
    SE       -     yes   -      yes    yes      activation: ReLU in units 1-2, h-swish after

Labels: ``unit{u}/depth`` and ``unit{u}/layer{i}/kernel``, ``.../expansion``; a layer past the
unit's depth is not in the model, and its choices are not in the sample.

Size: ((3 * 3) ** 2 + (3 * 3) ** 3 + (3 * 3) ** 4) ** 5 = 7371 ** 5, about 2.2e19: the
published "~2 x 10^19" sub-networks (input resolution, also elastic in OFA, is not counted
there and not searched here).

OFA trains one super-net whose sub-networks share weights (a kernel transform for small
kernels, the first channels for small expansions, the first layers for small depths) and
then searches it by evolution guided by accuracy and latency predictors. ``retiarii nas run
once_for_all`` runs ``OnceForAll`` (retiarii/strategies/one_shot/once_for_all.py): progressive
shrinking of an elastic network built on ``space.macro`` (the skeleton this builder records),
then an evolution guided by an MLP accuracy predictor under a latency bound.

The head is a single 1x1 conv (MobileNetV3's is a 1x1 conv to 960, pooling, then 1x1 to
1280); the SE blocks squeeze to a quarter of the layer's input channels.

Presets: :func:`paper` has the widths above for 224x224 ImageNet (head 1280); :func:`small`
has 2 units of widths 12 and 16 (stem 8, head 64), each with a first stride of 2, for the
8x8 digits: 7371 ** 2 models (counting them walks every depth combination: 3 ** units).

Example::

    >>> small().size() == size(2) == 7371 ** 2
    True
"""
from __future__ import annotations

import torch
from torch import nn

import retiarii as rt
from model_spaces._mobile import MBConv, MobileNet

# (width, first stride, squeeze-excite, activation) per unit
PAPER_UNITS = ((24, 2, False, nn.ReLU), (40, 2, True, nn.ReLU), (80, 2, False, nn.Hardswish),
               (112, 1, True, nn.Hardswish), (160, 2, True, nn.Hardswish))
SMALL_UNITS = ((12, 2, False, nn.ReLU), (16, 2, True, nn.Hardswish))
DEPTHS = (2, 3, 4)
KERNELS = (3, 5, 7)
EXPANSIONS = (3, 4, 6)


def size(units: int = 5) -> int:
    """The number of models of ``units`` units (the published count for 5)."""
    per_layer = len(KERNELS) * len(EXPANSIONS)
    return sum(per_layer ** d for d in DEPTHS) ** units


def unit(u: int, c_in: int, c_out: int, stride: int, se: bool, act) -> rt.Repeat:
    """Unit ``u``: 2 to 4 layers, each with its own kernel and expansion choices."""

    def layer(i):
        kernel = rt.ValueChoice(list(KERNELS), label=f"unit{u}/layer{i + 1}/kernel")
        expansion = rt.ValueChoice(list(EXPANSIONS), label=f"unit{u}/layer{i + 1}/expansion")
        return MBConv(c_in if i == 0 else c_out, c_out, stride if i == 0 else 1, kernel,
                      expansion, se=se, act=act)

    return rt.Repeat(layer, depth=list(DEPTHS), label=f"unit{u}/depth")


def ofa_space(units=PAPER_UNITS, stem: int = 16, head: int = 1280, stem_stride: int = 2,
              in_channels: int = 3, num_classes: int = 1000,
              image_size: int = 224) -> rt.ModelSpace:
    """The OFA space on ``units``: (width, first stride, SE, activation class) per unit."""
    layers: list[nn.Module] = [MBConv(stem, stem, 1, 3, 1, act=nn.ReLU)]
    c_in = stem
    for u, (c_out, stride, se, act) in enumerate(units, 1):
        layers.append(unit(u, c_in, c_out, stride, se, act))
        c_in = c_out
    net = MobileNet(layers, stem, c_in, head, stem_stride, in_channels, num_classes,
                    act=nn.Hardswish)
    space = rt.ModelSpace(net, example_input=torch.zeros(1, in_channels, image_size,
                                                         image_size))
    # the skeleton OnceForAll builds its elastic network on (retiarii/optim/elastic.py)
    shapes, c = [], stem
    for c_out, stride, se, act in units:
        shapes.append([c, c_out, stride, se, "relu" if act is nn.ReLU else "hardswish"])
        c = c_out
    space.macro = {"kind": "elastic", "in_channels": in_channels, "num_classes": num_classes,
                   "stem": stem, "stem_stride": stem_stride, "first": stem, "last": c_in,
                   "head": head, "units": shapes}
    return space


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8) -> rt.ModelSpace:
    """2 units of widths 12 and 16 (7371 ** 2 models)."""
    return ofa_space(SMALL_UNITS, 8, 64, 1, in_channels, num_classes, image_size)


def paper(in_channels: int = 3, num_classes: int = 1000, image_size: int = 224
          ) -> rt.ModelSpace:
    """OFA's MobileNetV3 skeleton for ImageNet (7371 ** 5 models)."""
    return ofa_space(PAPER_UNITS, 16, 1280, 2, in_channels, num_classes, image_size)
