"""The SPOS space (Guo et al., ECCV 2020, "Single Path One-Shot"): ShuffleNetV2 blocks.

A ShuffleNetV2 skeleton (a 3x3 stem of 16 channels, 20 choice blocks in stages of 4, 4, 8, 4
with widths 64, 160, 320, 640, each stage's first block with stride 2, a 1x1 conv to 1024
channels, pooling, the classifier) where each block picks one of 4 ShuffleNetV2 units::

    stride 1:  x ─▶ split in halves ─┬─────────────── a ──────────────┐
                                     └─ b ─▶ branch ─▶ (C_out - C/2) ─┴▶ concat ─▶ shuffle
    first:     x ─▶ dw k x k (stride s), BN, 1x1, BN, ReLU ───────────┐
               x ─▶ branch (stride s) ─▶ (C_out - C_in) ──────────────┴▶ concat ─▶ shuffle

    branch of choice_k (k = 3, 5, 7): 1x1, BN, ReLU ─▶ dw k x k, BN ─▶ 1x1, BN, ReLU
    branch of choice_x (Xception):    3 x (dw 3x3, BN ─▶ 1x1, BN, ReLU)

with the branch's hidden width ``C_out / 2``, as in SPOS. This is SPOS's building-block
space; its other experiments (channel numbers, mixed-precision quantization) are not here.

Size: 4 ** 20 (about 1.1e12) models, the published count.

SPOS trains a super-net by uniform single-path sampling, then runs an evolutionary search
over it: ``retiarii nas run spos`` runs ``retiarii.strategies.SPOS`` on it.

Presets: :func:`paper` has the widths above for 224x224 ImageNet; :func:`small` keeps the
20 blocks (the same size) with widths 16 ... 48, stem 8 (stride 1), head 64 and stride 2 in
two stages, for the 8x8 digits.

Example::

    >>> small().size() == 4 ** 20
    True
"""
from __future__ import annotations

import torch
from torch import nn

import retiarii as rt
from model_spaces._mobile import ConvBNAct, MobileNet

# (out channels, blocks, first stride) per stage
PAPER_STAGES = ((64, 4, 2), (160, 4, 2), (320, 8, 2), (640, 4, 2))
SMALL_STAGES = ((16, 4, 1), (24, 4, 2), (32, 8, 1), (48, 4, 2))
CHOICES = ("choice_3", "choice_5", "choice_7", "choice_x")
PUBLISHED_SIZE = 4 ** 20


def branch(choice: str, c_in: int, mid: int, c_out: int, stride: int) -> nn.Sequential:
    """The searched branch: (B, c_in, H, W) -> (B, c_out, H/stride, W/stride)."""
    if choice == "choice_x":
        return nn.Sequential(
            ConvBNAct(c_in, c_in, 3, stride, groups=c_in, act=None),
            ConvBNAct(c_in, mid, 1), ConvBNAct(mid, mid, 3, groups=mid, act=None),
            ConvBNAct(mid, mid, 1), ConvBNAct(mid, mid, 3, groups=mid, act=None),
            ConvBNAct(mid, c_out, 1))
    k = int(choice[-1])
    return nn.Sequential(ConvBNAct(c_in, mid, 1), ConvBNAct(mid, mid, k, stride, groups=mid,
                                                            act=None),
                         ConvBNAct(mid, c_out, 1))


class ShuffleUnit(nn.Module):
    """A ShuffleNetV2 unit: (B, C_in, H, W) -> (B, C_out, H/s, W/s).

    A unit that keeps its shape splits its input in halves and runs the branch on one; a
    stage's first unit (stride 2 or a new width) runs the branch and a k x k projection on
    the whole input. The two halves are concatenated and shuffled (2 groups).
    """

    def __init__(self, choice: str, c_in: int, c_out: int, stride: int):
        super().__init__()
        k = 3 if choice == "choice_x" else int(choice[-1])
        self.split = stride == 1 and c_in == c_out
        if self.split:
            self.proj = None
            self.branch = branch(choice, c_in // 2, c_out // 2, c_out - c_in // 2, 1)
        else:
            self.proj = nn.Sequential(ConvBNAct(c_in, c_in, k, stride, groups=c_in, act=None),
                                      ConvBNAct(c_in, c_in, 1))
            self.branch = branch(choice, c_in, c_out // 2, c_out - c_in, stride)
        self.shuffle = nn.ChannelShuffle(2)

    def forward(self, x):
        if self.split:
            a, b = x.chunk(2, dim=1)  # (B, C, H, W) -> 2 x (B, C/2, H, W)
        else:
            a, b = self.proj(x), x
        return self.shuffle(torch.cat([a, self.branch(b)], dim=1))


def spos_space(stages=PAPER_STAGES, stem: int = 16, head: int = 1024, stem_stride: int = 2,
               in_channels: int = 3, num_classes: int = 1000,
               image_size: int = 224) -> rt.ModelSpace:
    """The SPOS space on a stage layout: (out channels, blocks, first stride) per stage;
    the choice blocks are labelled ``block1`` ... ``block20``."""
    layers, c_in, i = [], stem, 0
    for c_out, n, stride in stages:
        for j in range(n):
            i += 1
            s = stride if j == 0 else 1
            layers.append(rt.LayerChoice({c: ShuffleUnit(c, c_in, c_out, s) for c in CHOICES},
                                         label=f"block{i}"))
            c_in = c_out
    net = MobileNet(layers, stem, c_in, head, stem_stride, in_channels, num_classes,
                    act=nn.ReLU)
    return rt.ModelSpace(net, example_input=torch.zeros(1, in_channels, image_size,
                                                        image_size))


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8) -> rt.ModelSpace:
    """The 20 blocks with widths 16, 24, 32, 48."""
    return spos_space(SMALL_STAGES, 8, 64, 1, in_channels, num_classes, image_size)


def paper(in_channels: int = 3, num_classes: int = 1000, image_size: int = 224
          ) -> rt.ModelSpace:
    """SPOS's ShuffleNetV2 super-net layout for ImageNet."""
    return spos_space(PAPER_STAGES, 16, 1024, 2, in_channels, num_classes, image_size)
