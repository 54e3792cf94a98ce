"""Weight Agnostic Neural Networks (Gaier & Ha, NeurIPS 2019): an evolving space grown from a
minimal network by inserting nodes, adding connections and changing activations, every
connection carrying one shared weight value.

The minimal network connects the (flattened) inputs straight to the outputs. A *connection*
(:class:`Connection`) maps one layer into another through a fixed sparse 0/1 mask (drawn
from its seed, never trained) times the shared weight ``w``; a *node* is a layer of
``hidden`` units that sums its incoming connections and applies one activation::

    minimal:   x ─[w·M0]─▶ Σ_out = logits
    grown:     x ─[w·M1]─▶ Σ ─▶ sin ─[w·M2]─▶ Σ_out          (after "insert node")
               └──────────[w·M3]─────────────▲              (after "add connection")

Every step of :class:`WANNMutator` (open-ended: it grows while ``"wann/grow{i}"`` says True)
applies one of WANN's three mutations, ``"wann/kind{i}"``:

* ``insert_node``: split a connection ``a -[M]-> Σ`` into ``a -[M']-> Σ' -> act -[M'']-> Σ``;
* ``add_connection``: a new connection from a layer (or the input) into a later node's sum;
* ``change_activation``: give a node another of WANN's 10 activations (linear, step, sin,
  cos, gaussian, tanh, sigmoid, inverse, abs, relu).

The shared weight is the model's one parameter (``weight``, read by every connection). WANN
does not train it: ``retiarii.weight_agnostic.WANNTrainer`` scores a network over a fixed
series of shared values ([-2, -1, -0.5, 0.5, 1, 2]) and the ``WANN`` strategy ranks by mean
accuracy, connections and max accuracy. NOTE: a node here is a layer of ``hidden`` units (WANN's
nodes are single units), which keeps the graphs small on 64 input pixels.

The space is unbounded (``size()`` is ``math.inf``). The row runs ``WANN`` (regularized
evolution from the minimal network, then its mutants, as WANN's population starts, with
WANN's ranking). Presets: :func:`small` 8x8 digits with 16 units per node; :func:`paper`
takes the same minimal network (WANN's networks are its evolved ones: there is no larger
published size) on ``in_channels x image_size ** 2`` inputs with 32 units per node.

Example::

    >>> space = small()
    >>> space.base_model().sample
    {'wann/grow0': False}
"""
from __future__ import annotations

import torch
from torch import nn

import retiarii as rt
from retiarii import ops

ACTIVATIONS = ("linear", "step", "sin", "cos", "gaussian", "tanh", "sigmoid", "inverse", "abs",
               "relu")
KINDS = ("insert_node", "add_connection", "change_activation")


@rt.leaf
class Activation(nn.Module):
    """One of WANN's activations, by name: (B, N) -> (B, N)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.name == "step":
            return (x > 0).to(x.dtype)
        if self.name == "sin":
            return torch.sin(torch.pi * x)
        if self.name == "cos":
            return torch.cos(torch.pi * x)
        if self.name == "gaussian":
            return torch.exp(-x * x / 2)
        if self.name == "tanh":
            return torch.tanh(x)
        if self.name == "sigmoid":
            return torch.sigmoid(x)
        if self.name == "inverse":
            return -x
        if self.name == "abs":
            return x.abs()
        if self.name == "relu":
            return torch.relu(x)
        return x


@rt.leaf
class Connection(nn.Module):
    """``w * (x @ M)``, M a fixed 0/1 mask of density 1/2 drawn from ``seed``: (B, N_in), () ->
    (B, N_out). The mask is a non-persistent buffer: rebuilt from the seed, never trained.

    ``trained``: the paper's "trained weights" setting, each connection its own weight
    (``own``, of the mask's shape), ``w * (x @ (M * own))``; ``own`` starts at 1, so the
    network starts as the weight-agnostic one with shared value ``w``, and an absent
    connection (a zero of M) stays absent: its gradient is M's zero."""

    def __init__(self, in_features: int, out_features: int, seed: int, trained: bool = False):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        mask = (torch.rand(in_features, out_features, generator=generator) < 0.5).float()
        self.register_buffer("mask", mask / in_features ** 0.5, persistent=False)
        self.trained = trained
        if trained:
            self.own = nn.Parameter(torch.ones(in_features, out_features))

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.trained:
            return (x @ (self.mask * self.own)) * weight
        return (x @ self.mask) * weight


def _trained(trained: bool) -> dict:
    # passed only when on, so the search's connection specs (and model hashes) stay as they were
    return {"trained": True} if trained else {}


class MinimalNet(nn.Module):
    """Inputs straight to outputs through one connection; ``weight`` is the shared value
    (``trained``: each connection its own weights too, see :class:`Connection`)."""

    def __init__(self, in_features: int, num_classes: int, trained: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(1.0))
        self.flatten = nn.Flatten()
        self.conn_out = Connection(in_features, num_classes, 0, **_trained(trained))
        self.out = ops.Sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.conn_out(self.flatten(x), self.weight))


