"""The ChamNet space (Dai et al., CVPR 2019): MobileNetV2 adapted stage by stage.

ChamNet ("Chameleon") adapts a MobileNetV2 to a platform: it searches each stage's width,
depth and expansion ratio and the input resolution, guided by an accuracy predictor (a
Gaussian process) and latency/energy predictors, with a genetic search over candidates. The
base is MobileNetV2 1.0 (Sandler et al., CVPR 2018): a 3x3 stem of 32 channels, 7 stages, a
1x1 conv to 1280 channels, pooling and the classifier::

    stage      1    2    3    4    5    6    7
    width      16   24   32   64   96   160  320     (expansion 1 in stage 1, 6 elsewhere;
    layers     1    2    3    4    3    3    1       first stride 1, 2, 2, 2, 1, 2, 1)

Choices, per stage s (labels ``stage{s}/...``): ``width`` in {100, 75, 125} percent of the
base width (rounded to a multiple of 4, which keeps the 3 widths of every stage distinct;
to an integer in the small preset), ``depth`` in {n, n - 1, n + 1}
layers (at least 1), ``expansion`` in {6, 4, 8} (stage 1 keeps expansion 1); and
``resolution``, the input resized to {1.0, 0.875, 1.125} times the image size inside the
model. The first value of each is MobileNetV2's but depths are ordered (the all-defaults
model has the shallower stages); :func:`mobilenet_v2` is the sample of MobileNetV2 1.0
itself. The paper searches ranges of these hyper-parameters; the grids here are ours.

Size: stage 1: 3 widths x 2 depths; stages 2-6: 3 x 3 x 3; stage 7: 3 x 2 x 3; times 3
resolutions: 6 * 27 ** 5 * 18 * 3 = 4,649,045,868 models in both presets (see :func:`size`).

``retiarii nas run chamnet`` searches it as the paper does (``retiarii.strategies.ChamNet``):
a Gaussian process predicts accuracy, a latency lookup table latency, and a genetic search
proposes the best-predicted model under a latency constraint.

Presets: :func:`paper` is MobileNetV2 1.0's skeleton for 224x224 ImageNet; :func:`small`
divides widths by 4 (4 ... 80, stem 8, head 64), strides 2 only in stages 2 and 4, for the
8x8 digits.

Example::

    >>> small().size() == size()
    True
"""
from __future__ import annotations

import torch

import retiarii as rt
from model_spaces._mobile import MOBILENETV2_STAGES, MBConv, MobileNet, scale_width

WIDTHS = (100, 75, 125)  # percent of the base width
EXPANSIONS = (6, 4, 8)
RESOLUTIONS = (1.0, 0.875, 1.125)


def depths(n: int) -> list[int]:
    """A stage's candidate depths: n - 1 (if at least 1), n (MobileNetV2's), n + 1."""
    return ([n - 1] if n > 1 else []) + [n, n + 1]


def mobilenet_v2(space: rt.ModelSpace, stages=MOBILENETV2_STAGES) -> dict:
    """The sample of ``space`` that is MobileNetV2 itself (its widths, depths, expansions
    and the image size)."""
    sample = space.default_sample()
    sample.update({f"stage{s}/depth": n for s, (_, _, n, _) in enumerate(stages, 1)})
    return sample


def size(stages=MOBILENETV2_STAGES) -> int:
    """The number of models (see the module docstring)."""
    total = len(RESOLUTIONS)
    for e, _, n, _ in stages:
        total *= len(WIDTHS) * len(depths(n)) * (len(EXPANSIONS) if e != 1 else 1)
    return total


class ChamNet(MobileNet):
    """MobileNetV2 with per-stage width, depth and expansion choices and a resolution choice.

    Args:
        stages: (expansion, out channels, layers, first stride) per stage.
        divisor: the chosen widths are multiples of it.
        resolutions: the candidate input sizes.
    """

    def __init__(self, stages=MOBILENETV2_STAGES, stem: int = 32, head: int = 1280,
                 stem_stride: int = 2, divisor: int = 4, resolutions=(224, 196, 252),
                 in_channels: int = 3, num_classes: int = 1000):
        layers, c_in = [], stem
        for s, (e, c, n, stride) in enumerate(stages, 1):
            width = rt.ValueChoice(list(WIDTHS), label=f"stage{s}/width")
            c_out = scale_width(c, width, divisor)  # one expression per stage: residuals
            if e != 1:
                e = rt.ValueChoice(list(EXPANSIONS), label=f"stage{s}/expansion")

            def layer(i, c_in=c_in, c_out=c_out, stride=stride, e=e):
                return MBConv(c_in if i == 0 else c_out, c_out, stride if i == 0 else 1, 3, e)

            layers.append(rt.Repeat(layer, depth=depths(n), label=f"stage{s}/depth"))
            c_in = c_out
        super().__init__(layers, stem, c_in, head, stem_stride, in_channels, num_classes,
                         resolution=rt.ValueChoice(list(resolutions), label="resolution"))


def chamnet_space(stages=MOBILENETV2_STAGES, stem: int = 32, head: int = 1280,
                  stem_stride: int = 2, divisor: int = 4, in_channels: int = 3,
                  num_classes: int = 1000, image_size: int = 224) -> rt.ModelSpace:
    """The ChamNet space around :class:`ChamNet`; see the module docstring."""
    resolutions = [round(image_size * r) for r in RESOLUTIONS]
    net = ChamNet(stages, stem, head, stem_stride, divisor, resolutions, in_channels,
                  num_classes)
    return rt.ModelSpace(net, example_input=torch.zeros(1, in_channels, image_size,
                                                        image_size))


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8) -> rt.ModelSpace:
    """MobileNetV2's stages with widths / 4, strides 2 only in stages 2 and 4."""
    stages = tuple((e, max(4, c // 4), n, 2 if s in (2, 4) else 1)
                   for s, (e, c, n, _) in enumerate(MOBILENETV2_STAGES, 1))
    return chamnet_space(stages, 8, 64, 1, 1, in_channels, num_classes, image_size)


def paper(in_channels: int = 3, num_classes: int = 1000, image_size: int = 224
          ) -> rt.ModelSpace:
    """MobileNetV2 1.0's skeleton for ImageNet (the default sample is MobileNetV2)."""
    return chamnet_space(MOBILENETV2_STAGES, 32, 1280, 2, 4, in_channels, num_classes,
                         image_size)
