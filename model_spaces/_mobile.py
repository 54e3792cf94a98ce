"""Blocks shared by the mobile-network spaces (the MobileNetV2 family): one MBConv for all.

MnasNet, EfficientNet, FBNet, ProxylessNAS, FairNAS, SCARLET-NAS, Single-Path NAS,
Once-for-All and ChamNet all search over MobileNetV2's inverted residual (Sandler et al., CVPR
2018), each with its own knobs; they build it from :class:`MBConv` here::

    x ─▶ [1x1 expand (groups g), BN, act] ─▶ [channel shuffle] ─▶ k x k depthwise (stride s),
         BN, act ─▶ [squeeze-excite] ─▶ 1x1 project (groups g), BN ─▶ (+ x when shapes allow)

and wrap it in :class:`MobileNet` (stem, searched layers, head, pooling, classifier), as SPOS
wraps its ShuffleNetV2 units. Every
width, kernel and expansion may be an int or a ValueChoice expression: the layers are
``retiarii.nn`` layers, so a space can make any of them a choice.

Example::

    >>> import torch
    >>> block = MBConv(16, 16, stride=1, kernel=rt.ValueChoice([3, 5]), expansion=6)
    >>> block(torch.zeros(2, 16, 8, 8)).shape          # runs eagerly as kernel 3
    torch.Size([2, 16, 8, 8])
"""
from __future__ import annotations

from torch import nn

import retiarii as rt


def scale_width(channels: int, percent, divisor: int = 8):
    """``channels * percent / 100`` rounded to the nearest multiple of ``divisor``: an int, or
    a ValueChoice expression when ``percent`` is a ValueChoice (EfficientNet's and ChamNet's
    width multipliers, as percentages so the arithmetic stays in integers)."""
    return (channels * percent + 50 * divisor) // (100 * divisor) * divisor


def keeps_shape(c_in, c_out, stride: int) -> bool:
    """Whether a layer maps (B, C, H, W) to the same shape, so it has a residual and may be
    skipped: stride 1 and the same width (the same int, or the same ValueChoice expression
    object, which is equal in every model)."""
    return stride == 1 and (c_in is c_out or (isinstance(c_in, int) and c_in == c_out))


class ConvBNAct(nn.Sequential):
    """k x k conv (no bias, 'same' padding), BN, then ``act`` unless it is None:
    (B, C_in, H, W) -> (B, C_out, H/stride, W/stride)."""

    def __init__(self, c_in, c_out, kernel=1, stride: int = 1, groups=1, act=nn.ReLU):
        layers = [rt.nn.Conv2d(c_in, c_out, kernel, stride, padding=kernel // 2, groups=groups,
                               bias=False), rt.nn.BatchNorm2d(c_out)]
        super().__init__(*layers, *([act()] if act is not None else []))


class SqueezeExcite(nn.Module):
    """Channel attention: x * sigmoid(W2 act(W1 mean(x))), ``channels`` -> ``squeeze`` -> back
    (EfficientNet and MnasNet squeeze to a quarter of the block's *input* channels)."""

    def __init__(self, channels, squeeze, act=nn.ReLU):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.reduce = rt.nn.Conv2d(channels, squeeze, 1)
        self.act = act()
        self.expand = rt.nn.Conv2d(squeeze, channels, 1)
        self.gate = nn.Sigmoid()

    def forward(self, x):
        # (B, C, H, W) -> (B, C, 1, 1) gates -> (B, C, H, W)
        return x * self.gate(self.expand(self.act(self.reduce(self.pool(x)))))


