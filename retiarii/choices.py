"""Inline choices: a space written inside the model, compiled into mutators at trace time.

``LayerChoice`` (pick one of several modules), ``InputChoice`` (pick which inputs to merge),
``ValueChoice`` (a constructor argument or hyper-parameter picked from values) and ``Repeat``
(a block repeated a chosen number of times). Each behaves as its first option when the model
runs eagerly; ``ModelSpace`` traces the model and turns every inline choice into a mutator
over the graph, so inline spaces and mutator spaces are one thing to strategies and engine.

Example::

    class Cell(nn.Module):
        def __init__(self):
            super().__init__()
            self.op = rt.LayerChoice({"conv": nn.Conv2d(16, 16, 3, padding=1),
                                      "pool": nn.MaxPool2d(3, 1, 1)})
            self.width = rt.ValueChoice([32, 64])
            self.fc = rt.nn.LazyLinear(self.width)     # ValueChoice args need retiarii.nn layers
            self.blocks = rt.Repeat(lambda i: Block(), depth=(1, 3))

Labels default to the module path (``"cell.op"``, ``"stage.blocks.1.op"`` inside a repeated
block), or for a ValueChoice to the first place it is used (``"fc.out_features"``); one
ValueChoice object is one choice wherever it is used. Give the same label to tie choices.
"""
from __future__ import annotations

import copy
import inspect
import itertools
from typing import Any, Callable, Sequence

import torch.fx as fx
from torch import nn

from . import ops
from .codec import decode, encode, evaluate_choice, find_tags, map_tags, resolve_ref
from .graph import Graph, Node, Operation
from .modspec import is_marked_leaf, is_torch_builtin, module_spec
from .mutator import MutationError, Mutator, candidate_keys, opaque_operation
from .trace import LEAF_HANDLERS, TraceError, _plain_kwargs, trace_with_choices

# ---- ValueChoice -----------------------------------------------------------------------------

class _Expr:
    """Arithmetic on ValueChoices (``ratio * channels``), evaluated once values are chosen."""

    def _binary(name, reverse=False):  # noqa: N805 - builds the dunder methods below
        def method(self, other):
            args = [other, self] if reverse else [self, other]
            return ChoiceExpr(name, args)
        return method

    __add__, __radd__ = _binary("add"), _binary("add", True)
    __sub__, __rsub__ = _binary("sub"), _binary("sub", True)
    __mul__, __rmul__ = _binary("mul"), _binary("mul", True)
    __truediv__, __rtruediv__ = _binary("truediv"), _binary("truediv", True)
    __floordiv__, __rfloordiv__ = _binary("floordiv"), _binary("floordiv", True)
    __mod__, __rmod__ = _binary("mod"), _binary("mod", True)
    __pow__ = _binary("pow")

    def __bool__(self):
        raise TypeError("a ValueChoice has no truth value until a model is sampled; do not "
                        "branch on it in __init__ (use a LayerChoice or a mutator instead)")

    def __index__(self):
        raise TypeError("a ValueChoice is not an int until a model is sampled; pass it to a "
                        "retiarii.nn layer's constructor instead of using it in Python code")


class ValueChoice(_Expr):
    """One value among ``values``: a constructor argument of a ``retiarii.nn`` layer, an
    argument in forward, a ``Repeat`` depth, or a trainer hyper-parameter.

    Example::

        >>> width = rt.ValueChoice([16, 32, 64], label="width")
        >>> conv = rt.nn.Conv2d(3, width, 3)       # records the choice, runs as 16 eagerly
        >>> bn = rt.nn.BatchNorm2d(width)          # same object: tied to the conv's width

    Args:
        values: JSON-like candidates (numbers, strings, bools, None).
        label: the choice's name in samples (default: from where it is first used).
    """

    def __init__(self, values: Sequence, label: str | None = None):
        self.values = list(values)
        if not self.values:
            raise ValueError("ValueChoice needs at least one value")
        self.label = label

    @property
    def default(self) -> Any:
        return self.values[0]

    def __retiarii_encode__(self) -> dict:
        return {"__choice__": {"id": id(self), "label": self.label,
                               "values": [encode(v) for v in self.values]}}

    def choose_in(self, ctx) -> Any:
        """Make this choice inside a space being sampled (trainer hyper-parameters)."""
        return _HParamChooser(self.label).run(ctx, self.values)

    def __repr__(self):
        return f"ValueChoice({self.values!r}, label={self.label!r})"


