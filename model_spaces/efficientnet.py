"""The EfficientNet space (Tan & Le, ICML 2019): EfficientNet-B0's MBConv stages with
searched kernels, expansions, SE and layer counts, and compound scaling of depth, width and
resolution.

EfficientNet-B0 (the paper's Table 1) is a 3x3 stem of 32 channels, 7 stages of MBConv
blocks with squeeze-and-excitation (ratio 0.25) and swish, a 1x1 conv to 1280 channels,
pooling and the classifier::

    stage   1    2    3    4    5    6    7        (per stage: expansion, kernel,
    width   16   24   40   80   112  192  320        layers, first stride)
    layers  1    2    2    3    3    4    1
    kernel  3    3    5    3    5    5    3        stage 1 is MBConv1, the others MBConv6

The paper searched B0 "in the same search space as MnasNet" (its factorized hierarchical
space: per block the conv op, kernel, SE ratio, skip op, filter size and number of layers)
with MnasNet's RL, then scaled it with compound coefficients: depth d = alpha^phi, width
w = beta^phi, resolution r = gamma^phi, found by a grid search at phi = 1 (alpha = 1.2,
beta = 1.1, gamma = 1.15). This space holds both as choices:

- per stage, as MnasNet's space: the depthwise kernel (``stage{s}/kernel``: 3 or 5, B0's
  first), the expansion of stages 2-7 (``stage{s}/expansion``: 6 or 3; stage 1 stays B0's
  MBConv1), squeeze-and-excitation (``stage{s}/se``: ``"se"``, ratio
  0.25, or ``"none"``) and the number of layers (``stage{s}/layers``: B0's n, n - 1 (at least
  1), n + 1; the family's ``searched_layers``);
- ``scaling/depth`` in {100, 120, 140} percent: a stage of m searched layers has
  ceil(d * m) (extra layers after the searched ones, a LayerChoice over d per stage);
- ``scaling/width`` in {100, 110, 120} percent: every width times w, rounded to a multiple
  of 8 (4 in the small preset);
- ``scaling/resolution``: the input resized to {1.0, 1.15, 1.3} times the image size (inside
  the model, so the data pipeline is the same for every model).

The all-defaults model is EfficientNet-B0 (B0's layers, SE everywhere). Not searched, as in
MnasNet's row: the conv op (always MBConv; MBConv1 in stage 1, as B0), the skip op (the
residual whenever shapes allow) and the filter sizes (B0's). The paper's grid search keeps
alpha * beta^2 * gamma^2 ~ 2 (twice B0's FLOPS); this space holds the whole 3 x 3 x 3 grid,
and a search that wants the constraint filters or penalises by FLOPS (``CompoundScaling``).
Widths round to the nearest multiple (EfficientNet also never rounds down by more than 10%).

Size: per stage kernel x expansion (4, stage 1: 2) x SE (2) x layers (3, or 2 for B0's
one-layer stages 1 and 7), times the 27 scaling points: 8 * 24 ** 5 * 16 * 27 =
27,518,828,544 models in both presets.

Presets: :func:`paper` is B0's skeleton for 224x224 ImageNet (the scaled models up to
d=1.4, w=1.2, r=291); :func:`small` divides widths by 4 (4 ... 80, head 64) with stride 2 in
stages 2 and 4 for the 8x8 digits (resolutions 8, 9, 10).

Example::

    >>> small().size()
    27518828544
"""
from __future__ import annotations

import torch
from torch import nn

import retiarii as rt
from model_spaces._mobile import (MBConv, MobileNet, layer_counts, scale_width,
                                  searched_layers)

# EfficientNet-B0, Table 1: (expansion, kernel, out channels, layers, first stride)
B0_STAGES = ((1, 3, 16, 1, 1), (6, 3, 24, 2, 2), (6, 5, 40, 2, 2), (6, 3, 80, 3, 2),
             (6, 5, 112, 3, 1), (6, 5, 192, 4, 2), (6, 3, 320, 1, 1))
DEPTHS = (100, 120, 140)  # depth coefficients, in percent (alpha's grid at phi = 1)
WIDTHS = (100, 110, 120)  # width coefficients, in percent (beta's grid)
RESOLUTIONS = (1.0, 1.15, 1.3)  # resolution coefficients (gamma's grid)


