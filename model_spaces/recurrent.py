"""Recurrent cell spaces: ENAS-RNN (Pham et al., ICML 2018) and DARTS' recurrent cell (Liu et
al., ICLR 2019), searched here on sequence classification.

Both cells compute the new hidden state ``h_t`` from ``x_t`` and ``h_{t-1}`` through a chain
of nodes, each a highway layer over one earlier node ``h_j`` with its own activation ``f``::

    c = sigmoid(W_c h_j)        h_node = c * f(W_h h_j) + (1 - c) * h_j

* **ENAS** (:func:`enas_space`): node 1 reads ``x_t`` and ``h_{t-1}``; node l >= 2 picks its
  input among nodes 1 .. l-1 (``"enas/node{l}/input"``); every node picks f among tanh,
  ReLU, identity, sigmoid (``"enas/node{l}/act"``); ``h_t`` is the mean of the *loose ends*
  (nodes no other node reads). Size: ``4 ** N * (N - 1)!`` samples; with the paper's N = 12
  nodes, 4 ** 12 * 11! = 669,692,775,628,800 (the paper quotes ``4^N x N!`` ~ 10^15, which
  also counts node 1's input, fixed here as in its cell).
* **DARTS** (:func:`darts_space`): node 0 is ``tanh`` over ``x_t`` and ``h_{t-1}``; node i
  (1..8) picks its input among nodes 0 .. i-1 and f among tanh, ReLU, sigmoid, identity
  (the derived cell: the relaxation's "none" is not a candidate); ``h_t`` is the mean of
  nodes 1..8. Size: ``4 ** 8 * 8! = 2,642,411,520`` (DARTS states no count). DARTS searches
  it through its relaxed cell, a mixed op over (none, tanh, ReLU, sigmoid, identity) on every
  edge ``j -> i``, derived to each node's strongest edge and op
  (:mod:`model_spaces.recurrent_relax`, the space's ``relaxation``).

The paper tasks are language models (Penn Treebank); the launcher's data set is the 8x8
digits, read here as a sequence of 8 rows of ``C * 8`` features, classified from the last
hidden state. The cell unrolled over time is one ``@rt.leaf`` module (:class:`RecurrentNet`,
weights shared over the steps); the cell mutator chooses its genotype and replaces the base
model's ``rnn`` node by the network it describes. Presets: :func:`paper` uses the published
hidden sizes (ENAS 1000, DARTS 850); the ``small`` ones 32.

Example::

    >>> space = enas_small()
    >>> space.size() == 4 ** 12 * math.factorial(11)
    True
"""
from __future__ import annotations

import math

import torch
from torch import nn

import retiarii as rt

ENAS_ACTIVATIONS = ("tanh", "relu", "identity", "sigmoid")
DARTS_ACTIVATIONS = ("tanh", "relu", "sigmoid", "identity")
ENAS_NODES, DARTS_NODES = 12, 8


