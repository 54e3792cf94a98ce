"""A per-process cache of emitted cells: a group of the architectures of an earlier group
reuses the fx code emitted for it instead of tracing and compiling it again.

Emitting a cell (:func:`retiarii.codegen.to_module`: modules built with fresh weights, an
fx graph interpreted, its Python code generated and compiled) is most of the cost of
:func:`~retiarii.optim.build_group`, and a worker builds the same groups again and again: each
segment of a grouped search is a new job over the same trials. What the emitted code depends
on is the cell's graph alone (its nodes, ops, edges and metadata: :meth:`Graph.to_json`),
never the weights, which the group adopts from its models after emission. So the cache is
keyed by that JSON, and holds per key a *skeleton*: the emitted module tree with every
module, cell and parameter that the group adopts replaced by an empty placeholder (no
weights kept). A hit copies the skeleton's structure (each module object anew, sharing the
compiled classes and the constants) and the group installs its models' modules into the
copy, exactly as into a freshly emitted one.

Example::

    key, module = lookup(cell_graph)    # the first time: (key, None)
    if module is None:
        module = to_module(cell_graph, "Cell")
        ...                             # install the models' modules
        keep(key, module, cell_graph)
    key, module = lookup(cell_graph)    # again: a copy of the skeleton, no emission
"""
from __future__ import annotations

import collections
import itertools
from typing import Any

from torch import nn

from ..graph import Graph

__all__ = ["cache_info", "clear", "keep", "lookup"]

_LIMIT = 64  # cells kept per process: a worker's groups of the last few jobs
_CACHE: collections.OrderedDict[str, nn.Module] = collections.OrderedDict()
_STATS = {"hits": 0, "misses": 0}


def _copy_structure(module: nn.Module) -> nn.Module:
    """A new object per module of the tree, of the same class (an fx module keeps its
    compiled ``forward``), with its own containers (modules, parameters, buffers, hooks)
    holding the same values: installing into the copy never changes the original."""
    # object.__new__: fx's GraphModule.__new__ would make a new class, without the forward
    # compiled onto the original's class
    clone = object.__new__(module.__class__)
    for name, value in module.__dict__.items():
        if isinstance(value, (dict, set, list)):
            value = value.copy()
        clone.__dict__[name] = value
    clone._modules = {name: None if child is None else _copy_structure(child)
                      for name, child in module._modules.items()}
    return clone


def _owner(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    *parents, leaf = path.split(".")
    owner = root
    for part in parents:
        owner = owner._modules[part]
    return owner, leaf


def _skeleton(module: nn.Module, graph: Graph) -> nn.Module:
    """A structure copy of ``module`` without what a group adopted: each module and cell node's
    module is an empty placeholder, each parameter node's tensor None (its name kept, so the
    adopting code finds a parameter or a buffer there), and no flat name of a call
    (``cell_emit._direct_calls``) left pointing at an adopted module."""
    skeleton = _copy_structure(module)
    for node in graph.nodes:
        if node.kind in ("module", "subgraph"):
            owner, leaf = _owner(skeleton, node.attr)
            owner._modules[leaf] = nn.Module()
    for node in graph.nodes:
        if node.kind == "param":
            try:
                owner, leaf = _owner(skeleton, node.attr)
            except KeyError:
                continue  # inside a module replaced above
            for table in (owner._parameters, owner._buffers):
                if leaf in table:
                    table[leaf] = None
    for part in skeleton.modules():
        for name in part.__dict__.get("_flat_calls", ()):
            part.__dict__.pop(name, None)
    return skeleton


def lookup(graph: Graph) -> tuple[str, nn.Module | None]:
    """``(key, module)``: a copy of the skeleton kept for a graph equal to ``graph``, or
    None (emit it, then :func:`keep` it under ``key``). The caller installs every module,
    cell and parameter node's value into a copy (it holds placeholders there); the values it
    keeps (constants) are the emitted ones."""
    key = graph.to_json()
    skeleton = _CACHE.get(key)
    if skeleton is None:
        _STATS["misses"] += 1
        return key, None
    _CACHE.move_to_end(key)
    _STATS["hits"] += 1
    return key, _copy_structure(skeleton)


def keep(key: str, module: nn.Module, graph: Graph) -> None:
    """Remember the emitted ``module`` of ``graph`` (its values installed or not) as a
    skeleton under ``key``; the oldest are forgotten past a limit."""
    _CACHE[key] = _skeleton(module, graph)
    while len(_CACHE) > _LIMIT:
        _CACHE.popitem(last=False)


def cache_info() -> dict[str, Any]:
    """``{"hits", "misses", "size", "kept_bytes"}`` of this process's cache: lookups that
    found a cell, lookups that did not, cells kept, and bytes of the tensors they keep (the
    constants of the cells; never weights)."""
    kept = sum(t.numel() * t.element_size() for skeleton in _CACHE.values()
               for t in itertools.chain(skeleton.parameters(), skeleton.buffers()))
    return {**_STATS, "size": len(_CACHE), "kept_bytes": kept}


def clear() -> None:
    """Forget every cached cell (the counts too)."""
    _CACHE.clear()
    _STATS.update(hits=0, misses=0)