class MBConv(nn.Module):
    """MobileNetV2's inverted residual: (B, C_in, H, W) -> (B, C_out, H/s, W/s).

    Args:
        c_in, c_out: channels (ints or ValueChoice expressions).
        stride: of the depthwise conv (an int: it decides the residual).
        kernel: the depthwise kernel (3, 5, 7 or a ValueChoice of them).
        expansion: the hidden width is ``expansion * c_in``.
        se: add squeeze-and-excitation (to ``c_in // 4`` channels); a string: a LayerChoice
            so labelled between ``"none"`` and ``"se"`` (MnasNet searches it).
        se_first: with a searched ``se``, ``"se"`` is the first (default) candidate
            (EfficientNet, whose default model is B0, with SE in every block).
        act: the activation class (ReLU6 in MobileNetV2, swish in EfficientNet).
        groups: groups of the two 1x1 convs; above 1 a channel shuffle follows the first
            (FBNet's ``g2`` blocks, after ShuffleNet).
        expand: whether the 1x1 expansion conv exists; by default unless ``expansion`` is the
            int 1 (MobileNetV2's first block has none; FBNet's ``e1`` blocks keep it).
    """

    def __init__(self, c_in, c_out, stride: int = 1, kernel=3, expansion=6, se: bool | str = False,
                 act=nn.ReLU6, groups: int = 1, expand: bool | None = None,
                 se_first: bool = False):
        super().__init__()
        if expand is None:
            expand = not (isinstance(expansion, int) and expansion == 1)
        mid = expansion * c_in if expand else c_in
        layers = []
        if expand:
            layers.append(ConvBNAct(c_in, mid, 1, groups=groups, act=act))
        if groups > 1:
            layers.append(nn.ChannelShuffle(groups))
        layers.append(ConvBNAct(mid, mid, kernel, stride, groups=mid, act=act))
        if se:
            squeeze = max(1, c_in // 4) if isinstance(c_in, int) else c_in // 4
            excite = SqueezeExcite(mid, squeeze, act)
            options = {"none": nn.Identity(), "se": excite}
            if se_first:
                options = {"se": excite, "none": options["none"]}
            layers.append(excite if se is True else rt.LayerChoice(options, label=se))
        layers.append(ConvBNAct(mid, c_out, 1, groups=groups, act=None))
        self.body = nn.Sequential(*layers)
        self.residual = keeps_shape(c_in, c_out, stride)

    def forward(self, x):
        out = self.body(x)
        return out + x if self.residual else out


def layer_counts(n: int, base_first: bool = False) -> list[int]:
    """MnasNet's searched number of layers of a block of ``n`` base layers: n - 1 (at least 1),
    n, n + 1, ascending, or the base ``n`` first (the space's default model keeps it)."""
    counts = sorted({max(1, n - 1), n, n + 1})
    return sorted(counts, key=lambda m: m != n) if base_first else counts


def searched_layers(layer, n: int, label: str, base_first: bool = False,
                    depth: tuple[str, tuple] | None = None) -> list[nn.Module]:
    """A block of ``layer(i)`` repeated a searched number of times ``m`` (MnasNet's per-block
    layers, :func:`layer_counts`, the choice ``label``), as modules to append to a body.

    ``layer(0)`` is the block's first layer (it may change the shape), ``layer(i > 0)`` one that
    keeps it. With ``depth = (depth_label, percents)``, a depth coefficient ``d`` (in percent,
    100 to 200) makes the block ``ceil(m * d / 100)`` layers: EfficientNet's compound depth
    scaling of the *searched* count. The extra layers follow the Repeat as a LayerChoice over
    ``d`` (``"100"``: none) of Repeats tied to ``label``, whose first ``k`` entries hold
    ``ceil(k * d / 100) - k`` layers (entries without one are the identity)::

        Repeat(label: m) ─▶ LayerChoice(depth_label: d) ─▶ Repeat(label: m) of extra layers

    Example::

        >>> blocks = searched_layers(lambda i: nn.Linear(4, 4), 2, "b1/layers")
        >>> blocks[0].depths                      # one Repeat: 1, 2 or 3 layers
        [1, 2, 3]
    """
    counts = layer_counts(n, base_first)
    blocks: list[nn.Module] = [rt.Repeat(layer, depth=counts, label=label)]
    if depth is None:
        return blocks
    depth_label, percents = depth
    if any(not 100 <= d <= 200 for d in percents):
        raise ValueError(f"searched_layers: depth coefficients {percents!r} must be in "
                         f"[100, 200] percent (at most one extra layer per searched one)")

    def extra(k: int, d: int) -> int:  # ceil(k * d / 100) - k
        return -(-k * d // 100) - k

    options: dict[str, nn.Module] = {}
    for d in percents:
        if not any(extra(m, d) for m in counts):
            options[str(d)] = nn.Identity()
            continue
        # entry k adds one layer where ceil(k * d) - k grows (by 0 or 1 as d <= 200)
        entries = [layer(max(counts) + k) if extra(k, d) > extra(k - 1, d) else nn.Identity()
                   for k in range(1, max(counts) + 1)]
        options[str(d)] = rt.Repeat(entries, depth=counts, label=label)
    return blocks + [rt.LayerChoice(options, label=depth_label)]


@rt.leaf
class LeafMBConv(MBConv):
    """An :class:`MBConv` the trace keeps as one opaque node (same layers, same function).

    A LayerChoice of spliced MBConvs (the default) puts each candidate's layers in the graph;
    a block's residual add then reads a node named by the previous layer's choice, so the
    nodes of one layer depend on two choices together, which the continuous relaxations
    (DARTS, GumbelDARTS, ProxylessNAS: :mod:`retiarii.optim.relax`) refuse. A choice of
    leaf blocks is one node whose operation changes: a mixed op they take.
    """


@rt.leaf
class LeafConvBNAct(ConvBNAct):
    """A :class:`ConvBNAct` kept as one opaque node (see :class:`LeafMBConv`)."""


class MobileNet(nn.Module):
    """[resize] ─▶ stem (3x3 conv) ─▶ ``layers`` ─▶ head (1x1 conv) ─▶ pool ─▶ classifier.

    Args:
        layers: the searched body, in order (modules taking and returning one tensor).
        stem, last, head: widths of the stem, of the body's output and of the head conv
            (ints or ValueChoice expressions).
        stem_stride: 2 for ImageNet; 1 for tiny images.
        act: activation of the stem and head.
        resolution: None, or a size (a ValueChoice) the input is resized to first: a
            searched input resolution (EfficientNet, ChamNet) inside the model, so the data
            pipeline stays the same for every model.
    """

    def __init__(self, layers, stem, last, head, stem_stride: int = 2, in_channels: int = 3,
                 num_classes: int = 1000, act=nn.ReLU6, resolution=None):
        super().__init__()
        self.resize = None if resolution is None else rt.nn.Upsample(
            size=resolution, mode="bilinear", align_corners=False)
        self.stem = ConvBNAct(in_channels, stem, 3, stem_stride, act=act)
        self.layers = nn.Sequential(*layers)
        self.head = ConvBNAct(last, head, 1, act=act)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = rt.nn.Linear(head, num_classes)

    def forward(self, x):
        if self.resize is not None:
            x = self.resize(x)  # (B, C, H, W) -> (B, C, R, R)
        x = self.head(self.layers(self.stem(x)))
        return self.fc(self.pool(x).flatten(1))  # (B, head, 1, 1) -> (B, num_classes)



# MobileNetV2 1.0: (expansion, out channels, layers, first stride) per stage
MOBILENETV2_STAGES = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                      (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


def mobilenetv2(width: int = 100, num_classes: int = 1000, in_channels: int = 3,
                stem_stride: int = 2, stages=MOBILENETV2_STAGES, head: int | None = None
                ) -> MobileNet:
    """MobileNetV2 (Sandler et al., CVPR 2018) as a plain module: a 3x3 stem of 32 channels,
    the inverted residuals of ``stages`` (17 in MobileNetV2 1.0), a 1x1 conv to 1280
    channels, pooling and the classifier; ReLU6 throughout, the residual where shapes allow.

    Example::

        >>> import torch
        >>> net = mobilenetv2(width=25, num_classes=10, stem_stride=1)
        >>> net(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
        >>> len(net.layers)                                  # the blocks, in order
        17

    Args:
        width: the width multiplier in percent (100: MobileNetV2 1.0; 25: 0.25); every width
            is rounded to a multiple of 8 (:func:`scale_width`), at least 8.
        num_classes, in_channels: of the classifier and the stem.
        stem_stride: 2 for ImageNet; 1 for small images (CIFAR-sized).
        stages: ``(expansion, channels, layers, first stride)`` per stage; fewer or shallower
            stages give a smaller network of the same blocks.
        head: width of the last 1x1 conv; default 1280, scaled up (never down) with
            ``width`` as MobileNetV2 does.
    """
    stem = max(8, scale_width(32, width))  # never below 8 channels, as MobileNetV2 rounds
    c_in, layers = stem, []
    for expansion, channels, n, stride in stages:
        c_out = max(8, scale_width(channels, width))
        for i in range(n):  # (B, c_in, H, W) -> (B, c_out, H/s, W/s), s only in the first
            layers.append(MBConv(c_in, c_out, stride if i == 0 else 1, 3, expansion))
            c_in = c_out
    if head is None:
        head = scale_width(1280, max(width, 100))
    return MobileNet(layers, stem, c_in, head, stem_stride, in_channels, num_classes)