class ChoiceExpr(_Expr):
    def __init__(self, op: str, args: list):
        self.op, self.args = op, args

    @property
    def default(self) -> Any:
        return evaluate_choice(self.__retiarii_encode__()["__choice__"], None)

    def __retiarii_encode__(self) -> dict:
        return {"__choice__": {"op": self.op, "args": [encode(a) for a in self.args]}}


class _HParamChooser(Mutator):
    def run(self, ctx, values):
        self._ctx, self._calls = ctx, 0
        try:
            return self.choose(values, label=self.label)
        finally:
            self._ctx = None


# ---- retiarii.nn: torch.nn layers that accept ValueChoice arguments ----------------------------

_WRAPPED: dict[type, type] = {}


def _has_choice(value: Any) -> bool:
    if isinstance(value, _Expr):
        return True
    if isinstance(value, (list, tuple)):
        return any(_has_choice(v) for v in value)
    if isinstance(value, dict):
        return any(_has_choice(v) for v in value.values())
    return False


def _defaults(value: Any) -> Any:
    if isinstance(value, _Expr):
        return value.default
    if isinstance(value, (list, tuple)):
        return type(value)(_defaults(v) for v in value)
    if isinstance(value, dict):
        return {k: _defaults(v) for k, v in value.items()}
    return value


def wrap_layer(cls: type[nn.Module]) -> type[nn.Module]:
    """A subclass of ``cls`` that accepts ValueChoices as constructor arguments (it is built
    with their defaults and records the choices)."""
    if cls in _WRAPPED:
        return _WRAPPED[cls]

    def __init__(self, *args, **kwargs):  # noqa: N807 (it becomes the class's __init__)
        self.__dict__["_retiarii_init"] = (args, kwargs)
        cls.__init__(self, *_defaults(args), **_defaults(kwargs))

    wrapped = type(cls.__name__, (cls,), {"__init__": __init__, "_retiarii_leaf": True,
                                          "_retiarii_base": cls, "__module__": "retiarii.nn",
                                          "__qualname__": cls.__name__})
    _WRAPPED[cls] = wrapped
    return wrapped


# ---- the inline choice modules ------------------------------------------------------------------


class LayerChoice(nn.Module):
    """One of several modules. Runs as the first candidate eagerly.

    Example::

        self.op = rt.LayerChoice({"conv3x3": nn.Conv2d(16, 16, 3, padding=1),
                                  "sep": SepConv(16), "pool": nn.MaxPool2d(3, 1, 1)})

    Args:
        candidates: a list of modules, or a dict of name -> module (names are the sample keys;
            for a list the keys are the class names). A candidate may itself hold inline
            choices: they exist only in models where it is chosen.
        label: the choice's name (default: the module path).
    """

    def __init__(self, candidates: Sequence[nn.Module] | dict[str, nn.Module],
                 label: str | None = None):
        super().__init__()
        if isinstance(candidates, dict):
            keys, mods = [str(k) for k in candidates], list(candidates.values())
        else:
            keys, mods = candidate_keys(list(candidates))  # class names, as mutators use
        if not mods:
            raise ValueError("LayerChoice needs at least one candidate")
        bad = [k for k in keys if "." in k or not k]
        if bad:
            raise ValueError(f"LayerChoice candidate names cannot contain '.': {bad}")
        self.keys = keys
        self.options = nn.ModuleList(mods)
        self.label = label

    def forward(self, *args, **kwargs):
        return self.options[0](*args, **kwargs)


