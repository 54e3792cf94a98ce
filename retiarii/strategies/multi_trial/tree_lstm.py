"""A bidirectional tree-structured LSTM over path-level NAS's cell trees, and the
meta-controller's per-node decision heads (Cai et al., ICML 2018, Section 4).

A tree is path_tree's nested lists (``["op", name]``, ``["add" | "concat" | "seq", [...]]``).
The encoder runs two passes:

* bottom-up, a child-sum tree-LSTM (Tai et al., ACL 2015): a node's state from its own token
  (its op name or merge scheme, plus its place among its siblings: a ``seq`` is ordered) and
  its children's states, each child's memory through its own forget gate;
* top-down, an LSTM cell stepping from the parent's top-down state with the node's bottom-up
  state as input, so a node also sees where it sits in the whole cell.

A node's encoding is both states, concatenated (2H); the heads turn it into logits over the
transformations at that node and over a new edge's operation. No framework of our own is
involved: tests drive it with plain trees.

Example::

    enc = TreeLSTM(tokens=["op:conv_3x3", "op:identity", "seq"], hidden=16, seed=0)
    states = enc(["seq", [["op", "conv_3x3"], ["op", "identity"]]])
    states["r.1"].shape        # torch.Size([32])
"""
from __future__ import annotations

import torch
from torch import nn

MAX_SIBLINGS = 8  # places among siblings with their own embedding (more share the last)


def token(tree: list) -> str:
    """A node's token: ``"op:<name>"`` for an edge, its merge scheme otherwise."""
    return f"op:{tree[1]}" if tree[0] == "op" else tree[0]


class TreeLSTM(nn.Module):
    """Bidirectional tree-LSTM: ``forward(tree) -> {path: (2H,) encoding}``."""

    def __init__(self, tokens: list[str], hidden: int, seed: int, init_scale: float = 0.1):
        super().__init__()
        self.tokens = {t: i for i, t in enumerate(tokens)}
        self.hidden = hidden
        self.embed = nn.Embedding(len(tokens), hidden)
        self.place = nn.Embedding(MAX_SIBLINGS, hidden)
        self.w_iou = nn.Linear(hidden, 3 * hidden)  # input, output, update gates from x
        self.u_iou = nn.Linear(hidden, 3 * hidden, bias=False)  # ... from the children's sum
        self.w_f = nn.Linear(hidden, hidden)  # one forget gate per child
        self.u_f = nn.Linear(hidden, hidden, bias=False)
        self.down = nn.LSTMCell(hidden, hidden)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # near-uniform first policy, reproducible from the seed
            for p in self.parameters():
                p.uniform_(-init_scale, init_scale, generator=generator)

    def _x(self, tree: list, place: int) -> torch.Tensor:
        if token(tree) not in self.tokens:
            raise ValueError(f"tree token {token(tree)!r} is not one of {list(self.tokens)}")
        return (self.embed.weight[self.tokens[token(tree)]]
                + self.place.weight[min(place, MAX_SIBLINGS - 1)])  # (H,)

    def _up(self, tree: list, path: str, place: int, out: dict) -> tuple:
        """Child-sum step: (h, c) of the node at ``path``, children first; fills ``out``."""
        children = [] if tree[0] == "op" else [
            self._up(sub, f"{path}.{i}", i, out) for i, sub in enumerate(tree[1])]
        x = self._x(tree, place)
        h_sum = sum((h for h, _ in children), torch.zeros(self.hidden))
        i, o, u = (self.w_iou(x) + self.u_iou(h_sum)).chunk(3)  # 3 x (H,)
        c = torch.sigmoid(i) * torch.tanh(u)
        for h_k, c_k in children:  # each child's memory through its own forget gate
            c = c + torch.sigmoid(self.w_f(x) + self.u_f(h_k)) * c_k
        h = torch.sigmoid(o) * torch.tanh(c)
        out[path] = h
        return h, c

    def forward(self, tree: list) -> dict[str, torch.Tensor]:
        up: dict[str, torch.Tensor] = {}
        self._up(tree, "r", 0, up)
        zeros = torch.zeros(1, self.hidden)
        states: dict[str, tuple] = {}
        encoded: dict[str, torch.Tensor] = {}
        for path in sorted(up, key=lambda p: p.count(".")):  # parents before children
            parent = path.rpartition(".")[0]
            state = states[parent] if parent else (zeros, zeros)
            states[path] = self.down(up[path].unsqueeze(0), state)  # (1, H) each
            encoded[path] = torch.cat([up[path], states[path][0][0]])  # (2H,)
        return encoded


class Heads(nn.Module):
    """Per-node logits: over the transformations (``actions``) and a new edge's ``ops``."""

    def __init__(self, hidden: int, actions: int, ops: int, seed: int,
                 init_scale: float = 0.1):
        super().__init__()
        self.action = nn.Linear(2 * hidden, actions)  # (2H,) -> (actions,)
        self.op = nn.Linear(2 * hidden, ops)  # (2H,) -> (ops,)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.uniform_(-init_scale, init_scale, generator=generator)

    @staticmethod
    def masked_log_softmax(logits: torch.Tensor, allowed: list[bool],
                           tanh_constant: float | None) -> torch.Tensor:
        """Log-probabilities over the allowed entries (the others: -inf)."""
        if tanh_constant is not None:  # bounds the logits so no candidate's odds vanish
            logits = tanh_constant * torch.tanh(logits)
        mask = torch.tensor(allowed)
        return torch.log_softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