class WANNMutator(rt.Mutator):
    """WANN's three mutations, one per step, while ``"wann/grow{i}"`` says True
    (``trained``: the connections it creates hold their own weights, see :class:`Connection`)."""

    open_ended = True

    def __init__(self, in_features: int, hidden: int, num_classes: int, trained: bool = False):
        super().__init__("wann")
        self.in_features, self.hidden, self.num_classes = in_features, hidden, num_classes
        self.trained = trained

    # -- what the graph holds -------------------------------------------------------------

    def _of(self, cls: type) -> list:
        return [n for n in self.graph.nodes if n.kind == "module" and n.op.spec
                and n.op.spec["cls"].endswith(f":{cls.__qualname__}")]

    def _width(self, node) -> int:
        """Units of a layer: the input, a node's activation, or a sum."""
        if node.name == "flatten":
            return self.in_features
        return self.num_classes if node.name == "out" else self.hidden

    def _sums(self) -> list:
        return [n for n in self.graph.nodes if n.name == "out" or n.name.endswith("_sum")]

    def _new_pairs(self) -> dict[str, tuple]:
        """``"src->sum"``: (src, sum) for every layer not yet connected into a later sum."""
        sources = [self.graph["flatten"]] + self._of(Activation)
        pairs = {}
        for dst in self._sums():
            fed = {conn.inputs[0].name for conn in dst.inputs}
            for src in sources:
                if src.name not in fed and not self.graph.reaches(dst, src):
                    pairs[f"{src.name}->{dst.name}"] = (src, dst)
        return pairs

    # -- the mutations ----------------------------------------------------------------------

    def _connect_layers(self, i: int, src, dst, suffix: str) -> None:
        conn = self.create_node(f"wann_{i}_{suffix}", Connection(
            self._width(src), self._width(dst), 3 * i + {"in": 1, "out": 2, "add": 3}[suffix],
            **_trained(self.trained)))
        self.connect(src, conn)
        self.connect("weight", conn)
        self.connect(conn, dst)

    def insert_node(self, i: int) -> None:
        conns = {n.name: n for n in self._of(Connection)}
        conn = self.choose(conns, label=f"wann/connection{i}")
        src, dst = conn.inputs[0], conn.users[0]
        act = self.choose(list(ACTIVATIONS), label=f"wann/act{i}")
        total = self.create_node(f"wann_{i}_sum", ops.Sum())
        node = self.create_node(f"wann_{i}_act", Activation(act))
        self.connect(total, node)
        self.disconnect(conn, dst)
        self.delete_node(conn)
        self._connect_layers(i, src, total, "in")
        self._connect_layers(i, node, dst, "out")

    def add_connection(self, i: int) -> None:
        src, dst = self.choose(self._new_pairs(), label=f"wann/pair{i}")
        self._connect_layers(i, src, dst, "add")

    def change_activation(self, i: int) -> None:
        node = self.choose({n.name: n for n in self._of(Activation)}, label=f"wann/node{i}")
        current = node.op.spec["args"][0]
        act = self.choose([a for a in ACTIVATIONS if a != current], label=f"wann/act{i}")
        self.replace(node, Activation(act))

    def mutate(self, targets):
        i = 0
        while self.choose([False, True], label=f"wann/grow{i}"):
            kinds = ["insert_node"]
            if self._new_pairs():
                kinds.append("add_connection")
            if self._of(Activation):
                kinds.append("change_activation")
            getattr(self, self.choose(kinds, label=f"wann/kind{i}"))(i)
            i += 1


def wann_space(in_features: int, hidden: int, num_classes: int, example: torch.Tensor,
               trained: bool = False):
    """The WANN space from the minimal network; see the module docstring. ``trained``: the
    same architectures (a sample replays to the same topology and masks) with each
    connection's own trainable weights, as ``nas run wann`` retrains its selection."""
    return rt.ModelSpace(MinimalNet(in_features, num_classes, trained),
                         [WANNMutator(in_features, hidden, num_classes, trained)],
                         example_input=example)


def small(in_channels: int = 1, num_classes: int = 10, image_size: int = 8,
          trained: bool = False) -> rt.ModelSpace:
    """64 input pixels, nodes of 16 units."""
    return wann_space(in_channels * image_size ** 2, 16, num_classes,
                      torch.zeros(1, in_channels, image_size, image_size), trained)


def paper(in_channels: int = 3, num_classes: int = 10, image_size: int = 32,
          trained: bool = False) -> rt.ModelSpace:
    """The same minimal network on larger images, nodes of 32 units."""
    return wann_space(in_channels * image_size ** 2, 32, num_classes,
                      torch.zeros(1, in_channels, image_size, image_size), trained)