class InputChoice(nn.Module):
    """Choose ``n_chosen`` of ``n_candidates`` inputs and merge them.

    Example::

        self.skip = rt.InputChoice(n_candidates=3, n_chosen=1)
        ...
        out = self.skip([x0, x1, x2])

    The kept inputs are merged in their order in the list, so a choice is a set of indices
    (a multiset with ``distinct=False``): ``C(n_candidates, n_chosen)`` candidates, or
    ``C(n_candidates + n_chosen - 1, n_chosen)`` with repeats. The inputs that are not kept
    are not computed: what only they used leaves the model, and the choices inside it leave
    the sample.

    Args:
        n_candidates: how many tensors the list passed to forward holds.
        n_chosen: how many are kept.
        reduction: "sum", "mean" or "concat" (along dim 1) of the kept inputs; "none" when
            ``n_chosen == 1``.
        distinct: the kept inputs are different ones (default, as in DARTS-like cells: summing
            one input twice only rescales it). ``False`` lets one input be kept several times
            (``n_chosen`` may then exceed ``n_candidates``).
        label: the choice's name (default: the module path).
    """

    _REDUCTIONS = ("sum", "mean", "concat", "none")

    def __init__(self, n_candidates: int, n_chosen: int = 1, reduction: str = "sum",
                 label: str | None = None, distinct: bool = True):
        super().__init__()
        if reduction not in self._REDUCTIONS:
            raise ValueError(f"reduction {reduction!r} is not one of {self._REDUCTIONS}")
        if n_candidates < 1 or n_chosen < 1 or (distinct and n_chosen > n_candidates):
            raise ValueError(f"n_chosen={n_chosen} must be in [1, n_candidates={n_candidates}]"
                             + ("" if distinct else " (or more, with distinct=False)"))
        if reduction == "none" and n_chosen != 1:
            raise ValueError("reduction='none' keeps a single input: use n_chosen=1")
        self.n_candidates, self.n_chosen, self.reduction, self.label = \
            n_candidates, n_chosen, reduction, label
        self.distinct = distinct

    def subsets(self) -> list[tuple[int, ...]]:
        """The candidates of the choice: tuples of kept indices, the first one the default."""
        pick = itertools.combinations if self.distinct else itertools.combinations_with_replacement
        return list(pick(range(self.n_candidates), self.n_chosen))

    def merge_module(self) -> nn.Module:
        return {"sum": ops.Sum, "none": ops.Sum, "mean": ops.Mean,
                "concat": ops.Concat}[self.reduction]()

    def forward(self, inputs: list):
        first = range(self.n_chosen) if self.distinct else [0] * self.n_chosen
        return self.merge_module()(*(inputs[i] for i in first))


class Repeat(nn.Module):
    """A block repeated a chosen number of times, in sequence.

    Example::

        self.stage = rt.Repeat(lambda i: Block(32 if i == 0 else 64, 64), depth=(1, 4))

    Args:
        blocks: a module (deep-copied for each position), a list of modules, or a function
            ``index -> module``.
        depth: an int, a ``(min, max)`` range, a list of depths, or a ValueChoice of depths.
        label: the choice's name (default: the module path + ".depth").
    """

    def __init__(self, blocks: nn.Module | Sequence[nn.Module] | Callable[[int], nn.Module],
                 depth: int | tuple | list | ValueChoice, label: str | None = None):
        super().__init__()
        if isinstance(depth, ValueChoice):
            label = label or depth.label
            depths = list(depth.values)
        elif isinstance(depth, tuple):
            depths = list(range(depth[0], depth[1] + 1))
        elif isinstance(depth, int):
            depths = [depth]
        else:
            depths = list(depth)
        if not depths or min(depths) < 0 or max(depths) < 1:
            raise ValueError(f"Repeat depth {depth!r}: need depths >= 0 with a maximum >= 1")
        n = max(depths)
        if isinstance(blocks, nn.Module):
            mods = [blocks] + [copy.deepcopy(blocks) for _ in range(n - 1)]
        elif callable(blocks):
            mods = [blocks(i) for i in range(n)]
        else:
            mods = list(blocks)
            if len(mods) < n:
                raise ValueError(f"Repeat got {len(mods)} blocks for a depth up to {n}")
        self.depths, self.label = sorted(depths), label
        self.blocks = nn.ModuleList(mods[:n])

    def forward(self, x):
        for block in self.blocks[:self.depths[0]]:
            x = block(x)
        return x


# ---- compiled mutators ---------------------------------------------------------------------------


