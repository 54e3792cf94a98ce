"""Graph IR -> runnable ``nn.Module``, through torch.fx (:func:`to_module`).

``to_module`` installs one module per module attribute path (creating the intermediate
containers, so state-dict keys equal the traced model's), then emits an ``fx.Graph`` with the
nodes in the graph's topological order, which for a traced graph is the original execution
order: outputs are bit-identical to the original model's on CPU.

The helpers both backends use (module owners, registration order, fresh Python names) are
here too; :mod:`.source_backend` imports them.
"""
from __future__ import annotations

import builtins
import inspect
import keyword
import re
from typing import Any, Callable

import torch.fx as fx
from torch import nn

from ..codec import decode, resolve_ref
from ..graph import Graph, Node
from ..interpreter import Interpreter, init_tensor
from ..modspec import build_module

__all__ = ["to_module"]

# ---- shared helpers ------------------------------------------------------------------------


def owner_paths(graph: Graph) -> set[str]:
    return {n.attr for n in graph.nodes if n.kind in ("module", "subgraph")}


def owned_by_module(path: str, owners: set[str]) -> bool:
    parts = path.split(".")
    return any(".".join(parts[:i]) in owners for i in range(1, len(parts)))


def install_value(root: nn.Module, path: str, value: Any, buffer: bool = False,
             persistent: bool = True) -> None:
    *parents, leaf = path.split(".")
    owner = root
    for part in parents:
        child = owner._modules.get(part)
        if child is None:
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    if isinstance(value, nn.Module):
        owner.add_module(leaf, value)
    elif buffer:
        owner.register_buffer(leaf, value, persistent=persistent)
    else:
        owner.register_parameter(leaf, value)


def registration_rank(graph: Graph):
    """path -> its rank in the traced model's module registration order (``meta["modules"]``).

    Modules are installed in this order, not in call order, so that containers, and with them
    state-dict keys, come out in the original's order; paths the original lacks go last.
    """
    rank = {p: i for i, p in enumerate(graph.meta.get("modules", ()))}
    return lambda path: rank.get(path, len(rank))


_BUILTINS = set(dir(builtins))  # (not __builtins__: a dict inside an imported module)


class PyNames:
    """Unique Python identifiers derived from node names."""

    def __init__(self, reserved=("self", "torch", "nn", "F", "operator", "math")):
        self.used = set(reserved)

    def fresh(self, name: str) -> str:
        base = re.sub(r"\W", "_", name).strip("_") or "v"
        if base[0].isdigit():
            base = "_" + base
        if keyword.iskeyword(base) or base in _BUILTINS:
            base += "_"
        out, i = base, 1
        while out in self.used:
            out, i = f"{base}_{i}", i + 1
        self.used.add(out)
        return out


# ---- to_module -----------------------------------------------------------------------------


def to_module(graph: Graph, class_name: str = "GeneratedModel",
              provide: Callable[[Node], Any] | None = None) -> fx.GraphModule:
    """Emit a runnable ``fx.GraphModule`` with fresh weights; see the module docstring.

    Args:
        provide: called with each module, cell (subgraph) and parameter node the module
            installs; what it returns (an ``nn.Module``, or a tensor for a parameter node) is
            installed instead of a fresh one, None builds a fresh one. The super-graph
            (:mod:`retiarii.optim.supergraph`) installs its shared modules this way.
    """
    root = nn.Module()
    owners = owner_paths(graph)
    nodes = graph.nodes
    installed: set[str] = set()
    rank = registration_rank(graph)
    # A parameter's owner is the module path it lives in ("" for the root).
    for node in sorted(nodes, key=lambda n: rank(n.attr if n.kind != "param"
                                                 else n.attr.rpartition(".")[0])):
        given = provide(node) if provide is not None and node.attr not in installed \
            and node.kind in ("module", "subgraph", "param") else None
        if node.kind == "module" and node.attr not in installed:
            install_value(root, node.attr, given if given is not None else build_module(node.op.spec))
            installed.add(node.attr)
        elif node.kind == "subgraph" and (given is not None or provide is None
                                          or node.attr not in installed):
            install_value(root, node.attr, given if given is not None
                     else to_module(node.op.graph, "Cell"))
            installed.add(node.attr)
        elif node.kind == "param" and not owned_by_module(node.attr, owners) \
                and node.attr not in installed:
            installed.add(node.attr)
            spec = node.op.spec
            value = given if given is not None else init_tensor(spec)
            if not spec["buffer"] and given is None:
                value = nn.Parameter(value, requires_grad=spec.get("requires_grad", True))
            install_value(root, node.attr, value, buffer=spec["buffer"],
                     persistent=spec.get("persistent", True))
    constants: dict[int, str] = {}
    for i, node in enumerate(nodes):
        if node.kind == "constant":
            constants[node.uid] = f"_constant_{i}"
            root.register_buffer(constants[node.uid], decode(node.op.spec["value"]),
                                 persistent=False)
    emitter = _FxEmitter(graph, constants)
    emitter.run()
    fxg = emitter.fxg
    gm = fx.GraphModule(root, fxg, class_name)
    # GraphModule copies modules into fresh containers in call order and re-registers buffers
    # as persistent; adopt root's own hierarchy (registration order, non-persistent buffers
    # marked) so the state dict equals the original's, key order included.
    for attr in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
        gm.__dict__[attr] = root.__dict__[attr]
    return gm


class _FxEmitter(Interpreter):
    """Runs the graph on fx nodes: every node becomes the fx node that computes it."""

    def __init__(self, graph: Graph, constants: dict[int, str]):
        super().__init__(graph)
        self.fxg = fx.Graph()
        self.constants = constants  # uid of a constant node -> its buffer's attribute
        self.names = PyNames()

    def run_node(self, node: Node, inputs: list) -> fx.Node:
        out = super().run_node(node, inputs)
        if node.kind not in ("input", "output"):
            out.name = self.names.fresh(node.name)
        out.meta["retiarii_uid"] = node.uid  # lets analyses report our nodes
        return out

    def on_input(self, node, inputs):
        spec = node.op.spec or {}
        default = decode(spec["default"]) if "default" in spec else inspect.Signature.empty
        return self.fxg.placeholder(node.op.target or node.name, default_value=default)

    def on_module(self, node, inputs):
        args, kwargs = self.call_args(node, inputs)
        return self.fxg.call_module(node.attr, tuple(args), kwargs)

    on_subgraph = on_module  # the cell is a GraphModule of its own at node.attr

    def on_function(self, node, inputs):
        args, kwargs = self.call_args(node, inputs)
        return self.fxg.call_function(resolve_ref(node.op.target), tuple(args), kwargs)

    def on_method(self, node, inputs):
        args, kwargs = self.call_args(node, inputs)
        return self.fxg.call_method(node.op.target, tuple(args), kwargs)

    def on_param(self, node, inputs):
        return self.fxg.get_attr(node.attr)

    def on_constant(self, node, inputs):
        return self.fxg.get_attr(self.constants[node.uid])

    def on_output(self, node, inputs):
        return self.fxg.output(decode(node.op.args[0], inputs, build_module))
