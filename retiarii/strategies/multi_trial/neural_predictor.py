"""Neural Predictor (Wen et al., "Neural Predictor for Neural Architecture Search", ECCV 2020): a
graph convolutional network over a cell's adjacency matrix and one-hot operations predicts its
accuracy; trained on N random architectures, it ranks a large sample and the top K are trained."""
from __future__ import annotations

import importlib
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ...sampler import ReplaySampler, sample_key
from .base import Draw, Strategy, draw


def graph_function(ref: str) -> Callable[[dict], tuple[list, list]]:
    """The function ``"module:name"`` that maps a sample to ``(adjacency, node_types)``."""
    module, sep, name = ref.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"NeuralPredictor: graph must be 'module:function' (e.g. "
                         f"'model_spaces.nasbench101:cell_graph'), got {ref!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"NeuralPredictor: graph {ref!r} cannot be imported ({e}); name a "
                         f"function sample -> (adjacency, node types)") from None


def batch_graphs(graphs: list[tuple[list, list]], types: list[str]):
    """``[(adjacency V x V, [type per node])]`` -> padded tensors ``(A, X, mask)`` of shapes
    ``(B, Vmax, Vmax)``, ``(B, Vmax, len(types))`` and ``(B, Vmax)``."""
    vmax = max(len(nodes) for _, nodes in graphs)
    a = torch.zeros(len(graphs), vmax, vmax)
    x = torch.zeros(len(graphs), vmax, len(types))
    mask = torch.zeros(len(graphs), vmax)
    for b, (adjacency, nodes) in enumerate(graphs):
        v = len(nodes)
        a[b, :v, :v] = torch.as_tensor(np.asarray(adjacency, dtype=np.float32).reshape(v, v))
        for i, t in enumerate(nodes):
            if t not in types:
                raise ValueError(f"NeuralPredictor: node type {t!r} is not one of {types}")
            x[b, i, types.index(t)] = 1.0
        mask[b, :v] = 1.0
    return a, x, mask


def normalized(a: torch.Tensor) -> torch.Tensor:
    """Row-normalized ``A + I``: each node averages itself and the nodes it reads."""
    a = a + torch.eye(a.shape[-1])
    return a / a.sum(-1, keepdim=True)


class GCN(nn.Module):
    """The paper's predictor: bidirectional graph convolutions, the mean of the node
    embeddings, a fully connected head.

    Layer l: ``H' = ReLU((Â_fwd H W_fwd + Â_bwd H W_bwd) / 2)`` with ``Â_fwd`` the
    row-normalized ``A + I`` (a node gathers from its successors' direction of the edges) and
    ``Â_bwd`` that of ``A^T + I`` (the other direction). The graph's embedding is the mean of
    its real nodes' (padding masked out) and ``Linear -> ReLU -> Linear`` gives the score.
    Propagation and the mean are equivariant and invariant to a renumbering of the nodes, so
    isomorphic cells get the same prediction.
    """

    def __init__(self, features: int, hidden: int = 144, layers: int = 3):
        super().__init__()
        self.fwd = nn.ModuleList(nn.Linear(features if i == 0 else hidden, hidden)
                                 for i in range(layers))
        self.bwd = nn.ModuleList(nn.Linear(features if i == 0 else hidden, hidden)
                                 for i in range(layers))
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, a: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a_fwd, a_bwd = normalized(a), normalized(a.transpose(1, 2))  # (B, V, V)
        h = x  # (B, V, F)
        for fwd, bwd in zip(self.fwd, self.bwd):
            h = torch.relu((a_fwd @ fwd(h) + a_bwd @ bwd(h)) / 2)  # (B, V, F) -> (B, V, hidden)
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # (B, hidden)
        return self.head(pooled).squeeze(-1)  # (B,)