class _Inline(Mutator):
    """Base of the mutators compiled from inline choices. They hold uids of the graph they were
    traced in; ``remap`` translates them once that graph was spliced into another. Their
    labels are final (made absolute at trace time)."""

    def __init__(self, label: str):
        super().__init__(label)
        self.remap: dict[int, int] = {}

    def node(self, uid: int) -> Node:
        return self.graph.node_by_uid(self.remap.get(uid, uid))

    def reachable(self, uid: int) -> bool:
        """Whether the node is still in the graph: an input choice upstream of the output
        deletes what only its unchosen inputs used, and the choices of those nodes are then
        not made (they are not in the sample, nor counted in the space's size)."""
        try:
            self.node(uid)
        except KeyError:
            return False
        return True

    def run_nested(self, nested: list, mapping: dict[int, int]) -> None:
        """Run the mutators of a spliced candidate/block, translated to this graph."""
        ctx = self._ctx
        for m in nested:
            m.remap = {k: self.remap.get(v, v) for k, v in mapping.items()}
            m.apply(ctx, [])
        self._ctx = ctx


def splice_graph(g: Graph, sub: Graph, prefix: str, sources: list[Node]) -> tuple[dict, Node]:
    """Copy the body of ``sub`` into ``g`` (names and module paths prefixed), its inputs fed by
    ``sources`` in order. Returns (sub uid -> new uid, the node computing sub's output)."""
    mapping: dict[int, int] = {}
    out_src = None
    inputs = iter(sources)
    for n in sub.nodes:
        if n.kind == "input":
            src = next(inputs, None)
            if src is None:
                raise MutationError(f"the block spliced at {prefix!r} takes more inputs than "
                                    f"the {len(sources)} it is given")
            mapping[n.uid] = src.uid
        elif n.kind == "output":
            if n.op.args != [{"__in__": 0}]:
                raise MutationError(f"the block spliced at {prefix!r} must return a single "
                                    f"tensor (it returns {n.op.args[0]!r})")
            out_src = n.inputs[0]
        else:
            op = n.op.copy()
            if op.kind in ("module", "param", "subgraph"):
                op.attr = prefix + n.attr
            new = g.add_node(g.unique_name(prefix + n.name), op)
            new.meta = dict(n.meta)
            mapping[n.uid] = new.uid
    for s, d, port in sub.edges():
        if d.kind != "output":
            g.connect(g.node_by_uid(mapping[s.uid]), g.node_by_uid(mapping[d.uid]), port)
    return mapping, g.node_by_uid(mapping[out_src.uid])


def _splice(mutator: Mutator, node: Node, sub: Graph, prefix: str) -> dict[int, int]:
    """Replace ``node`` by the body of ``sub`` (a primitive built from the graph's own edits,
    recorded as one ``splice`` in the history)."""
    g = mutator.graph
    mapping, out = splice_graph(g, sub, prefix, node.inputs)
    created = [v for k, v in mapping.items() if sub.node_by_uid(k).kind != "input"]
    mutator._ctx.created.update(created)
    users = [u.uid for u in node.users]
    for dst, port in g.out_edges(node):
        g.connect(out, dst, port)
    for port in range(node.op.num_ports):
        g.disconnect_port(node, port)
    g.remove_node(node)
    mutator._record("splice", node=node.uid, name=node.name, users=users, nodes=created)
    return mapping


class _LayerChoiceMutator(_Inline):
    def __init__(self, uid: int, keys: list, options: list, label: str):
        super().__init__(label)
        self.uid, self.keys, self.options = uid, keys, options

    def mutate(self, targets):
        if not self.reachable(self.uid):
            return
        node = self.node(self.uid)
        index = self.choose(dict(zip(self.keys, range(len(self.keys)))), self.label)
        kind, payload, nested = self.options[index]
        if kind == "op":
            self.replace(node, payload)
        else:
            key = str(self.keys[index]).replace("#", "_")
            mapping = _splice(self, node, payload, f"{node.name}.{key}.")
            self.run_nested(nested, mapping)


