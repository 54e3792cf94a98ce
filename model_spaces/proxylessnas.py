"""The ProxylessNAS space and its relatives: one MBConv choice per layer of a MobileNetV2 body.

Four solutions search the same kind of space, a MobileNetV2 skeleton (stem, a fixed first
block, stages of inverted residuals, 1x1 head) where every layer picks its MBConv::

    stem ─▶ MBConv(k3, e1) ─▶ layer 1 ─▶ ... ─▶ layer L ─▶ 1x1 conv ─▶ pool ─▶ classifier
                              └ one of {k3_e3, k3_e6, k5_e3, ...} [or the identity]

- **ProxylessNAS** (Cai, Zhu & Han, ICLR 2019): kernel 3/5/7 x expansion 3/6, plus ``zero``
  on every layer that keeps its shape (the residual alone: the layer is dropped); 21 layers
  in stages of 4, 4, 4, 4, 4, 1 (widths 24, 40, 80, 96, 192, 320). Size: 6 choices on the 6
  first layers of the stages, 7 on the 15 others: 6**6 * 7**15 (about 2.2e17).
- **FairNAS** (Chu, Zhang & Xu, ICCV 2021): the same 6 MBConvs, no zero/skip, on 19 layers
  (stages of 2, 4, 4, 4, 4, 1): 6**19 (about 6.1e14), as published.
- **SCARLET-NAS** (Chu et al., arXiv:1908.06022): FairNAS's space plus a ``skip`` candidate
  on the layers that keep their shape (6 first layers: 6, 13 others: 7): 6**6 * 7**13. In its
  *super-net* the skip is a linearly equivalent transformation (LET, :class:`ScalableSkip`:
  a learnable 1x1 conv without BN or activation, a linear map whose function class holds the
  identity), so the skip's output scale can follow the MBConvs' and the super-net trains
  stably; this space holds the LET as its ``skip`` candidate, so the retrained model keeps
  it too (one 1x1 conv where the paper's stand-alone model has the identity).
- **Single-Path NAS** (Stamoulis et al., ECML-PKDD 2019): kernel 3/5 x expansion 3/6 plus
  ``skip`` on the layers that keep their shape (its MobileNetV2-based macro-architecture is
  taken here as ProxylessNAS's 21-layer layout): 4**6 * 5**15.
  The paper's "super-kernel" is how its differentiable search *shares weights* among these
  candidates (the 3x3 kernel is the centre of the 5x5, expansion 3 the first half of 6); the
  discrete space is the same, and each candidate here is its own MBConv; the search builds
  its super-kernels (``SinglePathNAS``) on ``space.macro``, the skeleton this builder
  records. A layer is one LayerChoice of its 4 (or 5) candidates rather than
  kernel and expansion ValueChoices under a skip choice: the same models, but choices that
  exist only when a layer is not skipped would make ``size()`` walk 2**15 branches.

Size convention: the number of distinct choice assignments (each a different network; a
dropped layer is one network whatever else). ProxylessNAS, SCARLET-NAS and Single-Path NAS
publish no single count; the ones above follow from the layouts.

All four publish weight-sharing searches (ProxylessNAS also an RL one); ``retiarii nas run``
runs ``ProxylessNAS`` (proxylessnas: on ``leaf_blocks=True``, each MBConv one opaque node,
which the binary-gate relaxation takes), ``SinglePathNAS`` (single_path_nas) and
``FairNAS`` (fairnas, scarlet_nas: strict fairness, then NSGA-II over accuracy and latency);
``retiarii nas show NAME`` says what differs from each paper.

Presets: :func:`paper` has the published widths and strides for 224x224 ImageNet (stem 32,
first block 16, head 1280); :func:`small` keeps the layer counts (the same space size) with
widths about / 8 and two stride-2 stages, for the 8x8 digits.

Example::

    >>> small("fairnas").size() == 6 ** 19
    True
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

import retiarii as rt
from model_spaces._mobile import LeafMBConv, MBConv, MobileNet, keeps_shape

# (out channels, layers, first stride) per stage
PROXYLESS_STAGES = ((24, 4, 2), (40, 4, 2), (80, 4, 2), (96, 4, 1), (192, 4, 2), (320, 1, 1))
FAIRNAS_STAGES = ((24, 2, 2), (40, 4, 2), (80, 4, 2), (96, 4, 1), (192, 4, 2), (320, 1, 1))
SMALL_WIDTHS = (8, 12, 16, 20, 24, 32)  # the small presets' stage widths
SMALL_STRIDES = (1, 2, 1, 1, 2, 1)

# variant -> (stages, kernels, expansions, the name of the identity candidate or None)
VARIANTS = {
    "proxylessnas": (PROXYLESS_STAGES, (3, 5, 7), (3, 6), "zero"),
    "fairnas": (FAIRNAS_STAGES, (3, 5, 7), (3, 6), None),
    "scarlet_nas": (FAIRNAS_STAGES, (3, 5, 7), (3, 6), "skip"),
    "single_path_nas": (PROXYLESS_STAGES, (3, 5), (3, 6), "skip"),
}


def size(variant: str) -> int:
    """The number of models of ``variant`` (see the module docstring)."""
    stages, kernels, expansions, identity = VARIANTS[variant]
    ops = len(kernels) * len(expansions)
    layers = sum(n for _, n, _ in stages)
    return ops ** len(stages) * (ops + (identity is not None)) ** (layers - len(stages))


class ScalableSkip(nn.Module):
    """SCARLET-NAS's scalable skip, a linearly equivalent transformation: a learnable 1x1
    conv, no bias, BN or activation: (B, C, H, W) -> (B, C, H, W). A linear map of the
    channels, so every function of the identity skip is one of its (weight = I), while its
    scale is learnt with the super-net's (the identity's fixed scale made SCARLET-NAS's
    super-net collapse to skips)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = rt.nn.Conv2d(channels, channels, 1, bias=False)

    def forward(self, x):
        return self.conv(x)