def fit_gcn(graphs: list, y: list[float], types: list[str], seed: int, epochs: int,
            hidden: int, layers: int, lr: float) -> GCN:
    """A GCN trained by full-batch Adam on the mean squared error of standardized ``y``,
    deterministic for a ``seed`` (the paper: 300 epochs, Adam, hidden 144, 3 layers)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GCN(len(types), hidden, layers)
        a, x, mask = batch_graphs(graphs, types)
        target = torch.tensor(y, dtype=torch.float32)
        target = (target - target.mean()) / (target.std() if len(y) > 1 and target.std() > 0
                                             else 1.0)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-3)
        for _ in range(epochs):
            optimizer.zero_grad()
            loss = ((model(a, x, mask) - target) ** 2).mean()
            loss.backward()
            optimizer.step()
    return model.eval()


def predict(model: GCN, graphs: list, types: list[str]) -> list[float]:
    with torch.no_grad():
        return model(*batch_graphs(graphs, types)).tolist()


class NeuralPredictor(Strategy):
    """Wen et al.'s search: N random models train a GCN predictor, which ranks a large random
    sample of the space; the K predicted best are proposed, best first.

    The first ``n_train`` proposals are random (the paper: N = 172 on NAS-Bench-101). Then a
    :class:`GCN` is fitted on the told results (failed models left out), ``n_candidates``
    new random models are drawn and ranked, and the ``top_k`` best are queued. When the queue
    runs out while budget remains, the predictor is refitted on every told result and the
    next K are drawn the same way (the paper stops after one round). A sample becomes a graph
    through ``graph``, the import reference of a function ``sample -> (adjacency, node
    types)`` (``model_spaces.nasbench101:cell_graph`` for NAS-Bench-101's cells).

    Example:
        >>> from model_spaces.nasbench101 import NODE_TYPES
        >>> s = NeuralPredictor(graph="model_spaces.nasbench101:cell_graph", types=NODE_TYPES,
        ...                     n_train=4, top_k=2, n_candidates=50, epochs=20, seed=0)
        >>> s.random_startup()
        (4, 'n_train=4')

    Args:
        graph: ``"module:function"`` of the sample -> (adjacency, types) function.
        types: the node types the one-hot features have columns for, in order.
        n_train: N, random models before the predictor is used.
        n_candidates: models drawn and ranked per round (the paper: the whole benchmark).
        top_k: K, the predicted best proposed per round.
        hidden, layers, epochs, lr: the GCN's width, depth, and training.
        seed, mode, dedup, max_models, max_time, clock: see :class:`~.base.Strategy`.
    """

    accepts_foreign = True
    max_duplicate_tries = 4

    def __init__(self, *, graph: str, types: list[str] | tuple[str, ...], n_train: int = 172,
                 n_candidates: int = 1000, top_k: int = 10, hidden: int = 144, layers: int = 3,
                 epochs: int = 300, lr: float = 1e-3, seed: int | None = None, **common: Any):
        super().__init__(seed=seed, **common)
        for name, value, low in (("n_train", n_train, 2), ("n_candidates", n_candidates, 1),
                                 ("top_k", top_k, 1), ("hidden", hidden, 1),
                                 ("layers", layers, 1), ("epochs", epochs, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"NeuralPredictor: {name} must be an int >= {low}, "
                                 f"got {value!r}")
        self._graph_fn = graph_function(graph)
        self.graph, self.types = graph, list(types)
        self.n_train, self.n_candidates, self.top_k = n_train, n_candidates, top_k
        self.hidden, self.layers, self.epochs, self.lr = hidden, layers, epochs, lr
        self._queue: list[dict] = []  # the round's ranked proposals, best first
        self._rounds = 0

    def _ranked(self, space: Any) -> list[dict]:
        """The top K of ``n_candidates`` new random samples by a GCN fitted on the told."""
        told = list(self._observations())
        model = fit_gcn([self._graph_fn(s) for s, _ in told], [v for _, v in told],
                        self.types, self._rng.randrange(2 ** 31), self.epochs, self.hidden,
                        self.layers, self.lr)
        candidates, seen = [], set()
        for _ in range(self.n_candidates):
            sample = self._random_draw(space).sample
            key = sample_key(sample)
            if key not in seen and key not in self._records:
                seen.add(key)
                candidates.append(sample)
        if not candidates:
            return []
        scores = predict(model, [self._graph_fn(s) for s in candidates], self.types)
        order = sorted(range(len(candidates)), key=lambda i: (-scores[i], i))
        return [candidates[i] for i in order[:self.top_k]]

    def _propose(self, space: Any) -> Draw:
        while self._queue and sample_key(self._queue[0]) in self._records:
            self._queue.pop(0)  # proposed meanwhile (a foreign tell): skip it
        if not self._queue and len(list(self._observations())) >= self.n_train:
            self._queue, self._rounds = self._ranked(space), self._rounds + 1
        if not self._queue:  # still training the predictor's N, or no new candidate
            return self._random_draw(space)
        return draw(space, ReplaySampler(self._queue.pop(0)))

    def random_startup(self) -> tuple[int, str] | None:
        return self.n_train, f"n_train={self.n_train}"

    def config(self) -> dict:
        return {**super().config(), "graph": self.graph, "types": self.types,
                "n_train": self.n_train, "n_candidates": self.n_candidates,
                "top_k": self.top_k, "hidden": self.hidden, "layers": self.layers,
                "epochs": self.epochs, "lr": self.lr}

    def _state(self) -> dict:
        return {"queue": [dict(s) for s in self._queue], "rounds": self._rounds}

    def _load_state(self, state: dict) -> None:
        self._queue = [dict(s) for s in state["queue"]]
        self._rounds = state["rounds"]
