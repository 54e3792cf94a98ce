"""Mutators: graph edits that define a model space.

Subclass :class:`Mutator`, implement ``mutate(self, targets)``, and edit the graph with the
primitives ``choose``, ``create_node``, ``delete_node``, ``connect``, ``disconnect`` and
``replace``. ``choose`` defers to the space's sampler, so one mutator yields many models and a
strategy never sees the space's code. Every primitive call is recorded (the mutation history).

The paper's Inception example::

    class InceptionMutator(retiarii.Mutator):
        def mutate(self, targets):
            relu, maxpool, dense = targets
            n = self.choose([2, 3, 4, 5], label="paths")
            self.delete_node(maxpool)
            merge = self.create_node("merge", retiarii.ops.Sum())
            for i in range(n):
                path = self.create_node(f"path{i}", self.choose([conv, dconv, pool]))
                self.connect(relu, path)
                self.connect(path, merge)
            self.connect(merge, dense)

    space = retiarii.ModelSpace(Net(), [retiarii.apply_mutator(["relu", "maxpool", "dense"],
                                                               InceptionMutator())])

Every primitive reads alike: (1) resolve and check its arguments, naming the mutator, the
primitive and the node on failure, (2) edit the graph, (3) record the edit in the history.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Any, Sequence

from torch import nn

from .codec import encode, port_indices, ref_of, resolve_ref
from .graph import Graph, Node, Operation, copy_data
from .match import match_targets
from .modspec import SpecError, is_marked_leaf, is_torch_builtin, module_spec
from .trace import TraceError, trace

# Functions whose first argument is a list of tensors: connecting into them appends to the list.
_LIST_FUNCTIONS = {"torch:cat", "torch:stack", "torch:concat", "torch:concatenate",
                   "torch:hstack", "torch:vstack", "torch:dstack"}


class MutationError(ValueError):
    """A mutator that edits the graph into an invalid state; names mutator, primitive, node."""


# ---- candidates and their keys -------------------------------------------------------------


def candidate_key(value: Any) -> Any:
    """The JSON key that stands for ``value`` in a sample (see docs/architecture.md)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, nn.Module):  # the class name; duplicates get "#i" in candidate_keys
        return type(value).__name__
    if isinstance(value, functools.partial):
        kw = ", ".join(f"{k}={v!r}" for k, v in value.keywords.items())
        return f"{candidate_key(value.func)}({kw})"
    if callable(value):
        try:
            where, _, qualname = ref_of(value).rpartition(":")
            if where.endswith(".py"):  # a script's function: its file name, not its path
                where = os.path.splitext(os.path.basename(where))[0]
            return f"{where}.{qualname}"
        except Exception:  # noqa: BLE001 - fall back to a readable name
            return getattr(value, "__name__", type(value).__name__)
    if isinstance(value, Graph):
        return f"graph:{value.structural_hash()[:12]}"
    try:
        return json.loads(json.dumps(value))
    except TypeError:
        return type(value).__name__


def candidate_keys(candidates: Sequence | dict) -> tuple[list, list]:
    """(keys, values) of a candidate list or a dict of named candidates; keys made unique."""
    if isinstance(candidates, dict):
        keys = [k if k is None or isinstance(k, (bool, int, float, str)) else str(k)
                for k in candidates]
        values = list(candidates.values())
    else:
        values = list(candidates)
        keys = [candidate_key(v) for v in values]
    if all(type(k) is str for k in keys) and len(set(keys)) == len(keys):
        return keys, values  # already unique (the common case; the loop below would agree)
    seen: dict[Any, int] = {}
    for i, k in enumerate(keys):
        marker = json.dumps(k, sort_keys=True)
        if marker in seen:
            keys[i] = f"{k}#{i}"
        seen[json.dumps(keys[i], sort_keys=True)] = i
    return keys, values


# ---- turning user values into operations -----------------------------------------------------


