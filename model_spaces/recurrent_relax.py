"""DARTS' relaxed recurrent cell (Liu et al., ICLR 2019, section 2.1): the supernet that
``retiarii.strategies.DARTS`` trains on :func:`model_spaces.recurrent.darts_space`.

The cell's genotype lives inside one module unrolled over time (``RecurrentNet``), which a
graph relaxation cannot read, so the space brings this supernet (``space.relaxation``). Node
0 is ``tanh`` over ``x_t`` and ``h_{t-1}``; in the relaxed cell node ``i`` (1..8) reads
*every* earlier node ``j`` through an edge carrying a mixed operation over DARTS' recurrent
primitives ``none, tanh, relu, sigmoid, identity``, weighted by ``softmax(alpha_{i,j})``::

    c_j, v_j = sigmoid, . of W_i s_j             (W_i: node i's (H -> 2H) weights, shared
    s_i = sum_j sum_{f != none} w_{i,j,f} * (c_j * f(v_j) + (1 - c_j) * s_j)   by its edges)
    h_t = mean(s_1 .. s_8)              (every s_i batch-normalized, without affine, as DARTS)

The derivation keeps, for each node, its one edge whose strongest non-``none`` op weighs
most, with that op (:class:`~retiarii.optim.derivation.EdgeDerivation` with ``keep=1``): a
sample of the space, ``{"darts/node{i}/input": j, "darts/node{i}/op": f}``. The supernet's
weights are those of the space's model (``entry``, ``nodes.{i-1}`` = ``W_i``, ``fc``), so
:meth:`DartsRNNRelaxation.export` copies them into ``space.build(sample)`` unchanged.

Example::

    relax = DartsRNNRelaxation(darts_small())
    loss = F.cross_entropy(relax(x), y)         # grads reach W and every alpha
    sample = relax.derive()                      # {"darts/node1/input": 0, ...}
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from retiarii.optim.arch_params import ArchParameters
from retiarii.optim.derivation import EdgeDerivation

from .recurrent import DARTS_ACTIVATIONS, DARTS_NODES, RowsClassifier, activate

__all__ = ["DartsRNNRelaxation", "DERIVATION", "PRIMITIVES"]

PRIMITIVES = ("none",) + DARTS_ACTIVATIONS
MODES = ("softmax", "fixed")


def edge_label(node: int, src: int) -> str:
    return f"darts/node{node}/e{src}"


# one incoming edge per node (DARTS' recurrent cell: k = 1)
DERIVATION = EdgeDerivation(nodes=tuple(
    (f"node{i}", tuple(edge_label(i, j) for j in range(i))) for i in range(1, DARTS_NODES + 1)),
    keep=1, none="none")


class DartsRNNRelaxation(ArchParameters):
    """The relaxed DARTS recurrent cell of ``space`` (a :func:`darts_space`); see the module
    docstring. It has the members :mod:`retiarii.strategies.one_shot.relaxed_training` uses of a
    :class:`~retiarii.optim.relax.Relaxation`, in modes ``"softmax"`` and ``"fixed"``.

    Args:
        space: the DARTS recurrent-cell space (``space.rnn_dims`` gives its sizes).
        mode: ``"softmax"`` (DARTS) or ``"fixed"`` (after :meth:`fix`).
        seed: its generator's seed (kept in the state as a Relaxation's is).
    """

    def __init__(self, space, mode: str = "softmax", seed: int = 0, **settings: Any):
        super().__init__()
        if settings:
            raise ValueError(f"DARTS' recurrent supernet has no settings {sorted(settings)}: it "
                             f"runs DARTS' softmax relaxation only (modes {MODES})")
        self.space = space
        in_channels, image_size, hidden, classes = space.rnn_dims
        self.weights = RowsClassifier(in_channels, image_size, hidden, classes, "darts")
        # DARTS' search cell normalizes every state (BatchNorm without affine): a node sums
        # up to 8 mixed edges, whose scale would otherwise grow node after node
        self.norm = nn.BatchNorm1d(hidden, affine=False)
        self.labels = [label for _, labels in DERIVATION.nodes for label in labels]
        self.keys = {label: list(PRIMITIVES) for label in self.labels}
        self.alphas = nn.ParameterList(nn.Parameter(torch.zeros(len(PRIMITIVES)))
                                       for _ in self.labels)
        self.generator = torch.Generator().manual_seed(seed)
        self._fixed: list | None = None
        self.set_mode(mode)

    # ---- what the bilevel loop asks ---------------------------------------------------------
    def set_mode(self, mode: str, **settings: Any) -> None:
        if mode not in MODES or settings:
            raise ValueError(f"DARTS' recurrent supernet runs modes {MODES} without settings, "
                             f"not {mode!r} {settings or ''}: use DARTS (softmax), or SPOS/ENAS "
                             f"on the discrete space")
        if mode == "fixed" and self._fixed is None:
            raise ValueError("mode 'fixed' runs one sample: call fix(sample) instead")
        self.mode = mode

    def derive(self) -> dict:
        """Each node's strongest (predecessor, activation), as a sample of the space."""
        chosen = DERIVATION({k: p.tolist() for k, p in self.probabilities().items()}, self.keys)
        sample = {}
        for i in range(1, DARTS_NODES + 1):
            for j in range(i):
                op = PRIMITIVES[chosen[edge_label(i, j)]]
                if op != "none":
                    sample[f"darts/node{i}/input"], sample[f"darts/node{i}/op"] = j, op
        return sample

    def genotype_of(self, sample: dict) -> list[tuple[str, int]]:
        try:
            return [(str(sample[f"darts/node{i}/op"]), int(sample[f"darts/node{i}/input"]))
                    for i in range(1, DARTS_NODES + 1)]
        except KeyError as err:
            raise ValueError(f"the sample lacks label {err.args[0]!r} of the DARTS recurrent "
                             f"cell (labels darts/node{{i}}/input and /op, i = 1..8)") from None

    def fix(self, sample: dict) -> "DartsRNNRelaxation":
        self._fixed = self.genotype_of(sample)
        self.mode = "fixed"
        return self

    def export(self, sample: dict) -> nn.Module:
        """``space.build(sample)`` with the supernet's weights (they are the model's)."""
        module = self.space.build(sample)
        module.load_state_dict(self.weights.state_dict())
        return module

    # ---- the forward ----------------------------------------------------------------------------
    def _mixed_step(self, x: torch.Tensor, h: torch.Tensor, probs: list) -> torch.Tensor:
        rnn = self.weights.rnn
        gate, value = rnn.entry(torch.cat([x, h], dim=1)).chunk(2, dim=1)  # (B, H) each
        c = torch.sigmoid(gate)
        states = [self.norm(c * torch.tanh(value) + (1 - c) * h)]  # node 0
        for i, layer in enumerate(rnn.nodes, start=1):
            prev = torch.stack(states)  # (i, B, H): every predecessor of node i
            gate, value = layer(prev).chunk(2, dim=-1)  # (i, B, H) each
            c = torch.sigmoid(gate)
            w = probs[i - 1]  # (i, 5): edge j's op weights
            s = 0.0
            for k, name in enumerate(PRIMITIVES):
                if name == "none":  # the zero op adds nothing; its weight still competes
                    continue
                out = c * activate(name, value) + (1 - c) * prev  # (i, B, H)
                s = s + (w[:, k, None, None] * out).sum(0)  # (B, H)
            states.append(self.norm(s))
        return torch.stack(states[1:]).mean(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        net = self.weights
        if self.mode == "fixed":
            net.rnn.genotype = self._fixed
            return net(x)
        b, c, h, w = x.shape
        seq = x.permute(0, 2, 1, 3).reshape(b, h, c * w)  # (B, C, H, W) -> (B, H, C*W)
        probs = [torch.stack([F.softmax(self.alpha(edge_label(i, j)), -1) for j in range(i)])
                 for i in range(1, DARTS_NODES + 1)]  # node i: (i, 5)
        state = seq.new_zeros(b, net.rnn.hidden)
        for t in range(h):
            state = self._mixed_step(seq[:, t], state, probs)
        return net.fc(state)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, labels={len(self.labels)}"
