"""Finding a mutator's targets in a graph: names, globs, op types, chains and subgraph patterns.

Example::

    >>> match_targets(g, "layer1.*.conv*")               # every node whose name matches
    [Node('layer1.0.conv1', Conv2d, uid=4), ...]
    >>> match_targets(g, Chain(nn.ReLU, nn.MaxPool2d, nn.Linear))   # one tuple per match
    [(Node('relu', ...), Node('pool', ...), Node('fc', ...))]
"""
from __future__ import annotations

import difflib
import fnmatch
import functools
import re
from typing import Any, Callable

import networkx as nx
import torch
from networkx.algorithms import isomorphism

from .codec import ref_of, resolve_ref
from .graph import Graph, Node


class TargetError(LookupError):
    """Targets that match no node; the message names the pattern and the closest nodes."""


class Pattern:
    """A subgraph pattern: a networkx DiGraph whose nodes carry ``match`` (anything
    :func:`predicate` accepts). Matched by subgraph monomorphism, so extra edges between the
    matched nodes (skip connections) do not prevent a match.

    Args:
        graph: the pattern graph.
        order: the pattern nodes in the order ``mutate`` receives them (default: graph order).
    """

    def __init__(self, graph: nx.DiGraph, order: list | None = None):
        self.graph = graph
        self.order = order or list(graph.nodes)

    def __repr__(self):
        return f"Pattern({[self.graph.nodes[n]['match'] for n in self.order]})"


class Chain(Pattern):
    """A path of nodes, each matched by name, glob, module class or function:
    ``Chain("relu", nn.MaxPool2d, nn.Linear)``."""

    def __init__(self, *elements: Any):
        g = nx.DiGraph()
        for i, element in enumerate(elements):
            g.add_node(i, match=element)
            if i:
                g.add_edge(i - 1, i)
        super().__init__(g, list(range(len(elements))))
        self.elements = elements

    def __repr__(self):
        return f"Chain{self.elements!r}"


@functools.lru_cache(maxsize=512)
def _glob(pattern: str) -> Callable:
    """``fnmatch.fnmatchcase(name, pattern)`` as a compiled regex match, made once."""
    return re.compile(fnmatch.translate(pattern)).match


def predicate(spec: Any) -> Callable[[Node], bool]:
    """A node test from a name, a glob, a module class, a function, or a callable(Node)."""
    if isinstance(spec, str):
        if any(c in spec for c in "*?["):
            match = _glob(spec)
            return lambda n: match(n.name) is not None
        return lambda n: n.name == spec
    if isinstance(spec, type):
        def is_module_of(n: Node) -> bool:
            if n.kind != "module":
                return False
            try:
                return issubclass(resolve_ref(n.op.spec["cls"]), spec)
            except (ImportError, AttributeError):
                return False
        return is_module_of
    if callable(spec):
        try:
            ref = ref_of(spec)
        except Exception:  # noqa: BLE001 - a user predicate over nodes
            return spec
        return lambda n: n.kind == "function" and n.op.target == ref
    raise TypeError(f"cannot match nodes with {spec!r}; give a name, a glob, a module class, "
                    f"a function, or a Chain/Pattern")


def _closest(graph: Graph, spec: Any) -> str:
    names = [n.name for n in graph.nodes]
    close = difflib.get_close_matches(str(spec).replace("*", ""), names, n=5, cutoff=0.3)
    return ", ".join(close or names[:5])


def match_targets(graph: Graph, targets: Any) -> list:
    """Nodes matched by ``targets`` (see :func:`retiarii.apply_mutator`), in graph order; a
    :class:`Pattern` gives one tuple of nodes per match."""
    if isinstance(targets, Pattern):
        return _match_pattern(graph, targets)
    if isinstance(targets, (list, tuple)):
        found: list = []
        for t in targets:
            found += match_targets(graph, t)
        return found
    test = predicate(targets)
    found = [n for n in graph.nodes if test(n)]
    if not found:
        raise TargetError(f"targets {targets!r} match no node of the graph; "
                          + (_composite_hint(graph, targets)
                             or f"closest node names: {_closest(graph, targets)}"))
    return found


def _composite_hint(graph: Graph, spec: Any) -> str | None:
    """For a target naming a composite module (traced through into many nodes, so no node
    carries its name or class): how to target it. None for any other target."""
    fix = ("mark its class a leaf (decorate it with @retiarii.leaf, or pass it to "
           "ModelSpace(leaf_modules=[...])) to keep it as one node, or target its children")
    if isinstance(spec, str) and not any(c in spec for c in "*?["):
        children = [n.name for n in graph.nodes if n.name.startswith(spec + ".")]
        if children:
            return (f"{spec!r} is a composite module, traced into {len(children)} nodes: {fix} "
                    f"(\"{spec}.*\" matches them all), e.g. {', '.join(children[:5])}")
    if isinstance(spec, type) and issubclass(spec, torch.nn.Module) \
            and not getattr(spec, "_retiarii_leaf", False) \
            and not spec.__module__.startswith(("torch.nn", "torch.ao.nn")):
        return (f"{spec.__name__} is a composite module (traced through into its children, so "
                f"no node is one): {fix} by name")
    return None


def _match_pattern(graph: Graph, pattern: Pattern) -> list[tuple]:
    host = nx.DiGraph()  # parallel edges do not matter for matching
    host.add_nodes_from((n.uid, {"node": n}) for n in map(graph.node_by_uid, graph.uids()))
    host.add_edges_from((s.uid, d.uid) for s, d, _ in graph.edges())
    pat = nx.DiGraph(pattern.graph)
    for p in pat:
        pat.nodes[p]["test"] = predicate(pattern.graph.nodes[p]["match"])
    matcher = isomorphism.DiGraphMatcher(
        host, pat, node_match=lambda h, p: p["test"](h["node"]))
    order = {n.uid: i for i, n in enumerate(graph.nodes)}
    found = []
    for mapping in matcher.subgraph_monomorphisms_iter():
        inverse = {p: h for h, p in mapping.items()}
        found.append(tuple(graph.node_by_uid(inverse[p]) for p in pattern.order))
    if not found:
        elements = [pattern.graph.nodes[p]["match"] for p in pattern.order]
        hints = [_composite_hint(graph, e) for e in elements
                 if not any(predicate(e)(n) for n in graph.nodes)]
        raise TargetError(f"pattern {pattern!r} matches no subgraph; "
                          + (next((h for h in hints if h), None)
                             or f"closest node names: {_closest(graph, elements[0])}"))
    found.sort(key=lambda match: [order[n.uid] for n in match])
    return found