def as_operation(op: Any, where: str) -> Operation:
    """An ``nn.Module`` instance, a function (or ``functools.partial``), a Graph or an
    Operation -> a fresh :class:`Operation` with an empty call template."""
    if isinstance(op, Operation):
        return op.copy()
    if isinstance(op, Graph):
        return Operation("subgraph", graph=op.copy())
    if isinstance(op, nn.Module):
        if is_torch_builtin(op) or is_marked_leaf(op):
            try:
                return Operation("module", spec=module_spec(op))
            except SpecError as e:
                raise MutationError(f"{where}: {e}") from None
        try:  # a composite module becomes a cell (subgraph)
            return Operation("subgraph", graph=trace(op))
        except TraceError as e:
            return opaque_operation(op, e, where)
    if isinstance(op, functools.partial):
        inner = as_operation(op.func, where)
        inner.kwargs = {k: encode(v) for k, v in op.keywords.items()}
        if op.args:
            raise MutationError(f"{where}: functools.partial with positional arguments "
                                f"is ambiguous; pass keyword arguments only")
        return inner
    if callable(op):
        try:
            return Operation("function", target=ref_of(op))
        except Exception as e:  # noqa: BLE001
            raise MutationError(f"{where}: {e}") from None
    raise MutationError(f"{where}: cannot use {op!r} as an operation; give an nn.Module, a "
                        f"function, functools.partial(fn, **kwargs) or a Graph")


def opaque_operation(module: nn.Module, why: Exception, where: str) -> Operation:
    """A composite module that torch.fx cannot trace (``why``), kept as one module node, as if
    its class were marked ``@retiarii.leaf``.

    The node refers to the module by its class and constructor arguments, read back from the
    module's attributes and verified as for ``torch.nn`` layers, so a worker rebuilds it and
    export imports the class. Shapes are still checked: the shape check runs the module.

    Raises:
        MutationError: the constructor arguments cannot be read back either; the message
            gives both reasons and the fix (``@retiarii.leaf``).
    """
    try:
        return Operation("module", spec=module_spec(module))
    except SpecError as e:
        reason = str(why).splitlines()[0]
        raise MutationError(
            f"{where}: {type(module).__name__} cannot be traced ({reason}), and it cannot be "
            f"kept as one opaque node either: {e}") from None


def is_variadic(node: Node) -> bool:
    op = node.op
    if op.kind == "function" and op.target in _LIST_FUNCTIONS:
        return True
    if op.kind == "module" and op.spec:
        return bool(getattr(resolve_ref(op.spec["cls"]), "variadic", False))
    return False


# ---- the mutator -----------------------------------------------------------------------------


@dataclass
class Context:
    """What the primitives act on while one model is being built."""

    graph: Graph
    sampler: Any  # .choose(label, keys, context) -> index
    sample: dict  # label -> key, in the order choices were made
    history: list  # one record per primitive call
    created: set  # uids created while building this model
    deleted: dict  # uid -> name of nodes deleted (for dangling-port errors)
    example_input: Any = None  # the space's example input: lets mutators read shapes


