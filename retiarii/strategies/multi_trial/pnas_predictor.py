"""PNAS's surrogate (Liu et al., ECCV 2018): an ensemble of MLPs over a cell's blocks, each block
the concatenated embeddings of its tokens, the cell the mean of its blocks, so a predictor
trained on cells of b blocks scores cells of b + 1."""
from __future__ import annotations

import torch
from torch import nn


def block_tokens(sample: dict) -> list[list[str]]:
    """A sample's blocks as token lists: labels ``"<block>/<field>"`` grouped by block (in the
    sample's order), each token ``"<field>=<value>"`` in field order; other labels (the
    depth, say) are not part of a block.

    Example:
        >>> block_tokens({"blocks": 2, "b0/input_a": 0, "b0/op_a": "identity",
        ...               "b1/input_a": 2, "b1/op_a": "max_pool_3x3"})
        [['input_a=0', 'op_a=identity'], ['input_a=2', 'op_a=max_pool_3x3']]
    """
    blocks: dict[str, list[tuple[str, str]]] = {}
    for label, value in sample.items():
        block, sep, field = label.partition("/")
        if sep:
            blocks.setdefault(block, []).append((field, f"{field}={value}"))
    return [[token for _, token in sorted(fields)] for fields in blocks.values()]


class BlockMLP(nn.Module):
    """One predictor: token embeddings, concatenated per block, averaged over the blocks, an
    MLP to one score: ``(B, blocks, tokens)`` ids -> ``(B,)``."""

    def __init__(self, vocabulary: int, tokens: int, embedding: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, embedding)
        self.mlp = nn.Sequential(nn.Linear(tokens * embedding, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        e = self.embed(ids).flatten(2)  # (B, K, T) -> (B, K, T * E)
        cell = (e * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # (B, T * E)
        return self.mlp(cell).squeeze(-1)


class Ensemble:
    """``members`` BlockMLPs, member i trained on the told cells but fold i (PNAS: 5, each on
    4/5 of the data); a prediction is the members' mean.

    Args:
        members: how many predictors (and folds).
        embedding, hidden: the token embedding and the MLP's width (the paper: 100 each).
        epochs, lr: full-batch Adam steps and rate of each member.
    """

    def __init__(self, members: int = 5, embedding: int = 16, hidden: int = 64,
                 epochs: int = 200, lr: float = 1e-2):
        self.members, self.embedding, self.hidden = members, embedding, hidden
        self.epochs, self.lr = epochs, lr
        self.models: list[BlockMLP] = []
        self.folds: list[list[int]] = []  # the told indices each member was trained on
        self.vocabulary: dict[str, int] = {}

    def _encode(self, samples: list[dict], grow: bool = False):
        """(N samples) -> token ids ``(N, blocks, tokens)`` (0: padding or a token met after
        the fit) and the blocks' mask ``(N, blocks)``."""
        cells = [block_tokens(s) for s in samples]
        k = max(1, max(len(c) for c in cells))
        t = max(1, max((len(b) for c in cells for b in c), default=1))
        ids, mask = torch.zeros(len(cells), k, t, dtype=torch.long), torch.zeros(len(cells), k)
        for i, cell in enumerate(cells):
            for j, block in enumerate(cell):
                mask[i, j] = 1.0
                for n, token in enumerate(block):
                    if grow:
                        self.vocabulary.setdefault(token, len(self.vocabulary) + 1)
                    ids[i, j, n] = self.vocabulary.get(token, 0)
        return ids, mask

    def fit(self, samples: list[dict], y: list[float], seed: int,
            vocabulary_of: list[dict] = ()) -> "Ensemble":
        """Trains the members; ``vocabulary_of``: samples whose tokens get rows too (the
        candidates, so their new block's tokens have an embedding, untrained)."""
        self._encode([*samples, *vocabulary_of], grow=True)  # the vocabulary, in a fixed order
        ids, mask = self._encode(samples)
        target = torch.tensor(y, dtype=torch.float32)
        spread = target.std() if len(y) > 1 and target.std() > 0 else torch.tensor(1.0)
        self.mean, self.spread = target.mean(), spread
        target = (target - self.mean) / spread
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            order = torch.randperm(len(y)).tolist()
            self.models, self.folds = [], []
            for m in range(self.members):
                held = set(order[m::self.members]) if len(y) >= self.members else set()
                train = [i for i in range(len(y)) if i not in held]
                model = BlockMLP(len(self.vocabulary) + 1, ids.shape[2], self.embedding,
                                 self.hidden)
                optimizer = torch.optim.Adam(model.parameters(), lr=self.lr)
                for _ in range(self.epochs):
                    optimizer.zero_grad()
                    loss = ((model(ids[train], mask[train]) - target[train]) ** 2).mean()
                    loss.backward()
                    optimizer.step()
                self.models.append(model.eval())
                self.folds.append(train)
        return self

    def member_predictions(self, samples: list[dict]) -> torch.Tensor:
        """``(members, N)`` predictions, in the told values' units."""
        ids, mask = self._encode(samples)
        with torch.no_grad():
            return torch.stack([m(ids, mask) for m in self.models]) * self.spread + self.mean

    def predict(self, samples: list[dict]) -> list[float]:
        """The members' mean for each sample."""
        return self.member_predictions(samples).mean(0).tolist()


def fit_ensemble(samples: list[dict], y: list[float], seed: int,
                 candidates: list[dict] = ()) -> Ensemble:
    """An :class:`Ensemble` fitted on (samples, y), deterministic for ``seed``."""
    return Ensemble().fit(samples, y, seed, vocabulary_of=candidates)


def rank_by_ensemble(told: list[tuple[dict, float]], candidates: list[dict],
                     seed: int) -> list[int]:
    """Indices of ``candidates`` from best to worst by the mean of an ensemble fitted on
    ``told`` (sample, score higher-is-better); ties by index."""
    ensemble = fit_ensemble([s for s, _ in told], [v for _, v in told], seed, candidates)
    predicted = ensemble.predict(candidates)
    return sorted(range(len(candidates)), key=lambda i: (-predicted[i], i))