class _InputChoiceMutator(_Inline):
    """Keeps the chosen inputs of the merge node, then deletes what fed only the others.

    Input choices run before the space's other inline choices, the one nearest the output
    first, so the choices of the nodes they delete are never made."""

    def __init__(self, uid: int, n: int, subsets: list[tuple[int, ...]], label: str):
        super().__init__(label)
        self.uid, self.n = uid, n
        self.options = {(c[0] if len(c) == 1 else ",".join(map(str, c))): c for c in subsets}

    def mutate(self, targets):
        if not self.reachable(self.uid):
            return
        node = self.node(self.uid)
        kept = self.choose(self.options, self.label)
        sources = node.inputs
        # a repeated input: every port is dropped and the kept ones appended in order
        drop = range(self.n) if len(set(kept)) < len(kept) else \
            [p for p in range(self.n) if p not in kept]
        for port in reversed(drop):
            self.graph.remove_port(node, port)
            self._record("disconnect", src=sources[port].uid, dst=node.uid, ports=[port])
        if len(set(kept)) < len(kept):
            for i in kept:
                port = self.graph.append_port(node)
                self.graph.connect(sources[i], node, port)
                self._record("connect", src=sources[i].uid, dst=node.uid, port=port)
        _delete_unused(self, [sources[p] for p in range(self.n) if p not in kept])


def _delete_unused(mutator: Mutator, nodes: list[Node]) -> None:
    """Delete ``nodes`` if nothing uses them any more, then their inputs likewise."""
    todo = list(nodes)
    while todo:
        node = todo.pop()
        try:
            mutator.graph.node_by_uid(node.uid)
        except KeyError:  # already deleted, through another path
            continue
        if node.kind in ("input", "output") or node.users:
            continue
        feeders = [src for src in node.inputs if src is not None]
        mutator.delete_node(node)
        todo.extend(feeders)


class _RepeatMutator(_Inline):
    def __init__(self, depths: list, blocks: list, label: str):
        super().__init__(label)
        # one dict per block: uids (in this graph), out (uid), src (the Repeat's input uid),
        # nested (its mutators), map (block graph uid -> uid here)
        self.depths, self.blocks = depths, blocks

    def mutate(self, targets):
        if not self.reachable(self.blocks[-1]["out"]):
            return  # only its last block's output is used outside it: all of it is gone
        depth = self.choose(self.depths, self.label)
        g = self.graph
        if depth < len(self.blocks):
            dropped = {self.remap.get(u, u) for b in self.blocks[depth:] for u in b["uids"]}
            last_out = self.node(self.blocks[-1]["out"])
            keep_out = self.node(self.blocks[depth - 1]["out"] if depth else self.blocks[0]["src"])
            for dst, port in g.out_edges(last_out):
                if dst.uid not in dropped:
                    self.connect(keep_out, dst, port)
            for block in reversed(self.blocks[depth:]):
                for uid in reversed(block["uids"]):
                    self.delete_node(self.node(uid))
        for block in self.blocks[:depth]:
            self.run_nested(block["nested"], block["map"])


class _ValueChoiceMutator(_Inline):
    """Chooses the ValueChoices used by the nodes of a graph and writes the values in.

    It runs after the graph's other inline choices, so it sees the candidates they picked; a
    ValueChoice used only by candidates that were not picked is not asked for (conditional).
    """

    def __init__(self, uids: list[int], labels: dict[str, list]):
        super().__init__("valuechoices")
        self.uids, self.labels = uids, labels  # label -> encoded values, in order of first use

    def mutate(self, targets):
        alive = self.graph.uids()
        nodes = [self.graph.node_by_uid(u) for u in (self.remap.get(u, u) for u in self.uids)
                 if u in alive]
        tagged = [n for n in nodes if _labels_in([n.op.args, n.op.kwargs, n.op.spec])]
        used = set().union(*(_labels_in([n.op.args, n.op.kwargs, n.op.spec]) for n in tagged))
        chosen = {label: self.choose([decode(v) for v in values], label)
                  for label, values in self.labels.items() if label in used}
        for node in tagged:
            op = node.op.copy()
            op.args, op.kwargs = _substitute(op.args, chosen), _substitute(op.kwargs, chosen)
            op.spec = _substitute(op.spec, chosen)
            self.graph.set_op(node, op)  # keeps the module path: tied modules stay tied
            self._record("replace", node=node.uid, name=node.name, op=op.describe())


def _labels_in(data: Any) -> set[str]:
    labels: set[str] = set()
    for p in find_tags(data, "__choice__"):
        labels |= _labels_in(p["args"]) if "op" in p else {p["label"]}
    return labels


