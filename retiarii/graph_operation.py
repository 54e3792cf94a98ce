"""What a node of the Graph IR computes: the :class:`Operation` record, and copies of JSON data.

Each node of a :class:`~retiarii.graph.Graph` computes one value with an :class:`Operation`,
by its ``kind``:

==========  =====================================================  ===========================
kind        what it computes                                       ``target``
==========  =====================================================  ===========================
input       a graph input (a ``forward`` argument)                 the argument name
output      the graph's result; ``args[0]`` is its structure       None
module      ``module(*args, **kwargs)``, module from ``spec``     None (the class is in spec)
function    ``fn(*args, **kwargs)``                                 import ref, ``"torch:cat"``
method      ``args[0].name(*args[1:], **kwargs)``                  method name, ``"view"``
param       a parameter or buffer read directly                    None
constant    a tensor constant                                      None
subgraph    a cell: ``graph(*args)``                               None (the Graph is ``graph``)
==========  =====================================================  ===========================

Call arguments are *templates*: encoded values (see :mod:`retiarii.codec`) in which
``{"__in__": k}`` stands for the value arriving on input port ``k``.

This module sits below graph.py (which imports it and re-exports its names): an operation
never needs the graph holding it, only a subgraph operation holds a Graph, which
:meth:`Graph.from_data <retiarii.graph.Graph.from_data>` reads and hands to
:meth:`Operation.from_data`.

Example::

    >>> op = Operation("function", target="torch:cat", args=[[{"__in__": 0}, {"__in__": 1}]])
    >>> op.num_ports, op.describe()
    (2, 'cat')
"""
from __future__ import annotations

import marshal
from dataclasses import dataclass, field
from typing import Any

from .codec import port_indices
from .graph_checks import KINDS, GraphError

__all__ = ["Operation", "copy_data"]


@dataclass
class Operation:
    """What a node computes. All fields are JSON data (already encoded).

    NOTE: [Operation.spec] ``spec`` is the payload of the node's *kind*, and each kind has
    exactly one meaning for it (as torch.fx's ``target`` means a different thing per opcode):

    - ``module``: how to re-create the module, ``{"cls", "args", "kwargs"}`` (modspec.py);
    - ``param``: the tensor's declaration, ``{"shape", "dtype", "buffer", "requires_grad",
      "persistent"}`` and, when small, ``"init"`` (its values);
    - ``constant``: ``{"value"}``, the encoded tensor;
    - ``input``: ``{"default"}`` when the argument has one, else None;
    - ``output``, ``function``, ``method``, ``subgraph``: None.

    One field rather than four keeps the serialized IR (stored in every store's ``models.graph``)
    and every reader of it unchanged; read it only after checking ``kind``.
    """

    kind: str
    target: str | None = None
    args: list = field(default_factory=list)  # call template (encoded), ports as {"__in__": k}
    kwargs: dict = field(default_factory=dict)
    spec: dict | None = None  # the kind's payload: see NOTE: [Operation.spec] above
    attr: str | None = None  # module/param/subgraph: attribute path in the emitted nn.Module
    graph: Any = None  # subgraph only: its Graph (graph.py, which sits above this module)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GraphError(f"unknown operation kind {self.kind!r}; expected one of {KINDS}")

    @property
    def num_ports(self) -> int:
        idx = port_indices([self.args, self.kwargs])
        return max(idx) + 1 if idx else 0

    def to_data(self, with_names: bool = True) -> dict:
        data: dict[str, Any] = {"kind": self.kind}
        if self.target is not None:
            data["target"] = self.target
        if self.args:
            data["args"] = self.args
        if self.kwargs:
            data["kwargs"] = self.kwargs
        if self.spec is not None:
            data["spec"] = self.spec
        if with_names and self.attr is not None:
            data["attr"] = self.attr
        if self.graph is not None:
            data["graph"] = self.graph.to_data()
        return data

    @classmethod
    def from_data(cls, data: dict, graph: Any = None) -> "Operation":
        """The operation ``to_data`` wrote; ``graph``: a subgraph operation's Graph, already
        read from ``data["graph"]`` (by :meth:`Graph.from_data`, which owns the Graph class)."""
        if data.get("graph") is not None and graph is None:
            raise GraphError("a subgraph operation needs its Graph read first: call "
                             "Graph.from_data on the whole graph, not Operation.from_data")
        return cls(kind=data["kind"], target=data.get("target"), args=data.get("args", []),
                   kwargs=data.get("kwargs", {}), spec=data.get("spec"), attr=data.get("attr"),
                   graph=graph)

    def copy(self) -> "Operation":
        return Operation(self.kind, self.target, copy_data(self.args),
                         copy_data(self.kwargs), copy_data(self.spec), self.attr,
                         self.graph.copy() if self.graph is not None else None)

    def describe(self) -> str:
        if self.kind == "module":
            cls = self.spec.get("cls") if isinstance(self.spec, dict) else None
            return cls.rsplit(":", 1)[-1] if isinstance(cls, str) else "module"
        if self.kind in ("function", "method"):
            return str(self.target).rsplit(":", 1)[-1]
        return self.kind


def copy_data(data: Any) -> Any:
    """A deep copy of JSON data (dicts, lists, tuples, scalars), much faster than deepcopy.

    marshal copies exact builtin types in C (this is an in-memory copy, never stored); it
    refuses anything else (a str enum, a tensor), which the walk below copies by hand.
    """
    try:
        return marshal.loads(marshal.dumps(data))
    except ValueError:
        return _copy_walk(data)


def _copy_walk(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _copy_walk(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_copy_walk(v) for v in data)
    return data
