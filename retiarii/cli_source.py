"""The Python source of a stored model graph, under the store's trust rule: what both
``retiarii export`` paths (multi-trial and one-shot) write. A store is code: its graphs may name
only torch, operator, math and the space's own code, and no method call or attribute read may
reach a dunder (``x.__class__``...), the way out of the references the rule allows."""
from __future__ import annotations

from typing import Any

__all__ = ["check_attributes", "trusted_source"]


def check_attributes(graph: Any, rule: Any) -> None:
    """Refuse the method calls and attribute reads of a stored graph that reach dunders."""
    import builtins

    from .refs import resolve_ref

    for node in graph.nodes:
        op = node.op
        if op.kind == "method":
            rule.check_attribute(op.target, f"node {node.name}: method")
        elif op.kind == "function" and resolve_ref(op.target) is builtins.getattr:
            rule.check_attribute(op.args[1] if len(op.args) > 1 else None,
                                 f"node {node.name}: attribute")
        elif op.kind == "subgraph" and op.graph is not None:
            check_attributes(op.graph, rule)


def trusted_source(data: dict, class_name: str, rule: Any, where: str,
                   error: type[Exception]) -> str:
    """The source of the graph ``data`` as class ``class_name``, its references resolved
    under ``rule`` only; ``error`` naming ``where`` when the graph reaches outside it."""
    from .graph import Graph
    from .refs import RefError, only_trusted

    try:
        with only_trusted(rule):
            graph = Graph.from_data(data)
            check_attributes(graph, rule)
            return graph.to_source(class_name)
    except RefError as e:
        raise error(f"{where}: {e}") from None
