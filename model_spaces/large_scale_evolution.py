"""Large-Scale Evolution of Image Classifiers (Real et al., ICML 2017): an evolving space grown
from a network with no convolution by adding, removing and altering layers and skips.

The minimal network is the paper's starting point, a linear classifier on the pixels
(``flatten -> LazyLinear``). Every step of :class:`LayerMutator` (open-ended: it grows while
``"lse/grow{i}"`` says True) applies one of the paper's structural mutations,
``"lse/kind{i}"``, among those that apply to the network at hand:

* ``insert_conv``: a conv-BN-ReLU layer (channels, kernel chosen; stride 1) before the
  classifier or before another conv layer;
* ``remove_conv``: a conv layer's consumers read its input instead;
* ``alter_channels`` (halve or double), ``alter_kernel`` (1, 3, 5), ``alter_stride`` (1 <-> 2)
  of a conv layer;
* ``insert_skip``: a skip from an earlier layer (or the image) added after a layer's ReLU;
* ``remove_skip``: a skip's merge taken out.

Every layer after a change re-reads its sizes: convolutions, BatchNorms and the classifier
are lazy (``nn.LazyConv2d`` ...), settled by the space's shape check. A skip merge
(:class:`SkipMerge`) adds the skip to the main path after pooling it to the main path's
resolution and zero-padding or cutting its channels, the paper's rule for tensors of
different shapes; so every mutation of every network builds. The learning rate is evolved
too (``"lr"``, a trainer hyper-parameter, as the paper's "alter learning rate").
"Identity" and "reset weights" act on training, not on the architecture, and are left out.

Unbounded space (``size()`` is ``math.inf``); the row runs
``RegularizedEvolution(initial="base")`` (the paper's tournament evolution starts from a
population of minimal networks). Presets: :func:`small` channels 4 .. 64 on digits;
:func:`paper` the same minimal network on 32x32 images with channels 16 .. 512.

Example::

    >>> space = small()
    >>> space.default_sample()
    {'lse/grow0': False, 'lr': 0.003}
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import retiarii as rt

KINDS = ("insert_conv", "remove_conv", "alter_channels", "alter_kernel", "alter_stride",
         "insert_skip", "remove_skip")
KERNELS = (1, 3, 5)
LEARNING_RATES = (0.003, 0.001, 0.01)


@rt.leaf
class SkipMerge(nn.Module):
    """``x + reshape(skip)``: the skip average-pooled to x's height and width, its channels
    zero-padded or cut to x's: (B, C, H, W), (B, C', H', W') -> (B, C, H, W)."""

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        skip = F.adaptive_avg_pool2d(skip, x.shape[-2:])
        extra = x.shape[1] - skip.shape[1]
        if extra > 0:
            skip = F.pad(skip, (0, 0, 0, 0, 0, extra))
        return x + skip[:, :x.shape[1]]


class MinimalNet(nn.Module):
    """A linear classifier on the pixels: (B, C, H, W) -> (B, num_classes)."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc = nn.LazyLinear(num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flatten(x))


