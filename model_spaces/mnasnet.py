"""The MnasNet space (Tan et al., CVPR 2019): a factorized hierarchical space of MBConv blocks.

The network is a stem, 7 blocks of MobileNetV2 inverted-residual layers and a head. Each
block makes its own choices, shared by all its layers (the paper's factorization): the depthwise
kernel (3 or 5), the expansion ratio (3 or 6), squeeze-and-excitation (none or ratio 0.25) and
the number of layers (the MobileNetV2 count -1, +0, +1, at least 1)::

    stem ─▶ block 1 ─▶ ... ─▶ block 7 ─▶ 1x1 conv ─▶ pool ─▶ classifier
            └ layers x (1x1 expand ─▶ k x k depthwise ─▶ [SE] ─▶ 1x1 project [+ x])

The block is the family's shared MBConv (``model_spaces/_mobile.py``, ReLU here); its SE
squeezes to a quarter of the block's input channels. The layer count is ``searched_layers``
there, which EfficientNet's baseline search shares.

Size convention: 2 * 2 * 2 = 8 per block times its depths (3, or 2 for a block of one base
layer, which cannot go below 1): the small preset (two base layers per block) has
24 ** 7 = 4,586,471,424 models, the paper preset (MnasNet-A1's depths 1, 2, 3, 4, 2, 3, 1)
24 ** 5 * 16 ** 2 = 2,038,431,744. The
paper's per-block sub-space is larger (it also searches the conv type, the skip op and the
filter size: S = 432 in its example, "about 10^13" for 5 blocks against 10^39 unfactorized);
here the conv is always MBConv, the skip is the residual whenever shapes allow (as in
MobileNetV2) and the filter sizes are MnasNet-A1's.

Presets: :func:`paper` has MnasNet-A1's widths (32 stem, 16 ... 320, 1280 head) and strides
for 224x224 ImageNet; :func:`small` divides widths by 4, has two base layers per block and
strides 2 only twice, for the 8x8 digits.

Example::

    >>> space = small()
    >>> space.size()
    4586471424
"""
from __future__ import annotations

import torch
from torch import nn

import retiarii as rt
from model_spaces._mobile import MBConv, searched_layers

# MnasNet-A1's blocks: (out channels, MobileNetV2 layers, first stride)
PAPER_BLOCKS = ((16, 1, 1), (24, 2, 2), (40, 3, 2), (80, 4, 2), (112, 2, 1), (160, 3, 2),
                (320, 1, 1))


class MnasNet(nn.Module):
    """Stem (3x3 conv, stride 2), the 7 searched blocks, a 1x1 head conv, pooling, classifier.

    Args:
        blocks: (out channels, base layers, first stride) per block.
        stem, head: widths of the stem and of the head conv.
        stem_stride: 2 for ImageNet; 1 for tiny images.
    """

    def __init__(self, blocks=PAPER_BLOCKS, stem: int = 32, head: int = 1280,
                 stem_stride: int = 2, in_channels: int = 3, num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, stem, 3, stem_stride, 1, bias=False),
                                  nn.BatchNorm2d(stem), nn.ReLU())
        layers, c_in = [], stem
        for b, (c_out, n, stride) in enumerate(blocks, 1):
            kernel = rt.ValueChoice([3, 5], label=f"b{b}/kernel")
            expansion = rt.ValueChoice([3, 6], label=f"b{b}/expansion")

            def layer(i, c_in=c_in, c_out=c_out, stride=stride, kernel=kernel,
                      expansion=expansion, b=b):
                return MBConv(c_in if i == 0 else c_out, c_out, stride if i == 0 else 1,
                              kernel, expansion, se=f"b{b}/se", act=nn.ReLU)

            layers += searched_layers(layer, n, f"b{b}/layers")
            c_in = c_out
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Conv2d(c_in, head, 1, bias=False), nn.BatchNorm2d(head),
                                  nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(head, num_classes)

    def forward(self, x):
        x = self.head(self.blocks(self.stem(x)))
        return self.fc(self.pool(x).flatten(1))  # (B, head, 1, 1) -> (B, num_classes)


def mnasnet_space(blocks=PAPER_BLOCKS, stem: int = 32, head: int = 1280, stem_stride: int = 2,
                  in_channels: int = 3, num_classes: int = 1000,
                  image_size: int = 224) -> rt.ModelSpace:
    """The MnasNet space around :class:`MnasNet`; see the module docstring."""
    net = MnasNet(blocks, stem, head, stem_stride, in_channels, num_classes)
    return rt.ModelSpace(net, example_input=torch.zeros(1, in_channels, image_size,
                                                        image_size))


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8) -> rt.ModelSpace:
    """Widths / 4 (4 ... 80, head 64), two base layers per block (1 to 3), stride 2 in blocks 2
    and 4."""
    blocks = tuple((max(4, c // 4), 2, 2 if b in (1, 3) else 1)
                   for b, (c, _, _) in enumerate(PAPER_BLOCKS))
    return mnasnet_space(blocks, 8, 64, 1, in_channels, num_classes, image_size)


def paper(in_channels: int = 3, num_classes: int = 1000, image_size: int = 224
          ) -> rt.ModelSpace:
    """MnasNet-A1's skeleton (ImageNet shapes by default)."""
    return mnasnet_space(PAPER_BLOCKS, 32, 1280, 2, in_channels, num_classes, image_size)
