"""The TextNAS space (Wang et al., "TextNAS: A Neural Architecture Search Space Tailored for
Text Representation", AAAI 2020): layers over token embeddings with skip connections.

Tokens are embedded (node 0); layer l (1..L) applies one op to node l - 1, adds the outputs of
any chosen earlier nodes 0 .. l-2 (skip connections) and normalizes (LayerNorm); the sequence
is classified from the mean and the max of the last node over time::

    emb ─▶ op1 ─▶ Σ ─▶ LN ─▶ op2 ─▶ Σ ─▶ LN ─▶ ... ─▶ [mean ‖ max] ─▶ linear
     └──────────(skip, if chosen)──▲

8 ops, every one (B, T, D) -> (B, T, D): conv k = 1, 3, 5, 7 (1-d conv, BatchNorm, ReLU),
max and average pooling (k = 3), a bidirectional GRU and multi-head self-attention, the
TextNAS operation set. The base model has every skip and conv k=3 everywhere;
:class:`TextCellMutator` picks each layer's op (``"layer{l}/op"``) and its skips
(``"layer{l}/skip{j}"`` in ``[0, 1]``) and removes the skips left out.

Size: ``8 ** L * 2 ** (L (L - 1) / 2)`` samples (every subset of skips counted); the paper's
24 layers give 8 ** 24 * 2 ** 276 (about 5.7e104; the paper states no count); the small
preset's 4 layers 8 ** 4 * 2 ** 6 = 262,144.

Data: with ``from_pixels`` the model reads images (B, C, H, W) with values in [0, 1] as a
sequence of ``C * H * W`` tokens (each pixel's value quantized to ``vocab`` levels): the
launcher's digits. Otherwise it reads token ids (B, T) directly, as on text (the tests train
it on a synthetic token task). Presets: :func:`paper` has the published depth and width (24
layers, 256 hidden; the paper's 300-d GloVe embeddings are learned here), :func:`small` 4
layers of width 16.

Example::

    >>> space = small()
    >>> space.size()
    262144
"""
from __future__ import annotations

import torch
from torch import nn

import retiarii as rt
from retiarii import ops

OP_NAMES = ("conv_1", "conv_3", "conv_5", "conv_7", "max_pool", "avg_pool", "gru",
            "attention")
PAPER_LAYERS, PAPER_WIDTH = 24, 256


@rt.leaf
class ConvOp(nn.Module):
    """1-d conv over time, BatchNorm, ReLU: (B, T, D) -> (B, T, D)."""

    def __init__(self, dim: int, kernel_size: int):
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, kernel_size, padding=kernel_size // 2, bias=False)
        self.bn = nn.BatchNorm1d(dim)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x.transpose(1, 2)))).transpose(1, 2)


@rt.leaf
class PoolOp(nn.Module):
    """Max or average pooling over time, kernel 3, stride 1: (B, T, D) -> (B, T, D)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.pool = nn.MaxPool1d(3, 1, 1) if kind == "max" else \
            nn.AvgPool1d(3, 1, 1, count_include_pad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(x.transpose(1, 2)).transpose(1, 2)


@rt.leaf
class GRUOp(nn.Module):
    """Bidirectional GRU of D/2 units each way: (B, T, D) -> (B, T, D)."""

    def __init__(self, dim: int):
        super().__init__()
        self.gru = nn.GRU(dim, dim // 2, batch_first=True, bidirectional=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(x)[0]


@rt.leaf
class AttentionOp(nn.Module):
    """Multi-head self-attention: (B, T, D) -> (B, T, D)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def make_op(name: str, dim: int) -> nn.Module:
    if name.startswith("conv_"):
        return ConvOp(dim, int(name[-1]))
    if name in ("max_pool", "avg_pool"):
        return PoolOp(name[:3])
    if name == "gru":
        return GRUOp(dim)
    if name == "attention":
        return AttentionOp(dim, 4 if dim % 4 == 0 else 1)
    raise ValueError(f"unknown op {name!r}; expected one of {OP_NAMES}")


@rt.leaf
class PixelTokens(nn.Module):
    """(B, C, H, W) in [0, 1] -> (B, C*H*W) token ids in [0, vocab)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.flatten(1).clamp(0, 1) * (self.vocab - 1)).round().long()


class TextNet(nn.Module):
    """Embedding, ``num_layers`` layers with every skip, mean-and-max pooling, classifier."""

    def __init__(self, vocab: int, dim: int, num_layers: int, num_classes: int,
                 from_pixels: bool):
        super().__init__()
        self.num_layers = num_layers
        self.tokens = PixelTokens(vocab) if from_pixels else nn.Identity()
        self.embed = nn.Embedding(vocab, dim)
        for layer in range(1, num_layers + 1):
            setattr(self, f"op{layer}", make_op("conv_3", dim))
            setattr(self, f"sum{layer}", ops.Sum())
            setattr(self, f"norm{layer}", nn.LayerNorm(dim))
        self.fc = nn.Linear(2 * dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nodes = [self.embed(self.tokens(x))]  # (B, T) -> (B, T, D)
        for layer in range(1, self.num_layers + 1):
            out = getattr(self, f"op{layer}")(nodes[-1])
            out = getattr(self, f"sum{layer}")(out, *nodes[:-1])
            nodes.append(getattr(self, f"norm{layer}")(out))
        last = nodes[-1]
        pooled = torch.cat([last.mean(1), last.amax(1)], dim=1)  # (B, T, D) -> (B, 2D)
        return self.fc(pooled)


class TextCellMutator(rt.Mutator):
    """Each layer's op and skips (see the module docstring)."""

    def __init__(self, num_layers: int, dim: int):
        super().__init__("textnas")
        self.num_layers, self.dim = num_layers, dim

    def mutate(self, targets):
        for layer in range(1, self.num_layers + 1):
            op = self.choose(list(OP_NAMES), label=f"layer{layer}/op")
            if op != "conv_3":
                self.replace(f"op{layer}", make_op(op, self.dim))
            for j in range(layer - 1):
                if not self.choose([0, 1], label=f"layer{layer}/skip{j}"):
                    self.disconnect("embed" if j == 0 else f"norm{j}", f"sum{layer}")


def count(num_layers: int) -> int:
    return 8 ** num_layers * 2 ** (num_layers * (num_layers - 1) // 2)


def textnas_space(vocab: int = 17, dim: int = PAPER_WIDTH, num_layers: int = PAPER_LAYERS,
                  num_classes: int = 10, from_pixels: bool = True, in_channels: int = 1,
                  image_size: int = 8, seq_len: int = 64) -> rt.ModelSpace:
    """The TextNAS space; see the module docstring. ``in_channels`` and ``image_size`` shape
    the example input with ``from_pixels``, ``seq_len`` without."""
    net = TextNet(vocab, dim, num_layers, num_classes, from_pixels)
    example = torch.zeros(1, in_channels, image_size, image_size) if from_pixels \
        else torch.zeros(1, seq_len, dtype=torch.long)
    return rt.ModelSpace(net, [TextCellMutator(num_layers, dim)], example_input=example)


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8) -> rt.ModelSpace:
    """4 layers of width 16 over the digits' pixels as 17-level tokens."""
    return textnas_space(17, 16, 4, num_classes, True, in_channels, image_size)


def paper(in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> rt.ModelSpace:
    """The published 24 layers of width 256 (over pixels as tokens; see ``textnas_space`` for
    token input)."""
    return textnas_space(17, PAPER_WIDTH, PAPER_LAYERS, num_classes, True, in_channels,
                         image_size)
