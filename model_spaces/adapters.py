"""Adapters on a frozen MobileNetV2 (paper §7.2.2, Fig. 14; Rebuffi et al., NeurIPS 2017).

Transfer learning with adapters: a pretrained backbone stays fixed and a small trainable
module is inserted into it for the new task. Which block the adapter should follow is the
search: one choice, ``"block"``, among the backbone's inverted residuals. Every model of the
space is the same frozen MobileNetV2 (:func:`~model_spaces._mobile.mobilenetv2`, frozen with
:func:`retiarii.freeze`: no weight trains, its BatchNorms use their running statistics) plus
one adapter and its own classifier, both trained::

    x ─▶ stem* ─▶ block 0* ─▶ ... ─▶ block b* ─▶ adapter_b ─▶ block b+1* ─▶ ... ─▶ head* ─▶ pool ─▶ fc
                                                 (x + 1x1 conv)                                   (trains)
    * frozen

This is the workload of cross-model operator batching (docs/optimization.md): for N models
with adapters after different blocks, CSE computes the backbone up to the first adapter once,
and batching runs every later frozen block once on the concatenated inputs of the models that
reach it (``benchmarks/adapters.py``). The backbone here is randomly initialised under a
fixed seed (nothing can be downloaded; load pretrained weights into it the same way, before
:func:`retiarii.freeze`).

Presets: :func:`small` (a 5-block MobileNetV2 at width 0.25 on 16x16 images: tests) and
:func:`cifar` (all 17 blocks at a width multiplier, stem stride 1, for 32x32 images);
``benchmarks/adapters.py`` calls :func:`adapter_space` with its own sizes.

Example::

    >>> space = small()
    >>> space.size()
    5
    >>> model = space.build({"block": 2})
    >>> [n.name for n in space.instantiate({"block": 2}).graph.nodes if "adapter" in n.name]
    ['backbone.layers.2.add_1_adapter']
"""
from __future__ import annotations

import torch
from torch import nn

import retiarii as rt
from model_spaces._mobile import MOBILENETV2_STAGES, MobileNet, mobilenetv2


@rt.leaf
class Adapter(nn.Module):
    """A residual adapter: ``x + conv1x1(x)``, (B, C, H, W) -> (B, C, H, W)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        return x + self.conv(x)


class AdapterAfterBlock(rt.Mutator):
    """Insert one adapter after the block the strategy chooses (the choice ``label``: the
    block's index).

    Args:
        adapters: per block, in order, the adapter to insert after it (a module; its width is
            the block's output width).
        label: the choice's name in samples.

    Bind it to the last node of each block, in block order (:func:`block_ends`); the
    adapter takes that node's output and feeds its readers in its place::

        rt.apply_mutator(block_ends(net), AdapterAfterBlock(adapters))
    """

    def __init__(self, adapters: list[nn.Module], label: str = "block"):
        super().__init__(label)
        self.adapters = adapters

    def mutate(self, targets):
        if len(targets) != len(self.adapters):
            raise rt.MutationError(f"{self._name}: {len(targets)} block ends for "
                                   f"{len(self.adapters)} adapters; bind one target per block")
        block = self.choose(list(range(len(targets))), label=self.label)
        end = targets[block]
        order = {n.uid: i for i, n in enumerate(self.graph.nodes)}
        users = sorted(self.graph.out_edges(end), key=lambda e: (order[e[0].uid], e[1]))
        adapter = self.create_node(f"{end.name}_adapter", self.adapters[block])
        self.connect(end, adapter)
        for dst, port in users:
            self.connect(adapter, dst, port)


class AdapterNet(nn.Module):
    """A frozen MobileNet backbone and a trainable classifier: (B, 3, H, W) -> (B, classes)."""

    def __init__(self, backbone: MobileNet, num_classes: int):
        super().__init__()
        self.backbone = rt.freeze(backbone)
        self.fc = nn.Linear(backbone.fc.in_features, num_classes)  # the new task's: trains

    def forward(self, x):
        b = self.backbone
        x = b.head(b.layers(b.stem(x)))
        return self.fc(b.pool(x).flatten(1))  # (B, head, 1, 1) -> (B, classes)


def block_ends(net: AdapterNet) -> list[str]:
    """The traced name of each block's last node, in block order (its residual add, or the
    BatchNorm of its projection when it has none)."""
    last: dict[int, str] = {}
    for node in rt.trace(net).nodes:  # in order: a block's last node is the last seen
        parts = node.name.split(".")
        if parts[:2] == ["backbone", "layers"]:
            last[int(parts[2])] = node.name
    return [last[i] for i in range(len(net.backbone.layers))]


def adapter_space(width: int = 25, num_classes: int = 10, image_size: int = 32,
                  stem_stride: int = 1, stages=MOBILENETV2_STAGES, head: int | None = None,
                  seed: int = 0) -> rt.ModelSpace:
    """The space: a frozen MobileNetV2 (:func:`~model_spaces._mobile.mobilenetv2` with these
    arguments, initialised under ``seed``) with an adapter after one chosen block.

    Args:
        width: the width multiplier in percent.
        num_classes: of the trained classifier.
        image_size: of the square RGB example input.
        stem_stride, stages, head: as in :func:`~model_spaces._mobile.mobilenetv2`.
        seed: the backbone's initial values (frozen values must be deterministic: the same in
            every process that builds the space).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = AdapterNet(mobilenetv2(width, 1000, 3, stem_stride, stages, head), num_classes)
        # A randomly initialised backbone has running statistics 0 and 1: give it ones of a
        # plausible scale (what a pretrained one has) so its activations neither vanish nor
        # explode through 17 blocks.
        _calibrate(net, image_size)
    adapters = [Adapter(block.body[-1][0].out_channels) for block in net.backbone.layers]
    return rt.ModelSpace(net, [rt.apply_mutator(block_ends(net), AdapterAfterBlock(adapters))],
                         example_input=torch.randn(2, 3, image_size, image_size))


def _calibrate(net: AdapterNet, image_size: int) -> None:
    """Set each FrozenBatchNorm's statistics to those of its input on random images, in
    order, so every layer's output is normalized (what BatchNorm statistics estimated on data
    give a pretrained network)."""
    x = torch.randn(16, 3, image_size, image_size)

    def hook(module, inputs):
        (h,) = inputs
        module.running_mean.copy_(h.mean((0, 2, 3)))
        module.running_var.copy_(h.var((0, 2, 3), unbiased=False))

    handles = [m.register_forward_pre_hook(hook) for m in net.backbone.modules()
               if isinstance(m, rt.FrozenBatchNorm)]
    with torch.no_grad():
        net(x)
    for h in handles:
        h.remove()


def small(num_classes: int = 10, image_size: int = 16) -> rt.ModelSpace:
    """A 5-block MobileNetV2 at width 0.25 (stem and blocks of 8 channels, one stride 2,
    head 64): fast enough for tests."""
    stages = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 2, 1))
    return adapter_space(25, num_classes, image_size, 1, stages, head=64)


def cifar(width: int = 25, num_classes: int = 10, head: int = 320) -> rt.ModelSpace:
    """MobileNetV2's 17 blocks at ``width`` percent for 32x32 images (stem stride 1)."""
    return adapter_space(width, num_classes, 32, 1, MOBILENETV2_STAGES, head=head)
