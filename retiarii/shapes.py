"""Shape propagation: run a model's graph once on the space's example input, node by node.

It is an analysis written as an ``fx.Interpreter`` (as torch.fx's ShapeProp): every node's
output shape lands in ``node.meta["shape"]``; a node that fails raises
:class:`ShapeMismatchError` naming it, the shape it expected (when its op says: the input
channels of a convolution, the features of a linear layer), the shapes it got, and the choices
that led there. Lazy modules (``nn.LazyConv2d``, ``nn.LazyLinear``) get their sizes from this
run and their nodes become the concrete modules, so the graph, its hash and its export are
concrete.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .codec import resolve_ref
from .modspec import module_spec


class ShapeMismatchError(ValueError):
    """A model whose shapes do not fit; see the module docstring."""

    def __init__(self, node: str, expected: Any, actual: Any, choices: dict, detail: str):
        self.node, self.expected, self.actual, self.choices = node, expected, actual, choices
        exp = f"expected {expected}, " if expected is not None else ""
        super().__init__(f"shape mismatch at node {node!r}: {exp}got inputs of shape {actual} "
                         f"({detail}); choices that led there: {choices}")


def _expected(spec: dict, shapes: list) -> str | None:
    """What a layer expects of its first input, read from its constructor arguments."""
    cls = resolve_ref(spec["cls"])
    m = getattr(cls, "__name__", "")
    kwargs = spec.get("kwargs", {})
    args = spec.get("args", [])
    first = args[0] if args else None
    if m.startswith("Conv") or m.startswith("BatchNorm") or m.startswith("InstanceNorm"):
        channels = first if first is not None else kwargs.get("in_channels",
                                                              kwargs.get("num_features"))
        return f"{channels} channels in dim 1"
    if m in ("Linear", "Bilinear"):
        return f"{first if first is not None else kwargs.get('in_features')} features in the " \
               f"last dim"
    return None


def _shape(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return list(value.shape)
    if isinstance(value, (list, tuple)):
        return [_shape(v) for v in value]
    return None


class _Prop(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, model):
        super().__init__(gm)
        self.extra_traceback = False  # our error already names the node; keep its message
        self.model = model
        self.ir = model.graph

    def run_node(self, n: fx.Node) -> Any:
        uid = n.meta.get("retiarii_uid")
        try:
            out = super().run_node(n)
        except Exception as e:  # noqa: BLE001 - every failure is reported at its node
            if uid is None:
                raise
            node = self.ir.node_by_uid(uid)
            ins = [_shape(self.env[a]) for a in n.all_input_nodes]
            spec = node.op.spec if node.kind == "module" else None
            raise ShapeMismatchError(node.name, _expected(spec, ins) if spec else None, ins,
                                     _choices_for(self.model, node), f"{type(e).__name__}: {e}"
                                     .splitlines()[0][:300]) from None
        if uid is not None:
            self.ir.node_by_uid(uid).meta["shape"] = _shape(out)
        return out


def _choices_for(model, node) -> dict:
    """The choices made by the mutations that touched ``node`` or any node upstream of it
    (a width changed three layers up breaks this one)."""
    import networkx as nx

    uids = {node.uid} | nx.ancestors(node.graph._nx, node.uid)
    labels: list[str] = []
    for rec in model.history:
        if uids & {rec.get(k) for k in ("node", "dst", "src")} or \
                uids & set(rec.get("nodes", ())):
            labels += [c for c in rec.get("choices", []) if c not in labels]
    return {label: model.sample[label] for label in labels if label in model.sample}


def propagate(model, example_input: Any) -> None:
    """Run ``model.graph`` on ``example_input``; record shapes; settle lazy modules in place."""
    gm = model.graph.to_module()
    gm.eval()  # batch statistics of a batch of one would fail in train mode
    inputs = example_input if isinstance(example_input, tuple) else (example_input,)
    with torch.no_grad():
        _Prop(gm, model).run(*inputs)
    for node in model.graph.nodes:
        if _is_lazy(node):
            settled = gm.get_submodule(node.attr)
            node.op.spec = module_spec(settled)
            model.history.append({"mutator": "shapes", "primitive": "materialize",
                                  "node": node.uid, "name": node.name, "choices": []})
    model.graph._order = None


def _is_lazy(node) -> bool:
    return node.kind == "module" and \
        resolve_ref(node.op.spec["cls"]).__name__.startswith("Lazy")


def has_lazy(graph) -> bool:
    """Whether any module of ``graph`` still waits for its first input to know its sizes."""
    return any(_is_lazy(n) for n in graph.nodes)