def _substitute(data: Any, chosen: dict) -> Any:
    return map_tags(data, "__choice__", lambda p: encode(evaluate_choice(p, chosen)))


# ---- tracing inline choices ------------------------------------------------------------------------


def _arg_names(op: Operation) -> list[str]:
    """Constructor parameter names of a module operation, to name its ValueChoices readably."""
    try:
        cls = resolve_ref(op.spec["cls"])
        return [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    except (TypeError, ValueError, ImportError, AttributeError, KeyError):
        return []


class _TraceScope:
    """State shared by one top-level trace and the traces of its candidates and blocks: the
    path prefix of the graph being traced, and the labels given to ValueChoice objects (the
    same object is one choice wherever it is used)."""

    stack: list["_TraceScope"] = []

    def __init__(self, prefix: str, labels: dict[int, str]):
        self.prefix, self.labels = prefix, labels
        self.claimed: set[int] = set()  # uids of spliced blocks, whose choices are their own

    @classmethod
    def current(cls) -> "_TraceScope":
        return cls.stack[-1] if cls.stack else cls("", {})


def _compile_value_choices(graph: Graph, scope: _TraceScope, skip: set[int],
                           candidates: list[tuple[int, Operation]]
                           ) -> _ValueChoiceMutator | None:
    """Give every ValueChoice in ``graph`` its final label; one mutator that chooses them."""
    labels: dict[str, list] = {}
    uids: list[int] = []

    def visit(data, where, node):
        return map_tags(data, "__choice__",
                        lambda p: {"__choice__": visit_choice(p, where, node)})

    def visit_choice(p, where, node):
        if "op" in p:
            return {"op": p["op"], "args": [visit(a, where, node) for a in p["args"]]}
        label = p.get("label") or scope.labels.get(p.get("id"))
        if label is None:
            label = f"{scope.prefix}{node.name}.{where}"
            while label in labels or label in scope.labels.values():
                label += "'"
        scope.labels[p.get("id")] = label
        if labels.setdefault(label, p["values"]) != p["values"]:
            raise TraceError(f"ValueChoice label {label!r} is used with different values "
                             f"{labels[label]} and {p['values']}")
        return {"label": label, "values": p["values"]}

    owned = [(n.name, n.op) for n in graph.nodes if n.uid not in skip] + [
        (graph.node_by_uid(uid).name, op) for uid, op in candidates]
    for name, op in owned:
        node = _Named(name)
        if op.kind == "module" and op.spec is not None:
            names = _arg_names(op)
            op.spec = {**op.spec,
                       "args": [visit(v, names[i] if i < len(names) else f"arg{i}", node)
                                for i, v in enumerate(op.spec.get("args", []))],
                       "kwargs": {k: visit(v, k, node) for k, v in op.spec.get("kwargs", {}).items()}}
        op.args = [visit(v, f"arg{i}", node) for i, v in enumerate(op.args)]
        op.kwargs = {k: visit(v, k, node) for k, v in op.kwargs.items()}
    # The nodes that can hold a ValueChoice when the mutator runs: those holding one now, and
    # LayerChoice placeholders, which may receive a candidate holding one.
    placeholders = {uid for uid, _ in candidates}
    uids = [n.uid for n in graph.nodes if n.uid not in skip and (
        n.uid in placeholders or _labels_in([n.op.args, n.op.kwargs, n.op.spec]))]
    return _ValueChoiceMutator(uids, labels) if labels else None


class _Named:
    """Where a ValueChoice is used, for its automatic label."""

    def __init__(self, name: str):
        self.name = name


def trace_space(module: nn.Module, concrete_args: dict | None = None,
                leaf_modules: Sequence = (), prefix: str | None = None
                ) -> tuple[Graph, list[_Inline]]:
    """Trace ``module``; return its graph and the mutators compiled from its inline choices
    (ValueChoices last, after the choices that may splice more of them in).

    ``prefix`` is the path the module will have once spliced into its parent (for labels).
    """
    outer = _TraceScope.current()
    scope = _TraceScope(outer.prefix + (prefix or ""), outer.labels if _TraceScope.stack
                        else {})
    _TraceScope.stack.append(scope)
    try:
        graph, inline = trace_with_choices(module, concrete_args, leaf_modules)
        # Input choices first, nearest the output first: they decide which parts of the
        # graph are used at all, and the choices of the unused parts are not made.
        inputs = [m for m in reversed(inline) if isinstance(m, _InputChoiceMutator)]
        inline = inputs + [m for m in inline if not isinstance(m, _InputChoiceMutator)]
        candidates = [(m.uid, payload) for m in inline if isinstance(m, _LayerChoiceMutator)
                      for kind, payload, _ in m.options if kind == "op"]
        values = _compile_value_choices(graph, scope, scope.claimed, candidates)
    finally:
        _TraceScope.stack.pop()
    return graph, inline + ([values] if values else [])


def _holds_choices(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule is an inline choice or takes a ValueChoice."""
    return any(type(m) in LEAF_HANDLERS or _has_choice(m.__dict__.get("_retiarii_init"))
               for m in module.modules())


def _candidate(module: nn.Module, prefix: str) -> tuple:
    if is_torch_builtin(module) or is_marked_leaf(module):
        return ("op", Operation("module", spec=module_spec(module)), [])
    try:
        graph, nested = trace_space(module, prefix=prefix)
    except TraceError as e:
        if _holds_choices(module):  # kept opaque, its choices would be silently lost
            raise
        try:
            return ("op", opaque_operation(module, e, f"LayerChoice candidate {prefix[:-1]!r}"),
                    [])
        except MutationError as err:
            raise TraceError(str(err)) from None
    return ("graph", graph, nested)


def _on_layer_choice(conv, n: fx.Node, module: LayerChoice) -> None:
    path = str(n.target)
    scope = _TraceScope.current()
    options = [_candidate(m, f"{path}.{str(key).replace('#', '_')}.")
               for key, m in zip(module.keys, module.options)]
    args, feeds = conv.template([list(n.args), dict(n.kwargs)])
    kind, payload, _ = options[0]
    op = payload.copy() if kind == "op" else Operation("subgraph", graph=payload.copy())
    op.args, op.kwargs, op.attr = args[0], _plain_kwargs(args[1]), path
    node = conv.add(path, op, feeds, n)
    conv.inline.append(_LayerChoiceMutator(node.uid, module.keys, options,
                                           module.label or scope.prefix + path))


def _on_input_choice(conv, n: fx.Node, module: InputChoice) -> None:
    path = str(n.target)
    inputs = n.args[0] if n.args else None
    if not isinstance(inputs, (list, tuple)) or len(inputs) != module.n_candidates:
        raise TraceError(f"InputChoice {path!r} takes a list of {module.n_candidates} tensors; "
                         f"got {inputs!r}")
    args, feeds = conv.template(list(inputs))
    op = Operation("module", args=args, spec=module_spec(module.merge_module()), attr=path)
    node = conv.add(path, op, feeds, n)
    conv.inline.append(_InputChoiceMutator(node.uid, module.n_candidates, module.subsets(),
                                           module.label or _TraceScope.current().prefix + path))


def _on_repeat(conv, n: fx.Node, module: Repeat) -> None:
    path = str(n.target)
    if len(n.args) != 1 or n.kwargs or not isinstance(n.args[0], fx.Node):
        raise TraceError(f"Repeat {path!r} is called with one tensor; got {n.args!r}")
    src = conv.env[n.args[0]]
    current, blocks = src, []
    scope = _TraceScope.current()
    for i, block in enumerate(module.blocks):
        sub, nested = trace_space(block, prefix=f"{path}.blocks.{i}.")
        mapping, out = splice_graph(conv.graph, sub, f"{path}.blocks.{i}.", [current])
        uids = [v for k, v in mapping.items() if sub.node_by_uid(k).kind != "input"]
        scope.claimed.update(uids)  # their ValueChoices belong to the block's own mutators
        blocks.append({"uids": uids, "out": out.uid, "src": src.uid, "nested": nested,
                       "map": mapping})
        current = out
    conv.env[n] = current
    conv.inline.append(_RepeatMutator(module.depths, blocks,
                                      module.label or f"{scope.prefix}{path}.depth"))


LEAF_HANDLERS[LayerChoice] = _on_layer_choice
LEAF_HANDLERS[InputChoice] = _on_input_choice
LEAF_HANDLERS[Repeat] = _on_repeat