class Mutator:
    """Base class of every mutator; see the module docstring.

    Args:
        label: prefix of the labels of this mutator's choices (default: the class name and
            the mutator's position in the space, e.g. ``"inceptionmutator0"``).
    """

    open_ended = False  # True for mutators that can grow a graph without bound (evolution)

    def __init__(self, label: str | None = None):
        self.label = label
        self._ctx: Context | None = None
        self._calls = 0

    def mutate(self, targets: list) -> None:
        raise TypeError(f"{type(self).__name__} must implement mutate(self, targets)")

    # ---- running -----------------------------------------------------------------------
    @property
    def graph(self) -> Graph:
        if self._ctx is None:
            raise MutationError(f"{self._name}: primitives can only be used inside mutate()")
        return self._ctx.graph

    @property
    def _name(self) -> str:
        return self.label or type(self).__name__

    def apply(self, ctx: Context, targets: list) -> None:
        """Run ``mutate`` on ``ctx.graph``; check that no port is left dangling."""
        self._ctx, self._calls = ctx, 0
        start = len(ctx.history)
        try:
            self.mutate(targets)
            self._check_dangling(start)
        finally:
            self._ctx = None

    def _check_dangling(self, start: int = 0) -> None:
        # Only a node that a primitive recorded since ``start`` touched (its op replaced, an
        # input disconnected, a feeder deleted, or created by it) can have lost an input;
        # checking those alone keeps this linear in the edit, not in the graph's size.
        g = self.graph
        touched: set[int] = set()
        for rec in self._ctx.history[start:]:
            touched.update(rec[k] for k in ("node", "dst") if k in rec)
            touched.update(rec.get("users", ()))
            touched.update(rec.get("nodes", ()))
        alive = g.uids()
        for node in sorted((g.node_by_uid(u) for u in touched if u in alive),
                           key=lambda n: n.seq):
            for port, src in enumerate(node.inputs):
                if src is None:
                    culprit = self._deleted_feeder(node)
                    raise MutationError(
                        f"{self._name}: input {port} of node {node.name!r} is left unconnected"
                        + (f" after delete_node({culprit!r}), which was still in use; connect "
                           f"another node to it" if culprit else
                           "; connect a node to it"))

    def _deleted_feeder(self, node: Node) -> str | None:
        for rec in reversed(self._ctx.history):
            if rec["primitive"] == "delete_node" and node.uid in rec.get("users", []):
                return rec["name"]
        return None

    def _record(self, primitive: str, **fields) -> None:
        self._ctx.history.append({"mutator": self._name, "primitive": primitive,
                                  "choices": list(self._ctx.sample), **fields})

    def _node(self, node: Node | str, primitive: str) -> Node:
        if isinstance(node, str):
            try:
                return self.graph[node]
            except KeyError:
                raise MutationError(f"{self._name}.{primitive}: no node named {node!r}") from None
        if not isinstance(node, Node) or node.graph is not self.graph \
                or node.uid not in self.graph.uids():
            raise MutationError(f"{self._name}.{primitive}: {node!r} is not a node of the "
                                f"graph being mutated (was it deleted?)")
        return node

    # ---- primitives ----------------------------------------------------------------------
    def choose(self, candidates: Sequence | dict, label: str | None = None) -> Any:
        """Pick one candidate (the sampler decides); returns the candidate itself.

        Args:
            candidates: a list, or a dict of name -> candidate (names become the keys).
            label: the choice's name in samples; calls with the same label share one decision.
        """
        keys, values = candidate_keys(candidates)
        if label is None:
            label = f"{self._name}/{self._calls}"
        if not values:
            raise MutationError(f"{self._name}.choose: the list of candidates for choice "
                                f"{label!r} is empty")
        self._calls += 1
        sample = self._ctx.sample
        if label in sample:  # a tied choice: same label, same decision
            if sample[label] not in keys:
                raise MutationError(f"{self._name}.choose: label {label!r} was already chosen "
                                    f"as {sample[label]!r}, which is not among {keys}")
            return values[keys.index(sample[label])]
        index = self._ctx.sampler.choose(label, keys, dict(sample))
        if not isinstance(index, int) or not 0 <= index < len(keys):
            raise MutationError(f"sampler returned {index!r} for choice {label!r}; expected an "
                                f"index in [0, {len(keys)})")
        sample[label] = keys[index]
        self._record("choose", label=label, chosen=keys[index], n=len(keys))
        return values[index]

    def create_node(self, name: str, op: Any) -> Node:
        """Add a node (no inputs yet) computing ``op``: an ``nn.Module`` (copied), a function,
        ``functools.partial(fn, **kwargs)`` or a Graph (a cell). A composite module becomes a
        cell; one torch.fx cannot trace stays one opaque module node (see
        :func:`opaque_operation`)."""
        operation = as_operation(op, f"{self._name}.create_node({name!r})")
        name = self.graph.unique_name(name)
        if operation.kind in ("module", "subgraph"):
            operation.attr = name
        node = self.graph.add_node(name, operation)
        self._ctx.created.add(node.uid)
        self._record("create_node", node=node.uid, name=name, op=operation.describe())
        return node

    def delete_node(self, node: Node | str) -> None:
        """Remove a node; ports it fed are left dangling until ``connect`` fills them."""
        node = self._node(node, "delete_node")
        if node.kind in ("input", "output"):
            raise MutationError(f"{self._name}.delete_node: cannot delete the graph "
                                f"{node.kind} {node.name!r}")
        users = [u.uid for u in node.users]
        for dst, port in self.graph.out_edges(node):
            self.graph.disconnect_port(dst, port)
        self.graph.remove_node(node)
        self._ctx.deleted[node.uid] = node.name
        self._record("delete_node", node=node.uid, name=node.name, users=users)

    def connect(self, src: Node | str, dst: Node | str, port: int | None = None) -> None:
        """Feed ``src`` into ``dst``. Without ``port``: fill ``dst``'s first dangling input;
        else append an input if ``dst`` takes any number (a sum, ``torch.cat``) or was created
        by this mutation; else replace the input of a one-input node."""
        src, dst = self._node(src, "connect"), self._node(dst, "connect")
        where = f"{self._name}.connect({src.name!r} -> {dst.name!r})"
        if dst.kind == "input" or src.kind == "output":
            raise MutationError(f"{where}: edges cannot enter an input or leave the output")
        if self.graph.reaches(dst, src):
            raise MutationError(f"{where}: would create a cycle ({dst.name!r} already "
                                f"reaches {src.name!r})")
        if port is None:
            port = self._free_port(dst, where)
        elif port > dst.op.num_ports or (port == dst.op.num_ports and not is_variadic(dst)
                                         and dst.uid not in self._ctx.created):
            raise MutationError(f"{where}: node has {dst.op.num_ports} input ports; port "
                                f"{port} does not exist")
        if port == dst.op.num_ports:
            self.graph.append_port(dst, in_list=dst.op.kind == "function"
                                   and dst.op.target in _LIST_FUNCTIONS)
        self.graph.connect(src, dst, port)
        self._record("connect", src=src.uid, dst=dst.uid, port=port)

    def _free_port(self, dst: Node, where: str) -> int:
        inputs = dst.inputs
        if None in inputs:
            return inputs.index(None)
        if is_variadic(dst) or dst.uid in self._ctx.created or not inputs:
            return len(inputs)
        if len(inputs) == 1:
            return 0
        raise MutationError(f"{where}: the node takes {len(inputs)} inputs and all are "
                            f"connected; pass port= to say which one to replace")

    def disconnect(self, src: Node | str, dst: Node | str) -> None:
        """Remove the edges from ``src`` into ``dst``; a variadic node loses those inputs,
        another node is left with dangling ports to fill."""
        src, dst = self._node(src, "disconnect"), self._node(dst, "disconnect")
        ports = self.graph.ports_between(src, dst)
        if not ports:
            raise MutationError(f"{self._name}.disconnect: {src.name!r} does not feed "
                                f"{dst.name!r}")
        for port in reversed(ports):
            if is_variadic(dst):
                self.graph.remove_port(dst, port)
            else:
                self.graph.disconnect_port(dst, port)
        self._record("disconnect", src=src.uid, dst=dst.uid, ports=ports)

    def replace(self, node: Node | str, op: Any) -> None:
        """Give ``node`` a new operation, keeping its name, uid, inputs and users."""
        node = self._node(node, "replace")
        if node.kind in ("input", "output"):
            raise MutationError(f"{self._name}.replace: cannot replace the graph "
                                f"{node.kind} {node.name!r}")
        operation = as_operation(op, f"{self._name}.replace({node.name!r})")
        if not operation.args and not port_indices(operation.kwargs):
            operation.args = copy_data(node.op.args) if node.kind != "method" \
                else copy_data(node.op.args[:1])
            if not operation.kwargs and node.kind in ("module", "subgraph"):
                operation.kwargs = copy_data(node.op.kwargs)
        if operation.kind in ("module", "subgraph"):
            operation.attr = node.name  # a new module of its own, even if the old was shared
        self.graph.set_op(node, operation)
        self._record("replace", node=node.uid, name=node.name, op=operation.describe())


