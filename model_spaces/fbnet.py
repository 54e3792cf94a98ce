"""The FBNet space (Wu et al., CVPR 2019): a layer-wise choice of 9 blocks on 22 layers.

A fixed macro-architecture (the paper's Table 1: a 3x3 stem of 16 channels, 22 searched
layers in stages of 1, 4, 4, 4, 4, 4, 1 with widths 16, 24, 32, 64, 112, 184, 352, a 1x1
conv to 1984 channels, pooling, the classifier) where each layer is one of 9 candidates
(Table 2)::

    x ─▶ 1x1 group conv (expansion e, groups g), BN, ReLU ─▶ [shuffle, if g = 2]
         ─▶ k x k depthwise, BN, ReLU ─▶ 1x1 group conv, BN ─▶ (+ x when shapes allow)

    k3_e1  k3_e1_g2  k3_e3  k3_e6  k5_e1  k5_e1_g2  k5_e3  k5_e6  skip

FBNet's blocks keep the 1x1 expansion conv at expansion 1 (unlike MobileNetV2's first block).
``skip`` is the identity where the layer keeps its shape; where the layer changes the width
or resolution it is a 1x1 conv + BN + ReLU with the layer's stride (our reading of FBNet's
released builder: the paper leaves it implicit).

Size: 9 ** 22 (about 9.8e20) models, the published count ("9^22 ≈ 10^21").

FBNet searches with a differentiable super-net (Gumbel-softmax over the 9 candidates of each
layer); ``retiarii nas run fbnet`` runs ``retiarii.strategies.GumbelDARTS`` on the space with
``leaf_blocks=True`` (each candidate one opaque node, the same models: the relaxation refuses
spliced blocks, whose residuals read a node named by the previous layer's choice).

Presets: :func:`paper` has Table 1's widths and strides for 224x224 ImageNet; :func:`small`
keeps the 22 layers (the same size) with widths 8 ... 32, stem 8, head 64 and two stride-2
stages, for the 8x8 digits.

Example::

    >>> small().size() == 9 ** 22
    True
"""
from __future__ import annotations

import torch
from torch import nn

import retiarii as rt
from model_spaces._mobile import (ConvBNAct, LeafConvBNAct, LeafMBConv, MBConv, MobileNet,
                                  keeps_shape)

# (out channels, layers, first stride) per stage, the paper's Table 1
PAPER_STAGES = ((16, 1, 1), (24, 4, 2), (32, 4, 2), (64, 4, 2), (112, 4, 1), (184, 4, 2),
                (352, 1, 1))
SMALL_STAGES = ((8, 1, 1), (8, 4, 1), (12, 4, 2), (16, 4, 1), (20, 4, 1), (24, 4, 2),
                (32, 1, 1))
# name -> (kernel, expansion, groups), Table 2's order
BLOCKS = {"k3_e1": (3, 1, 1), "k3_e1_g2": (3, 1, 2), "k3_e3": (3, 3, 1), "k3_e6": (3, 6, 1),
          "k5_e1": (5, 1, 1), "k5_e1_g2": (5, 1, 2), "k5_e3": (5, 3, 1), "k5_e6": (5, 6, 1)}
PUBLISHED_SIZE = 9 ** 22


def skip(c_in: int, c_out: int, stride: int, leaf_blocks: bool = False) -> nn.Module:
    """The identity, or a 1x1 conv + BN + ReLU where the layer changes the shape."""
    if keeps_shape(c_in, c_out, stride):
        return nn.Identity()
    return (LeafConvBNAct if leaf_blocks else ConvBNAct)(c_in, c_out, 1, stride, act=nn.ReLU)


def searched_layer(c_in: int, c_out: int, stride: int, label: str,
                   leaf_blocks: bool = False) -> rt.LayerChoice:
    """One of the 9 candidates, as a LayerChoice labelled ``label``; ``leaf_blocks``: each
    candidate one opaque node (:class:`~model_spaces._mobile.LeafMBConv`)."""
    block = LeafMBConv if leaf_blocks else MBConv
    ops: dict[str, nn.Module] = {
        name: block(c_in, c_out, stride, k, e, act=nn.ReLU, groups=g, expand=True)
        for name, (k, e, g) in BLOCKS.items()}
    ops["skip"] = skip(c_in, c_out, stride, leaf_blocks)
    return rt.LayerChoice(ops, label=label)


def fbnet_space(stages=PAPER_STAGES, stem: int = 16, head: int = 1984, stem_stride: int = 2,
                in_channels: int = 3, num_classes: int = 1000,
                image_size: int = 224, leaf_blocks: bool = False) -> rt.ModelSpace:
    """The FBNet space on a stage layout: (out channels, layers, first stride) per stage;
    the searched layers are labelled ``layer1`` ... ``layer22``. ``leaf_blocks``: each
    candidate one opaque node (the same models; the form GumbelDARTS takes)."""
    layers, c_in, i = [], stem, 0
    for c_out, n, stride in stages:
        for j in range(n):
            i += 1
            layers.append(searched_layer(c_in, c_out, stride if j == 0 else 1, f"layer{i}",
                                         leaf_blocks))
            c_in = c_out
    net = MobileNet(layers, stem, c_in, head, stem_stride, in_channels, num_classes,
                    act=nn.ReLU)
    return rt.ModelSpace(net, example_input=torch.zeros(1, in_channels, image_size,
                                                        image_size))


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8,
          leaf_blocks: bool = False) -> rt.ModelSpace:
    """The 22 layers with widths 8 ... 32 (even: the g2 blocks split them in 2 groups)."""
    return fbnet_space(SMALL_STAGES, 8, 64, 1, in_channels, num_classes, image_size,
                       leaf_blocks)


def paper(in_channels: int = 3, num_classes: int = 1000, image_size: int = 224,
          leaf_blocks: bool = False) -> rt.ModelSpace:
    """FBNet's macro-architecture (Table 1) for ImageNet."""
    return fbnet_space(PAPER_STAGES, 16, 1984, 2, in_channels, num_classes, image_size,
                       leaf_blocks)