def layers_at(n: int, depth: int) -> int:
    """ceil(n * depth / 100): a stage of ``n`` (searched) layers at depth coefficient ``depth``
    percent."""
    return -(-n * depth // 100)


def size(stages=B0_STAGES) -> int:
    """The number of models: per stage kernel x expansion (where searched), SE and layer
    counts, times the scaling grid."""
    total = len(DEPTHS) * len(WIDTHS) * len(RESOLUTIONS)
    for e, _, _, n, _ in stages:
        total *= (4 if e != 1 else 2) * 2 * len(layer_counts(n))
    return total


class EfficientNet(MobileNet):
    """B0's stages with kernel/expansion/SE/layer choices and compound-scaling choices.

    Args:
        stages: (expansion, kernel, out channels, layers, first stride) per stage: B0's, the
            searched layer counts around them.
        stem, head: widths before scaling.
        divisor: scaled widths are multiples of it.
        resolutions: the candidate input sizes.
    """

    def __init__(self, stages=B0_STAGES, stem: int = 32, head: int = 1280,
                 stem_stride: int = 2, divisor: int = 8, resolutions=(224, 258, 291),
                 in_channels: int = 3, num_classes: int = 1000):
        width = rt.ValueChoice(list(WIDTHS), label="scaling/width")
        layers, c_in = [], scale_width(stem, width, divisor)
        stem_c = c_in
        for s, (e, k, c, n, stride) in enumerate(stages, 1):
            c_out = scale_width(c, width, divisor)  # one expression per stage: residuals
            k = rt.ValueChoice(sorted({k, 3, 5}, key=lambda v: v != k), label=f"stage{s}/kernel")
            if e != 1:  # stage 1 stays B0's MBConv1 (no expansion conv)
                e = rt.ValueChoice([6, 3], label=f"stage{s}/expansion")

            def block(i, c_in=c_in, c_out=c_out, stride=stride, k=k, e=e, s=s):
                return MBConv(c_in if i == 0 else c_out, c_out, stride if i == 0 else 1, k, e,
                              se=f"stage{s}/se", se_first=True, act=nn.SiLU)

            # MnasNet's searched layer count m, then ceil(d * m) at depth coefficient d
            layers += searched_layers(block, n, f"stage{s}/layers", base_first=True,
                                      depth=("scaling/depth", DEPTHS))
            c_in = c_out
        super().__init__(layers, stem_c, c_in, scale_width(head, width, divisor),
                         stem_stride, in_channels, num_classes, act=nn.SiLU,
                         resolution=rt.ValueChoice(list(resolutions),
                                                   label="scaling/resolution"))


def efficientnet_space(stages=B0_STAGES, stem: int = 32, head: int = 1280,
                       stem_stride: int = 2, divisor: int = 8, in_channels: int = 3,
                       num_classes: int = 1000, image_size: int = 224) -> rt.ModelSpace:
    """The EfficientNet space around :class:`EfficientNet`; see the module docstring."""
    resolutions = [round(image_size * g) for g in RESOLUTIONS]
    net = EfficientNet(stages, stem, head, stem_stride, divisor, resolutions, in_channels,
                       num_classes)
    return rt.ModelSpace(net, example_input=torch.zeros(1, in_channels, image_size,
                                                        image_size))


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8) -> rt.ModelSpace:
    """B0's stages with widths / 4 (stem 8, head 64), strides 2 only in stages 2 and 4."""
    stages = tuple((e, k, max(4, c // 4), n, 2 if s in (2, 4) else 1)
                   for s, (e, k, c, n, _) in enumerate(B0_STAGES, 1))
    return efficientnet_space(stages, 8, 64, 1, 4, in_channels, num_classes, image_size)


def paper(in_channels: int = 3, num_classes: int = 1000, image_size: int = 224
          ) -> rt.ModelSpace:
    """EfficientNet-B0's skeleton for ImageNet (the default sample is B0)."""
    return efficientnet_space(B0_STAGES, 32, 1280, 2, 8, in_channels, num_classes,
                              image_size)