def conv(channels: int, kernel: int, stride: int) -> nn.Module:
    return nn.LazyConv2d(channels, kernel, stride=stride, padding=kernel // 2)


class LayerMutator(rt.Mutator):
    """The structural mutations of Real et al., one per step (see the module docstring)."""

    open_ended = True

    def __init__(self, channels: tuple[int, ...]):
        super().__init__("lse")
        self.channels = channels  # (smallest, first, largest) conv width

    # -- what the graph holds -------------------------------------------------------------

    def _ending(self, suffix: str) -> dict:
        return {n.name: n for n in self.graph.nodes if n.name.endswith(suffix)}

    def _conv_args(self, node) -> tuple[int, int, int]:
        spec = node.op.spec
        return spec["args"][0], spec["args"][1], spec["kwargs"].get("stride", 1)

    def _layer(self, conv_name: str) -> tuple[str, str, str]:
        stem = conv_name[:-len("_conv")]
        return conv_name, f"{stem}_bn", f"{stem}_relu"

    def _skip_pairs(self) -> dict:
        """``"src->relu"``: a skip may join after a layer's ReLU from an earlier layer or the
        image, if none joins there from it already."""
        graph = self.graph
        sources = list(graph.input_nodes) + list(self._ending("_relu").values())
        pairs = {}
        for dst in self._ending("_relu").values():
            joined = {u.inputs[1].name for u in dst.users if u.name.endswith("_merge")}
            for src in sources:
                if src is not dst and src.name not in joined and not graph.reaches(dst, src):
                    pairs[f"{src.name}->{dst.name}"] = (src, dst)
        return pairs

    def _bypass(self, node, replacement) -> None:
        """Delete ``node``; what it fed reads ``replacement`` instead."""
        users = self.graph.out_edges(node)
        self.delete_node(node)
        for user, port in users:
            self.connect(replacement, user, port)

    # -- the mutations ----------------------------------------------------------------------

    def insert_conv(self, i: int) -> None:
        places = {"flatten": self.graph["flatten"], **self._ending("_conv")}
        dst = self.choose(places, label=f"lse/before{i}")
        channels = self.choose([c for c in (self.channels[1], 2 * self.channels[1])],
                               label=f"lse/channels{i}")
        kernel = self.choose(list(KERNELS), label=f"lse/kernel{i}")
        src = dst.inputs[0]
        nodes = [self.create_node(f"lse_{i}_conv", conv(channels, kernel, 1)),
                 self.create_node(f"lse_{i}_bn", nn.LazyBatchNorm2d()),
                 self.create_node(f"lse_{i}_relu", nn.ReLU())]
        self.connect(src, nodes[0])
        self.connect(nodes[0], nodes[1])
        self.connect(nodes[1], nodes[2])
        self.connect(nodes[2], dst, 0)

    def remove_conv(self, i: int) -> None:
        conv_name, bn, relu = self._layer(self.choose(self._ending("_conv"),
                                                      label=f"lse/layer{i}").name)
        src = self.graph[conv_name].inputs[0]
        self._bypass(self.graph[relu], src)
        self.delete_node(bn)
        self.delete_node(conv_name)

    def _alter(self, i: int, what: str) -> None:
        node = self.choose(self._ending("_conv"), label=f"lse/layer{i}")
        channels, kernel, stride = self._conv_args(node)
        if what == "channels":
            low, _, high = self.channels
            options = [c for c in (channels // 2, channels * 2) if low <= c <= high]
            channels = self.choose(options, label=f"lse/channels{i}")
        elif what == "kernel":
            kernel = self.choose([k for k in KERNELS if k != kernel], label=f"lse/kernel{i}")
        else:
            stride = 3 - stride  # 1 <-> 2
        self.replace(node, conv(channels, kernel, stride))

    def alter_channels(self, i: int) -> None:
        self._alter(i, "channels")

    def alter_kernel(self, i: int) -> None:
        self._alter(i, "kernel")

    def alter_stride(self, i: int) -> None:
        self._alter(i, "stride")

    def insert_skip(self, i: int) -> None:
        src, dst = self.choose(self._skip_pairs(), label=f"lse/skip{i}")
        users = self.graph.out_edges(dst)
        merge = self.create_node(f"lse_{i}_merge", SkipMerge())
        self.connect(dst, merge)
        self.connect(src, merge)
        for user, port in users:
            self.connect(merge, user, port)

    def remove_skip(self, i: int) -> None:
        merge = self.choose(self._ending("_merge"), label=f"lse/merge{i}")
        self._bypass(merge, merge.inputs[0])

    def _applicable(self) -> list[str]:
        kinds = ["insert_conv"]
        convs = list(self._ending("_conv").values())
        if convs:
            kinds += ["remove_conv", "alter_kernel", "alter_stride"]
            low, _, high = self.channels
            if any(low <= c <= high for n in convs
                   for c in (self._conv_args(n)[0] // 2, self._conv_args(n)[0] * 2)):
                kinds.append("alter_channels")
        if self._skip_pairs():
            kinds.append("insert_skip")
        if self._ending("_merge"):
            kinds.append("remove_skip")
        return [k for k in KINDS if k in kinds]

    def mutate(self, targets):
        i = 0
        while self.choose([False, True], label=f"lse/grow{i}"):
            getattr(self, self.choose(self._applicable(), label=f"lse/kind{i}"))(i)
            i += 1


def evolution_space(num_classes: int, channels: tuple[int, int, int], example: torch.Tensor):
    """The Large-Scale Evolution space from the minimal network; see the module docstring."""
    space = rt.ModelSpace(MinimalNet(num_classes), [LayerMutator(channels)],
                          example_input=example)
    return space.with_hparams({"lr": rt.ValueChoice(list(LEARNING_RATES), label="lr")})


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8) -> rt.ModelSpace:
    """New conv layers of 8 or 16 channels, altered within 4 .. 64."""
    return evolution_space(num_classes, (4, 8, 64),
                           torch.zeros(1, in_channels, image_size, image_size))


def paper(in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> rt.ModelSpace:
    """New conv layers of 32 or 64 channels, altered within 16 .. 512 (CIFAR-10 shapes)."""
    return evolution_space(num_classes, (16, 32, 512),
                           torch.zeros(1, in_channels, image_size, image_size))