def searched_layer(c_in: int, c_out: int, stride: int, kernels, expansions, identity,
                   label: str, leaf_blocks: bool = False,
                   scalable_skip: bool = False) -> rt.LayerChoice:
    """One layer: a LayerChoice among MBConv(kernel k, expansion e) named ``k{k}_e{e}``, plus
    ``identity`` (the identity) when given and the layer keeps its shape; ``leaf_blocks``:
    each MBConv one opaque node (:class:`~model_spaces._mobile.LeafMBConv`);
    ``scalable_skip``: the identity is SCARLET-NAS's LET (:class:`ScalableSkip`)."""
    block = LeafMBConv if leaf_blocks else MBConv
    ops: dict[str, nn.Module] = {
        f"k{k}_e{e}": block(c_in, c_out, stride, k, e)
        for k, e in itertools.product(kernels, expansions)}
    if identity and keeps_shape(c_in, c_out, stride):
        ops[identity] = ScalableSkip(c_in) if scalable_skip else nn.Identity()
    return rt.LayerChoice(ops, label=label)


def proxyless_space(variant: str = "proxylessnas", stages=PROXYLESS_STAGES, stem: int = 32,
                    first: int = 16, head: int = 1280, stem_stride: int = 2,
                    in_channels: int = 3, num_classes: int = 1000,
                    image_size: int = 224, leaf_blocks: bool = False) -> rt.ModelSpace:
    """The space of ``variant`` (a key of :data:`VARIANTS`) on the given stage layout:
    (out channels, layers, first stride) per stage; layers are labelled ``layer1``...
    ``leaf_blocks``: the searched MBConvs as opaque nodes (the same models and functions; the
    form the continuous relaxations take, see :class:`~model_spaces._mobile.LeafMBConv`).
    """
    _, kernels, expansions, identity = VARIANTS[variant]
    layers: list[nn.Module] = [MBConv(stem, first, 1, 3, 1)]  # fixed, as in MobileNetV2
    c_in, i = first, 0
    shapes = []  # (label, c_in, c_out, stride, skippable) per searched layer
    for c_out, n, stride in stages:
        for j in range(n):
            i += 1
            s = stride if j == 0 else 1
            layers.append(searched_layer(c_in, c_out, s, kernels, expansions, identity,
                                         f"layer{i}", leaf_blocks, variant == "scarlet_nas"))
            shapes.append([f"layer{i}", c_in, c_out, s,
                           bool(identity) and keeps_shape(c_in, c_out, s)])
            c_in = c_out
    net = MobileNet(layers, stem, c_in, head, stem_stride, in_channels, num_classes)
    space = rt.ModelSpace(net, example_input=torch.zeros(1, in_channels, image_size,
                                                         image_size))
    if variant == "single_path_nas":
        # the skeleton SinglePathNAS builds its super-kernels on (retiarii/strategies/
        # single_path.py): one SuperKernelMBConv per searched layer, the same shapes
        space.macro = {"kind": "super_kernel", "in_channels": in_channels,
                       "num_classes": num_classes, "stem": stem, "stem_stride": stem_stride,
                       "first": first, "last": c_in, "head": head, "kernels": list(kernels),
                       "expansions": list(expansions), "layers": shapes}
    return space


def small(variant: str = "proxylessnas", in_channels: int = 1, num_classes: int = 10,
          image_size: int = 8, leaf_blocks: bool = False) -> rt.ModelSpace:
    """The variant's layer counts, widths 8 ... 32 (stem 8, first block 4, head 64), strides 2
    in the second and fifth stages."""
    stages = tuple((w, n, s) for w, (_, n, _), s in
                   zip(SMALL_WIDTHS, VARIANTS[variant][0], SMALL_STRIDES))
    return proxyless_space(variant, stages, 8, 4, 64, 1, in_channels, num_classes, image_size,
                           leaf_blocks)


def paper(variant: str = "proxylessnas", in_channels: int = 3, num_classes: int = 1000,
          image_size: int = 224, leaf_blocks: bool = False) -> rt.ModelSpace:
    """The published layout of ``variant`` for ImageNet."""
    return proxyless_space(variant, VARIANTS[variant][0], 32, 16, 1280, 2, in_channels,
                           num_classes, image_size, leaf_blocks)
