"""Genetic CNN (Xie & Yuille, ICCV 2017): binary strings connecting the nodes of each stage.

A network is S stages separated by 2x2 max pooling. Stage s has a default input node, K_s
numbered nodes and a default output node, each a 3x3 conv-BN-ReLU. One bit per ordered pair
``i < j`` of numbered nodes says whether node i feeds node j (``K (K - 1) / 2`` bits per
stage, the paper's encoding). A node sums its inputs; a node without a predecessor reads the
input node, one without a successor feeds the output node (through a sum), and an isolated
node (no edge at all) is dropped. A stage whose bits are all 0 is input -> output::

    stage (K=3), bits 1-2: 1, 1-3: 0, 2-3: 1        in ─▶ n1 ─▶ n2 ─▶ n3 ─▶ Σ ─▶ out
    stage (K=3), bits 1-2: 1, 1-3: 0, 2-3: 0        in ─▶ n1 ─▶ n2 ─▶ Σ ─▶ out   (n3 dropped)

The base model has every bit set; :class:`StageMutator` removes the edges whose bit is 0.
Labels: ``"s{stage}/{i}-{j}"`` in ``[0, 1]``, 0 first.

Size: ``2 ** sum(K_s (K_s - 1) / 2)``, every bit string counted (strings that build the same
network, e.g. differing only in a dropped node's bits, are distinct samples; the engine
deduplicates the models by structural hash). The paper's CIFAR stages K = (3, 4, 5) give
2 ** 19 = 524,288 models, the number it states.

Presets: :func:`paper` has the published stages (3, 4, 5) at widths 64, 128, 256 on 32x32
images; :func:`small` the same stages at widths 8, 16, 32 for the 8x8 digits.

Example::

    >>> space = small()
    >>> space.size()
    524288
"""
from __future__ import annotations

import torch
from torch import nn

import retiarii as rt
from retiarii import ops
from model_spaces.nasbench101 import ConvBNReLU

PAPER_STAGES = (3, 4, 5)
PUBLISHED_SIZE = 2 ** 19


class Stage(nn.Module):
    """The fully connected stage of ``num_nodes`` nodes: (B, C_in, H, W) -> (B, C, H, W)."""

    def __init__(self, c_in: int, channels: int, num_nodes: int):
        super().__init__()
        self.num_nodes = num_nodes
        self.inp = ConvBNReLU(c_in, channels, 3)
        for j in range(1, num_nodes + 1):
            setattr(self, f"sum{j}", ops.Sum())
            setattr(self, f"n{j}", ConvBNReLU(channels, channels, 3))
        self.out_sum = ops.Sum()
        self.out = ConvBNReLU(channels, channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        nodes = []
        for j in range(1, self.num_nodes + 1):
            nodes.append(getattr(self, f"n{j}")(getattr(self, f"sum{j}")(x, *nodes)))
        return self.out(self.out_sum(*nodes))


class GeneticCNN(nn.Module):
    """Stages with 2x2 max pooling between them, global pooling, a linear classifier."""

    def __init__(self, stages=PAPER_STAGES, widths=(64, 128, 256), in_channels: int = 3,
                 num_classes: int = 10):
        super().__init__()
        layers, c_in = [], in_channels
        for s, (k, c) in enumerate(zip(stages, widths)):
            if s > 0:
                layers.append(nn.MaxPool2d(2, 2))
            layers.append(Stage(c_in, c, k))
            c_in = c
        self.stages = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.stages(x)).flatten(1))  # (B, C, 1, 1) -> (B, classes)


class StageMutator(rt.Mutator):
    """Reads stage ``label``'s bits and removes the edges they turn off (see the module
    docstring); bound to the stage's ``out_sum`` node."""

    def __init__(self, num_nodes: int, label: str):
        super().__init__(label)
        self.num_nodes = num_nodes

    def mutate(self, targets):
        stage = targets[0].name.rpartition(".")[0]
        k = self.num_nodes
        bits = {(i, j): self.choose([0, 1], label=f"{self.label}/{i}-{j}")
                for j in range(2, k + 1) for i in range(1, j)}
        preds = {j: [i for i in range(1, j) if bits[i, j]] for j in range(1, k + 1)}
        succs = {i: [j for j in range(i + 1, k + 1) if bits[i, j]] for i in range(1, k + 1)}
        if not any(bits.values()):  # no edge: the stage is input -> output
            self.connect(f"{stage}.inp", f"{stage}.out_sum")
        for j in range(1, k + 1):
            for i in range(1, j):
                if not bits[i, j]:
                    self.disconnect(f"{stage}.n{i}", f"{stage}.sum{j}")
            if preds[j]:
                self.disconnect(f"{stage}.inp", f"{stage}.sum{j}")
            if succs[j] or (not preds[j] and not succs[j]):
                self.disconnect(f"{stage}.n{j}", f"{stage}.out_sum")
        for j in range(1, k + 1):
            if not preds[j] and not succs[j]:  # isolated: dropped
                self.delete_node(f"{stage}.n{j}")
                self.delete_node(f"{stage}.sum{j}")


def genetic_cnn_space(stages=PAPER_STAGES, widths=(64, 128, 256), in_channels: int = 3,
                      num_classes: int = 10, image_size: int = 32) -> rt.ModelSpace:
    """The Genetic CNN space; see the module docstring."""
    net = GeneticCNN(stages, widths, in_channels, num_classes)
    position = [i for i, layer in enumerate(net.stages) if isinstance(layer, Stage)]
    mutators = [rt.apply_mutator(f"stages.{p}.out_sum", StageMutator(k, f"s{s + 1}"))
                for s, (p, k) in enumerate(zip(position, stages))]
    return rt.ModelSpace(net, mutators,
                         example_input=torch.zeros(1, in_channels, image_size, image_size))


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8) -> rt.ModelSpace:
    """The published stages (3, 4, 5) at widths 8, 16, 32: trains on digits in seconds."""
    return genetic_cnn_space(PAPER_STAGES, (8, 16, 32), in_channels, num_classes, image_size)


def paper(in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> rt.ModelSpace:
    """The published stages (3, 4, 5) at widths 64, 128, 256 (CIFAR-10 shapes)."""
    return genetic_cnn_space(PAPER_STAGES, (64, 128, 256), in_channels, num_classes,
                             image_size)