def activate(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "tanh":
        return torch.tanh(x)
    if name == "relu":
        return torch.relu(x)
    if name == "sigmoid":
        return torch.sigmoid(x)
    return x


@rt.leaf
class RecurrentNet(nn.Module):
    """A recurrent cell unrolled over the sequence: (B, T, D) -> (B, H), the last ``h_t``.

    Args:
        input_size, hidden: D and H.
        genotype: ``[(activation, input node), ...]`` for nodes 1..N; node 0 is the cell's
            entry (ENAS: node 1's input is the entry, written -1; DARTS: node 0, tanh).
        style: ``"enas"`` (output: mean of the loose ends; node 1 is the first node of the
            genotype, over x_t and h_{t-1}) or ``"darts"`` (a fixed tanh node 0 over x_t and
            h_{t-1}; output: mean of every genotype node).
    """

    def __init__(self, input_size: int, hidden: int, genotype, style: str):
        super().__init__()
        self.hidden, self.style = hidden, style
        self.genotype = [(str(act), int(src)) for act, src in genotype]
        # the entry reads x_t and h_{t-1}: gate and candidate, (B, D + H) -> (B, 2H)
        self.entry = nn.Linear(input_size + hidden, 2 * hidden)
        self.nodes = nn.ModuleList(nn.Linear(hidden, 2 * hidden, bias=False)
                                   for _ in self.genotype[1 if style == "enas" else 0:])
        read = {src for _, src in self.genotype}
        count = len(self.genotype)
        self.outputs = [i for i in range(1, count + 1) if style == "darts" or i not in read]

    def step(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        gate, value = self.entry(torch.cat([x, h], dim=1)).chunk(2, dim=1)  # (B, H) each
        c = torch.sigmoid(gate)
        first = self.genotype[0][0] if self.style == "enas" else "tanh"
        states = [c * activate(first, value) + (1 - c) * h]  # ENAS node 1 / DARTS node 0
        offset = 1 if self.style == "enas" else 0
        for (act, src), layer in zip(self.genotype[offset:], self.nodes):
            prev = states[src - 1] if self.style == "enas" else states[src]
            gate, value = layer(prev).chunk(2, dim=1)
            c = torch.sigmoid(gate)
            states.append(c * activate(act, value) + (1 - c) * prev)
        first_index = 1 if self.style == "enas" else 0  # states[k] is node k + first_index
        return torch.stack([states[i - first_index] for i in self.outputs]).mean(0)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        h = seq.new_zeros(seq.shape[0], self.hidden)
        for t in range(seq.shape[1]):
            h = self.step(seq[:, t], h)
        return h


def default_genotype(style: str) -> list[tuple[str, int]]:
    """The base cell: a chain of tanh nodes."""
    if style == "enas":
        return [("tanh", -1)] + [("tanh", node - 1) for node in range(2, ENAS_NODES + 1)]
    return [("tanh", node - 1) for node in range(1, DARTS_NODES + 1)]


class RowsClassifier(nn.Module):
    """(B, C, H, W) images as H steps of C*W features, a recurrent net, a linear head."""

    def __init__(self, in_channels: int, image_size: int, hidden: int, num_classes: int,
                 style: str):
        super().__init__()
        self.rnn = RecurrentNet(in_channels * image_size, hidden, default_genotype(style),
                                style)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        seq = x.permute(0, 2, 1, 3).reshape(b, h, c * w)  # (B, C, H, W) -> (B, H, C*W)
        return self.fc(self.rnn(seq))


class RecurrentCellMutator(rt.Mutator):
    """Chooses each node's input and activation, then replaces the ``rnn`` node."""

    def __init__(self, input_size: int, hidden: int, style: str):
        super().__init__(style)
        self.input_size, self.hidden, self.style = input_size, hidden, style

    def mutate(self, targets):
        genotype = []
        if self.style == "enas":
            for node in range(1, ENAS_NODES + 1):
                src = -1 if node == 1 else self.choose(list(range(1, node)),
                                                       label=f"enas/node{node}/input")
                genotype.append((self.choose(list(ENAS_ACTIVATIONS),
                                             label=f"enas/node{node}/act"), src))
        else:
            for node in range(1, DARTS_NODES + 1):
                src = self.choose(list(range(node)), label=f"darts/node{node}/input")
                genotype.append((self.choose(list(DARTS_ACTIVATIONS),
                                             label=f"darts/node{node}/op"), src))
        for target in targets:
            self.replace(target, RecurrentNet(self.input_size, self.hidden, genotype,
                                              self.style))


def recurrent_space(style: str, hidden: int, in_channels: int = 1, num_classes: int = 10,
                    image_size: int = 8) -> rt.ModelSpace:
    """The ENAS (``style="enas"``) or DARTS (``"darts"``) recurrent-cell space."""
    net = RowsClassifier(in_channels, image_size, hidden, num_classes, style)
    mutator = RecurrentCellMutator(in_channels * image_size, hidden, style)
    space = rt.ModelSpace(net, [rt.apply_mutator("rnn", mutator)],
                          example_input=torch.zeros(1, in_channels, image_size, image_size))
    space.rnn_dims = (in_channels, image_size, hidden, num_classes)
    if style == "darts":  # DARTS searches it through its relaxed cell (a leaf to the graph)
        from .recurrent_relax import DartsRNNRelaxation
        space.relaxation = DartsRNNRelaxation
    return space


def enas_small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8):
    """ENAS cell of 12 nodes, hidden 32."""
    return recurrent_space("enas", 32, in_channels, num_classes, image_size)


def enas_paper(in_channels: int = 3, num_classes: int = 10, image_size: int = 32):
    """ENAS cell of 12 nodes, hidden 1000 (the paper's Penn Treebank size)."""
    return recurrent_space("enas", 1000, in_channels, num_classes, image_size)


def darts_small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8):
    """DARTS cell of 8 nodes, hidden 32."""
    return recurrent_space("darts", 32, in_channels, num_classes, image_size)


def darts_paper(in_channels: int = 3, num_classes: int = 10, image_size: int = 32):
    """DARTS cell of 8 nodes, hidden 850 (the paper's Penn Treebank size)."""
    return recurrent_space("darts", 850, in_channels, num_classes, image_size)


ENAS_SIZE = 4 ** ENAS_NODES * math.factorial(ENAS_NODES - 1)
DARTS_SIZE = 4 ** DARTS_NODES * math.factorial(DARTS_NODES)
