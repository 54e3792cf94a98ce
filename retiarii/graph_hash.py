"""Structural hashes of a Graph: equal structures hash equal, whatever their names and uids.

The engine tells models (and the nodes two models share) apart by what they compute, never by
how they are named: a node's hash covers its operation (attribute paths left out) and the
hashes of the nodes feeding it, port by port. :meth:`Graph.node_hashes
<retiarii.graph.Graph.node_hashes>` and :meth:`Graph.structural_hash
<retiarii.graph.Graph.structural_hash>` are these functions; this module sits below graph.py
and reads a graph through its public API only (``nodes``, ``input_nodes``, ``Node.inputs``).

Example::

    >>> a = retiarii.trace(nn.Sequential(nn.Linear(4, 8), nn.ReLU()))
    >>> b = a.copy(); b.rename(b["1"], "act")
    >>> structural_hash(a) == structural_hash(b)
    True
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Callable

__all__ = ["node_hashes", "structural_hash"]


def node_hashes(graph: Any, view: Callable[[Any, dict], dict] | None = None,
                chain: Callable[[Any, list], list] = lambda _node, ins: ins) -> dict[int, str]:
    """uid -> hash of (op, inputs' hashes), names/uids ignored; ``view``, ``chain``: rewrite them.

    Args:
        graph: the :class:`~retiarii.graph.Graph`.
        view: ``view(node, op data) -> op data`` hashed instead of the operation's own data.
        chain: ``chain(node, input hashes) -> list`` hashed instead of the inputs' hashes.
    """
    hashes: dict[int, str] = {}
    seen_attrs: set[str] = set()
    for node in graph.nodes:
        op = node.op.to_data(with_names=False) if view is None else view(
            node, node.op.to_data(with_names=False))
        if node.kind == "subgraph":
            op["graph"] = structural_hash(node.op.graph)
        if node.kind == "module":
            # A second call of one module (tied weights) differs from an independent copy.
            op["reuses_module"] = node.attr in seen_attrs
            seen_attrs.add(node.attr)
        if node.kind == "input":  # its position matters, not the argument's name
            op.pop("target", None)
            op["position"] = [n.uid for n in graph.input_nodes].index(node.uid)
        ins = chain(node, [hashes[i.uid] if i is not None else None for i in node.inputs])
        hashes[node.uid] = hashlib.sha256(json.dumps([op, ins], sort_keys=True).encode()).hexdigest()
    return hashes


def structural_hash(graph: Any) -> str:
    """Hash of the whole structure: equal structures hash equal, whatever names and uids."""
    return hashlib.sha256("".join(sorted(node_hashes(graph).values())).encode()).hexdigest()
