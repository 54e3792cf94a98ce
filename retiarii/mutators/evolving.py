"""Evolving mutators: open-ended growth, as in Weight Agnostic Networks and Large-Scale Evolution.

Each makes ``steps`` edits, one random location and one candidate per step:

* :class:`AddNodeMutator` splits an edge with a new node::

      a ─▶ b          becomes          a ─▶ new ─▶ b

* :class:`AddEdgeMutator` adds a skip edge from an earlier node into a later one's input,
  through a variadic merge (a ``Sum``); only earlier nodes are offered, so no cycle forms::

      a ─▶ b ─▶ c     becomes          a ─▶ b ─▶ c_merge ─▶ c       (c_merge = Sum(b, a))
                                       └────────▲

* :class:`ChangeActivationMutator` replaces one activation by another::

      a ─▶ relu ─▶ b  becomes          a ─▶ tanh ─▶ b

With ``steps=None`` a mutator keeps going while a choice ``"{label}/grow{i}"`` says True
(default False, so the first candidate of every choice is still the base model): the space
is unbounded, the mutator is ``open_ended``, ``space.size()`` is ``math.inf`` and
``space.enumerate()`` refuses. When the space has an ``example_input``, edges are only
split where a tensor flows, and skip edges only offered between tensors of the same shape.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..codec import ref_of, resolve_ref
from ..graph import Node, Operation
from ..mutator import Mutator, is_variadic
from ._common import COMPUTING, flat_targets, is_tensor_shape, operation_of, same_op, \
    shapes_of, steps

_ACTIVATION_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU,
                       nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh,
                       nn.Hardsigmoid, nn.Hardswish, nn.Softplus, nn.Softsign, nn.Tanhshrink,
                       nn.LogSigmoid)
_ACTIVATION_FUNCTIONS = {ref_of(f) for f in (
    torch.relu, torch.tanh, torch.sigmoid, torch.sin, torch.cos, torch.abs, F.relu, F.relu6,
    F.leaky_relu, F.elu, F.selu, F.gelu, F.silu, F.mish, F.softplus, F.hardtanh,
    F.hardswish, F.hardsigmoid, F.logsigmoid, F.tanh, F.sigmoid)}
_ACTIVATION_METHODS = {"relu", "tanh", "sigmoid", "sin", "cos", "abs"}


def _safe_name(label: str) -> str:
    return re.sub(r"\W", "_", label)


def _region(mutator: Mutator, targets: list) -> set[int] | None:
    """uids a growing mutator may work on: the targets and every node created so far; None
    (the whole graph) when unbound."""
    if not targets:
        return None
    return {n.uid for n in flat_targets(targets)} | set(mutator._ctx.created)


def is_activation(node: Node, also: Sequence[Operation] = ()) -> bool:
    """A node computing a known activation (module, function or method), or one of ``also``."""
    if node.kind == "module":
        try:
            cls = resolve_ref(node.op.spec["cls"])
        except (ImportError, AttributeError, KeyError, TypeError):
            cls = None
        if isinstance(cls, type) and issubclass(cls, _ACTIVATION_MODULES):
            return True
    elif node.kind == "function" and node.op.target in _ACTIVATION_FUNCTIONS:
        return True
    elif node.kind == "method" and node.op.target in _ACTIVATION_METHODS:
        return True
    return any(same_op(node, op) for op in also)


class AddNodeMutator(Mutator):
    """Split an edge ``a -> b`` with a new node ``a -> new -> b``, ``steps`` times.

    Example::

        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> space = rt.ModelSpace(net, [AddNodeMutator([nn.Tanh(), nn.Sigmoid()])])
        >>> model = space.replay({"addnodemutator0/edge0": "0->1",
        ...                       "addnodemutator0/op0": "Tanh"})
        >>> [n.name for n in model.graph.nodes]
        ['input', '0', 'addnodemutator0_0', '1', '2', 'output']

    Args:
        candidates: the ops a new node may compute (modules, functions, Graphs; or a dict
            of name -> op). Shape-preserving ops (activations, identity, lazy layers) keep
            every model runnable.
        steps: how many nodes to add; ``None``: open-ended (see the module docstring).
        label: the mutator's label. Choices are ``"{label}/edge{i}"`` (keys ``"a->b"``, with
            ``"[port]"`` when ``a`` feeds ``b`` twice) and ``"{label}/op{i}"``.

    Bound with :func:`~retiarii.apply_mutator`, only edges into the targets (and into nodes
    created while building the model) are split.
    """

    def __init__(self, candidates: Sequence[Any] | dict[str, Any], steps: int | None = 1,
                 label: str | None = None):
        super().__init__(label)
        self.candidates, self.steps = candidates, steps
        self.open_ended = steps is None

    def _edges(self, region: set[int] | None) -> dict[str, tuple[Node, Node, int]]:
        shapes = shapes_of(self, "", required=False)
        g = self.graph
        out: dict[str, tuple[Node, Node, int]] = {}
        for dst in g.nodes:
            if region is not None and dst.uid not in region:
                continue
            for port, src in enumerate(dst.inputs):
                if src is None or src.kind in ("param", "constant"):
                    continue
                if shapes is not None and not is_tensor_shape(shapes.get(src.uid)):
                    continue
                key = f"{src.name}->{dst.name}"
                out[key if key not in out else f"{key}[{port}]"] = (src, dst, port)
        return out

    def mutate(self, targets):
        region = _region(self, targets)
        for i in steps(self, self.steps):
            src, dst, port = self.choose(self._edges(region), label=f"{self._name}/edge{i}")
            op = operation_of(self, self.choose(self.candidates, label=f"{self._name}/op{i}"))
            new = self.create_node(f"{_safe_name(self._name)}_{i}", op)
            self.connect(src, new)
            self.connect(new, dst, port)


class AddEdgeMutator(Mutator):
    """Add a skip edge from an earlier node into a later node's first input, ``steps`` times.

    A variadic destination (``ops.Sum``, ``torch.cat``) gets one more input; any other gets a
    ``Sum`` merge node on its first input, fed by the old input and the new edge.

    Example::

        >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
        >>> space = rt.ModelSpace(net, [AddEdgeMutator()], example_input=torch.randn(2, 4))
        >>> model = space.replay({"addedgemutator0/dst0": "2", "addedgemutator0/src0": "0"})
        >>> [i.name for i in model.graph["2_merge"].inputs]
        ['1', '0']

    Args:
        steps: how many edges to add; ``None``: open-ended (see the module docstring).
        merge: the variadic module that merges a skip edge into a non-variadic node
            (``ops.Sum``; ``ops.Mean``; ``ops.Concat`` needs lazy layers downstream).
        label: the mutator's label. Choices are ``"{label}/dst{i}"`` and
            ``"{label}/src{i}"`` (node names).

    Bound with :func:`~retiarii.apply_mutator`, only targets (and nodes created while
    building the model) receive edges; sources may be any earlier node.
    """

    def __init__(self, steps: int | None = 1, merge: type[nn.Module] = ops.Sum,
                 label: str | None = None):
        super().__init__(label)
        self.steps, self.merge = steps, merge
        self.open_ended = steps is None

    def _pairs(self, region: set[int] | None) -> dict[str, tuple[Node, dict[str, Node]]]:
        """dst name -> (dst, {src name: src}) for every destination with a source."""
        shapes = shapes_of(self, "", required=False)
        pairs: dict[str, tuple[Node, dict[str, Node]]] = {}
        earlier: list[Node] = []
        for dst in self.graph.nodes:  # graph order: every earlier node is upstream or apart
            inputs = dst.inputs
            if dst.kind in COMPUTING and inputs and (region is None or dst.uid in region):
                # the new input must have the shape of the first (what a Sum adds it to)
                want = shapes.get(inputs[0].uid) if shapes is not None else None
                srcs = {s.name: s for s in earlier if s not in inputs and (
                    shapes is None or (want is not None and shapes.get(s.uid) == want))}
                if srcs:
                    pairs[dst.name] = (dst, srcs)
            if dst.kind in COMPUTING + ("input",):
                earlier.append(dst)
        return pairs

    def mutate(self, targets):
        region = _region(self, targets)
        for i in steps(self, self.steps):
            pairs = self._pairs(region)
            dst, srcs = self.choose(pairs, label=f"{self._name}/dst{i}")
            src = self.choose(srcs, label=f"{self._name}/src{i}")
            if is_variadic(dst):
                self.connect(src, dst)
                continue
            merge = self.create_node(f"{dst.name}_merge", self.merge())
            self.connect(dst.inputs[0], merge)
            self.connect(src, merge)
            self.connect(merge, dst, 0)


class ChangeActivationMutator(Mutator):
    """Replace one activation node by a different candidate, ``steps`` times.

    Example::

        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Sigmoid())
        >>> space = rt.ModelSpace(net, [ChangeActivationMutator([nn.ReLU(), torch.tanh,
        ...                                                      torch.sin])])
        >>> model = space.replay({"changeactivationmutator0/node0": "3",
        ...                       "changeactivationmutator0/act0": "torch.sin"})
        >>> model.graph["3"]
        Node('3', sin, uid=4)

    Args:
        candidates: the activations to change to (modules or functions; or a dict of name ->
            activation). Offered minus the node's current activation.
        steps: how many changes; ``None``: open-ended (see the module docstring).
        label: the mutator's label. Choices are ``"{label}/node{i}"`` (node names) and
            ``"{label}/act{i}"``.

    Unbound, every activation node is a target: known ``torch.nn`` activation layers,
    activation functions and methods, and nodes computing one of ``candidates`` (such as
    those an :class:`AddNodeMutator` created). Bound, the matched nodes are.
    """

    def __init__(self, candidates: Sequence[Any] | dict[str, Any], steps: int | None = 1,
                 label: str | None = None):
        super().__init__(label)
        self.candidates, self.steps = candidates, steps
        self.open_ended = steps is None

    def mutate(self, targets):
        named = self.candidates if isinstance(self.candidates, dict) else None
        values = list(named.values()) if named else list(self.candidates)
        known = [operation_of(self, v) for v in values]
        for i in steps(self, self.steps):
            nodes = flat_targets(targets) if targets else \
                [n for n in self.graph.nodes if is_activation(n, known)]
            node = self.choose({n.name: n for n in nodes}, label=f"{self._name}/node{i}")
            keep = [not same_op(node, op) for op in known]
            options = {k: v for (k, v), ok in zip(named.items(), keep) if ok} if named \
                else [v for v, ok in zip(values, keep) if ok]
            self.replace(node, operation_of(self, self.choose(options,
                                                              label=f"{self._name}/act{i}")))
