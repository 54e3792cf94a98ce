"""Running a graph node by node: the one dispatch on node kinds that analyses and emitters share.

As torch.fx's ``Interpreter``: :meth:`Interpreter.run` walks the nodes in topological order,
hands each one the values arriving on its input ports and calls the method for its kind
(``on_input``, ``on_module``, ``on_function``, ``on_method``, ``on_param``, ``on_constant``,
``on_subgraph``, ``on_output``). The base class computes real values, with modules built from
their specs (fresh weights, eval mode); a subclass overrides the methods it changes. Shape
propagation (:mod:`retiarii.shapes`) records what each node returns; code generation
(:mod:`retiarii.codegen`) returns fx nodes or source expressions instead of tensors.

Example::

    class CountModules(Interpreter):
        def on_module(self, node, inputs):
            self.calls = getattr(self, "calls", 0) + 1
            return super().on_module(node, inputs)

    out = CountModules(graph).run(torch.randn(1, 3, 32, 32))
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .codec import decode, resolve_ref
from .graph import Graph, GraphError, Node
from .modspec import build_module


def init_tensor(spec: dict) -> torch.Tensor:
    """Initial value of a param node's tensor: stored exactly when small, else a default."""
    if "init" in spec:
        return decode(spec["init"]).clone()
    shape, dtype = spec["shape"], getattr(torch, spec["dtype"])
    if spec["buffer"] or not dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype)
    return nn.init.trunc_normal_(torch.empty(shape, dtype=dtype), std=0.02)


class Interpreter:
    """Runs ``graph``; see the module docstring.

    Args:
        graph: the graph to run. ``run`` may be called several times; modules built for one
            call are kept for the next.
    """

    def __init__(self, graph: Graph):
        self.graph = graph
        self.env: dict[int, Any] = {}  # uid -> the value the node computed in this run
        self.modules: dict[str, nn.Module] = {}  # attribute path -> module (tied calls share)
        self._args: list = []
        self._kwargs: dict[str, Any] = {}

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Run every node, the graph's inputs taken from ``args`` in order, then from ``kwargs``
        by name, then from their defaults; return what the output node computed."""
        self.env = {}
        self._args, self._kwargs = list(args), kwargs
        out = None
        for node in self.graph.nodes:
            value = self.env[node.uid] = self.run_node(node, self.fetch_inputs(node))
            if node.kind == "output":
                out = value
        return out

    def fetch_inputs(self, node: Node) -> list:
        """The values arriving on ``node``'s input ports, in port order."""
        inputs = node.inputs
        if None in inputs:
            raise GraphError(f"node {node.name!r} has a dangling input port "
                             f"{inputs.index(None)}; connect it before emitting code")
        env = self.env
        return [env[x.uid] for x in inputs]

    def run_node(self, node: Node, inputs: list) -> Any:
        """One node's value: the method for its kind. Override to watch every node."""
        return getattr(self, "on_" + node.kind)(node, inputs)

    def call_args(self, node: Node, inputs: list) -> tuple[list, dict]:
        """``node``'s call template decoded, ports filled with ``inputs``."""
        return (decode(node.op.args, inputs, build_module),
                {k: decode(v, inputs, build_module) for k, v in node.op.kwargs.items()})

    def get_module(self, node: Node) -> nn.Module:
        """The module a module node calls, built from its spec on first use."""
        module = self.modules.get(node.attr)
        if module is None:
            module = self.modules[node.attr] = build_module(node.op.spec).eval()
        return module

    # ---- one method per node kind ---------------------------------------------------------
    def on_input(self, node: Node, inputs: list) -> Any:
        if self._args:
            return self._args.pop(0)
        name = node.op.target or node.name
        if name in self._kwargs:
            return self._kwargs[name]
        if "default" in (node.op.spec or {}):
            return decode(node.op.spec["default"])
        raise TypeError(f"the graph's input {name!r} was not given and has no default")

    def on_module(self, node: Node, inputs: list) -> Any:
        args, kwargs = self.call_args(node, inputs)
        return self.get_module(node)(*args, **kwargs)

    def on_function(self, node: Node, inputs: list) -> Any:
        args, kwargs = self.call_args(node, inputs)
        return resolve_ref(node.op.target)(*args, **kwargs)

    def on_method(self, node: Node, inputs: list) -> Any:
        args, kwargs = self.call_args(node, inputs)
        return getattr(args[0], node.op.target)(*args[1:], **kwargs)

    def on_param(self, node: Node, inputs: list) -> Any:
        return init_tensor(node.op.spec)

    def on_constant(self, node: Node, inputs: list) -> Any:
        return decode(node.op.spec["value"])

    def on_subgraph(self, node: Node, inputs: list) -> Any:
        args, kwargs = self.call_args(node, inputs)
        return Interpreter(node.op.graph).run(*args, **kwargs)

    def on_output(self, node: Node, inputs: list) -> Any:
        return decode(node.op.args[0], inputs, build_module)
