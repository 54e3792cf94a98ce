"""Tracing inline choices: the trace hooks of ``LayerChoice``, ``InputChoice`` and ``Repeat``
(registered in ``trace.LEAF_HANDLERS`` when this module is imported: ``retiarii`` imports it
through ``space.py``), the labelling of ValueChoices, and :func:`trace_space`, which returns a
module's graph with the mutators its inline choices compile to (:mod:`.choice_mutators`).
"""
from __future__ import annotations

import inspect
from typing import Sequence

import torch.fx as fx
from torch import nn

from .choice_mutators import (
    InlineMutator, InputChoiceMutator, LayerChoiceMutator, labels_in, RepeatMutator,
    ValueChoiceMutator, splice_graph,
)
from .choices import InputChoice, LayerChoice, Repeat, has_choice
from .codec import map_tags, resolve_ref
from .graph import Graph, Operation
from .modspec import is_marked_leaf, is_torch_builtin, module_spec
from .mutator import MutationError, opaque_operation
from .trace import LEAF_HANDLERS, TraceError, plain_kwargs, trace_with_choices

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
                           ) -> ValueChoiceMutator | None:
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
        n.uid in placeholders or labels_in([n.op.args, n.op.kwargs, n.op.spec]))]
    return ValueChoiceMutator(uids, labels) if labels else None


class _Named:
    """Where a ValueChoice is used, for its automatic label."""

    def __init__(self, name: str):
        self.name = name


def trace_space(module: nn.Module, concrete_args: dict | None = None,
                leaf_modules: Sequence = (), prefix: str | None = None
                ) -> tuple[Graph, list[InlineMutator]]:
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
        inputs = [m for m in reversed(inline) if isinstance(m, InputChoiceMutator)]
        inline = inputs + [m for m in inline if not isinstance(m, InputChoiceMutator)]
        candidates = [(m.uid, payload) for m in inline if isinstance(m, LayerChoiceMutator)
                      for kind, payload, _ in m.options if kind == "op"]
        values = _compile_value_choices(graph, scope, scope.claimed, candidates)
    finally:
        _TraceScope.stack.pop()
    return graph, inline + ([values] if values else [])


def _holds_choices(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule is an inline choice or takes a ValueChoice."""
    return any(type(m) in LEAF_HANDLERS or has_choice(m.__dict__.get("_retiarii_init"))
               for m in module.modules())


def _candidate(module: nn.Module, prefix: str) -> tuple:
    if is_torch_builtin(module) or is_marked_leaf(module):
        return ("op", Operation("module", spec=module_spec(module)), [])
    if type(module) in LEAF_HANDLERS:
        # a candidate that is itself an inline choice (a Repeat, a LayerChoice): traced as
        # the root, its forward would run eagerly and its own choice be lost; as a called
        # submodule its handler compiles it (its path gains the wrapper's "0")
        module = nn.Sequential(module)
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
    op.args, op.kwargs, op.attr = args[0], plain_kwargs(args[1]), path
    node = conv.add(path, op, feeds, n)
    conv.inline.append(LayerChoiceMutator(node.uid, module.keys, options,
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
    conv.inline.append(InputChoiceMutator(node.uid, module.n_candidates, module.subsets(),
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
    conv.inline.append(RepeatMutator(module.depths, blocks,
                                      module.label or f"{scope.prefix}{path}.depth"))


LEAF_HANDLERS[LayerChoice] = _on_layer_choice
LEAF_HANDLERS[InputChoice] = _on_input_choice
LEAF_HANDLERS[Repeat] = _on_repeat