# ---- binding mutators to targets ---------------------------------------------------------------


class BoundMutator:
    """A mutator with its targets; made by :func:`apply_mutator`."""

    def __init__(self, targets: Any, mutator: Mutator):
        if not isinstance(mutator, Mutator):
            raise TypeError(f"apply_mutator needs a Mutator instance, got {mutator!r}")
        self.targets = targets
        self.mutator = mutator

    def apply(self, ctx: Context) -> None:
        found = match_targets(ctx.graph, self.targets) if self.targets is not None else []
        self.mutator.apply(ctx, found)

    def __repr__(self):
        return f"apply_mutator({self.targets!r}, {type(self.mutator).__name__})"


def apply_mutator(targets: Any, mutator: Mutator) -> BoundMutator:
    """Bind ``mutator`` to the nodes it edits.

    ``targets`` is a node name, a glob (``"layer2.*.conv*"``), a module class or a function
    (every node of that op), a list of names (passed in that order), or a pattern
    (:class:`retiarii.Chain` / :class:`retiarii.Pattern`, matched by subgraph isomorphism:
    ``mutate`` then gets one tuple of nodes per match). A pattern that matches nothing raises
    an error naming it and the closest node names.

    Example::

        rt.apply_mutator("layer2.*.conv*", rt.mutators.OperatorMutator([conv3x3, max_pool]))
    """
    return BoundMutator(targets, mutator)


__all__ = ["Mutator", "MutationError", "BoundMutator", "apply_mutator",
           "Context", "candidate_keys", "candidate_key", "as_operation", "opaque_operation"]
