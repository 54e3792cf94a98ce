"""Helpers the built-in mutators share: flat target lists, node shapes, op equality, steps.

Not public API: each mutator file imports what it needs from here.
"""
from __future__ import annotations

import json
from typing import Any, Iterator, Sequence

import torch

from ..graph import Graph, Node, Operation
from ..match import predicate
from ..mutator import MutationError, Mutator, as_operation
from ..shapes import ShapeRecorder, shape_of

# Node kinds that compute a tensor from their inputs (what a skip edge may leave or enter).
COMPUTING = ("module", "function", "method", "subgraph")


def flat_targets(targets: Sequence) -> list[Node]:
    """Matched targets as a flat list of nodes (a pattern gives tuples), each node once."""
    out: list[Node] = []
    for t in targets:
        for node in (t if isinstance(t, tuple) else (t,)):
            if node not in out:
                out.append(node)
    return out


def relative_name(node: Node, target: Node) -> str:
    """``node``'s name relative to the module that holds ``target``: ``"cells.1.b0"`` seen from
    ``"cells.1.b2_a"`` is ``"b0"``. Keys written this way agree across repeated cells, so one
    label can tie the choice of every cell."""
    scope = target.name.rpartition(".")[0]
    if scope and node.name.startswith(scope + "."):
        return node.name[len(scope) + 1:]
    return node.name


def select_nodes(graph: Graph, spec: Any, target: Node) -> list[Node]:
    """Candidate nodes for ``target``: a name, glob or module class, a list of those (in
    graph order), or a callable ``target -> nodes or names`` (in its order); each once."""
    if callable(spec) and not isinstance(spec, type):
        picked = list(spec(target))
        for p in picked:
            if isinstance(p, str) and p not in graph:
                raise KeyError(p)
        return list(dict.fromkeys(graph[p] if isinstance(p, str) else p for p in picked))
    specs = spec if isinstance(spec, (list, tuple)) else [spec]
    for s in specs:  # a plain name that is not there is a typo, not an empty match
        if isinstance(s, str) and not any(c in s for c in "*?[") and s not in graph:
            raise KeyError(s)
    tests = [predicate(s) for s in specs]
    return [n for n in graph.nodes if any(t(n) for t in tests)]


def operation_of(mutator: Mutator, candidate: Any) -> Operation:
    """``candidate`` as an :class:`Operation`, made once per candidate object and mutator
    (reading a module's spec or tracing a composite module costs more than the edit)."""
    cache = mutator.__dict__.setdefault("_operations", {})
    entry = cache.get(id(candidate))
    if entry is None or entry[0] is not candidate:
        entry = cache[id(candidate)] = (candidate, as_operation(
            candidate, f"{mutator._name}: candidate {candidate!r}"))
    return entry[1]


def same_op(node: Node, op: Operation) -> bool:
    """Whether ``op`` computes what ``node`` already does (same kind, target, spec)."""
    if op.kind != node.kind or op.kind == "subgraph":
        return False
    return op.target == node.op.target and op.spec == node.op.spec \
        and (not op.kwargs or op.kwargs == node.op.kwargs)


def steps(mutator: Mutator, count: int | None) -> Iterator[int]:
    """Step numbers of a growing mutator: ``range(count)``, or while a choice ``"grow{i}"``
    says True (``count=None``: an open-ended mutator; the default, False, stops growth)."""
    if count is not None:
        yield from range(count)
        return
    i = 0
    while mutator.choose([False, True], label=f"{mutator._name}/grow{i}"):
        yield i
        i += 1


# ---- shapes of the graph being mutated ------------------------------------------------------

_SHAPE_CACHE: dict[str, dict[int, Any]] = {}
_CACHE_SIZE = 256


def node_shapes(graph: Graph, example_input: Any) -> dict[int, Any]:
    """uid -> output shape of every node of ``graph`` run on ``example_input``.

    Runs on the meta device (no memory, no arithmetic). Nodes after one that fails to run
    are missing from the result. Cached on the graph's content, so a mutator that sees the
    same graph in many samples pays once.
    """
    inputs = example_input if isinstance(example_input, tuple) else (example_input,)
    example = [[shape_of(x), str(getattr(x, "dtype", repr(x)))] for x in inputs]
    key = json.dumps([example, [[n.uid, n.op.to_data()] for n in graph.nodes],
                      sorted((s.uid, d.uid, p) for s, d, p in graph.edges())], sort_keys=True)
    if key in _SHAPE_CACHE:
        return _SHAPE_CACHE[key]
    shapes: dict[int, Any] = {}
    inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs)
    try:
        with torch.device("meta"), torch.no_grad():
            ShapeRecorder(graph, shapes).run(*inputs)
    except Exception:  # noqa: BLE001 - a graph that does not run: shapes up to the failure
        pass
    if len(_SHAPE_CACHE) >= _CACHE_SIZE:
        _SHAPE_CACHE.pop(next(iter(_SHAPE_CACHE)))
    _SHAPE_CACHE[key] = shapes
    return shapes


def shapes_of(mutator: Mutator, why: str, required: bool) -> dict[int, Any] | None:
    """Shapes of the graph ``mutator`` edits, from the space's example input; None (or a
    :class:`MutationError` when ``required``) if the space has none."""
    example = mutator._ctx.example_input
    if example is None:
        if required:
            raise MutationError(f"{mutator._name}: {why} needs shapes; give the ModelSpace an "
                                f"example_input")
        return None
    return node_shapes(mutator.graph, example)


def is_tensor_shape(shape: Any) -> bool:
    return isinstance(shape, list) and all(isinstance(d, int) for d in shape)
