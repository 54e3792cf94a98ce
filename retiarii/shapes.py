"""Shape propagation: run a model's graph once on the space's example input, node by node.

Every node's output shape lands in ``node.meta["shape"]``; a node that fails raises
:class:`ShapeMismatchError` naming it, the shape it expected (when its op says: the input
channels of a convolution, the features of a linear layer), the shapes it got, and the choices
that led there. Lazy modules (``nn.LazyConv2d``, ``nn.LazyLinear``) get their sizes from this
run and their nodes become the concrete modules, so the graph, its hash and its export are
concrete.

Two runs, the second only when the first does not succeed. The direct run calls the graph's
nodes one by one without emitting an ``nn.Module``, taking each layer from a cache of modules
by spec shared by every model checked in the process (building and initializing layers is
most of the cost of a check, and a space's models share their layers' specs). A graph it
cannot run (a subgraph node) and every failure hand over to the reference run, an
``fx.Interpreter`` (as torch.fx's ShapeProp) over the emitted module, fresh weights and all,
which decides and reports.
"""
from __future__ import annotations

import collections
import itertools
import json
import threading
from typing import Any

import torch
import torch.fx as fx

from .codec import decode, resolve_ref
from .modspec import build_module, module_spec


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
    uids = {node.uid} | node.graph.ancestor_uids(node)
    labels: list[str] = []
    for rec in model.history:
        if uids & {rec.get(k) for k in ("node", "dst", "src")} or \
                uids & set(rec.get("nodes", ())):
            labels += [c for c in rec.get("choices", []) if c not in labels]
    return {label: model.sample[label] for label in labels if label in model.sample}


def propagate(model, example_input: Any) -> None:
    """Run ``model.graph`` on ``example_input``; record shapes; settle lazy modules in place.

    Raises:
        ShapeMismatchError: see the module docstring.
    """
    try:
        settled = _direct_run(model.graph, example_input)
    except Exception:  # noqa: BLE001 - the reference run below decides, and reports
        settled = None
    if settled is None:
        _reference_run(model, example_input)
        return
    for node, module in settled:
        _settle(model, node, module)


def _settle(model, node, module) -> None:
    """``node`` (a lazy module) becomes the concrete module its first input made of it."""
    node.op.spec = module_spec(module)
    model.history.append({"mutator": "shapes", "primitive": "materialize",
                          "node": node.uid, "name": node.name, "choices": []})


class _NeedsReferenceRun(Exception):
    """The direct run cannot interpret this graph."""


# Modules the direct run computes with, by spec: a space's models are built from a small
# vocabulary of layers, so most of a model's modules were built for an earlier one. They only
# ever run in eval mode without gradients (no state changes); lazy modules are never shared.
_SHARED: collections.OrderedDict[str, tuple[torch.nn.Module, int]] = collections.OrderedDict()
_SHARED_MAX_ELEMENTS = 1 << 25  # weights kept, in elements (128 MB of float32)
_shared_elements = 0
_SHARED_LOCK = threading.Lock()  # spaces may be instantiated from several threads


def _shared_module(spec: dict) -> torch.nn.Module:
    """A module of ``spec`` (weights as its constructor makes them), shared between runs."""
    global _shared_elements
    key = json.dumps(spec, sort_keys=True)
    with _SHARED_LOCK:
        hit = _SHARED.get(key)
        if hit is not None:
            _SHARED.move_to_end(key)
            return hit[0]
    module = build_module(spec).eval()
    size = sum(t.numel() for t in itertools.chain(module.parameters(), module.buffers()))
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = (module, size)
            _shared_elements += size
        while _shared_elements > _SHARED_MAX_ELEMENTS and len(_SHARED) > 1:
            _, (_, dropped) = _SHARED.popitem(last=False)
            _shared_elements -= dropped
    return module


def _direct_run(graph, example_input: Any) -> list:
    """Shapes of every node from running the graph's nodes one by one (modules from
    :func:`_shared_module`); returns the lazy nodes with their settled modules. Raises when the
    run fails or cannot be done (see the module docstring)."""
    from .codegen import _check_ports, _init_spec_shape

    inputs = list(example_input if isinstance(example_input, tuple) else (example_input,))
    modules: dict[str, torch.nn.Module] = {}
    lazy = []
    env: dict[int, Any] = {}
    shapes: dict[int, Any] = {}
    with torch.no_grad():
        for node in graph.nodes:
            ins = [env[x.uid] for x in _check_ports(node)]
            kind = node.kind
            args = decode(node.op.args, ins, build_module)
            kwargs = {k: decode(v, ins, build_module) for k, v in node.op.kwargs.items()}
            if kind == "input":
                if inputs:
                    out = inputs.pop(0)
                elif "default" in (node.op.spec or {}):
                    out = decode(node.op.spec["default"])
                else:
                    raise _NeedsReferenceRun("fewer example inputs than graph inputs")
            elif kind == "module":
                module = modules.get(node.attr)
                if module is None:
                    if _is_lazy(node):  # its sizes come from its first input: build it as is
                        module = build_module(node.op.spec).eval()
                        lazy.append((node, module))
                    else:
                        module = _shared_module(node.op.spec)
                    modules[node.attr] = module
                out = module(*args, **kwargs)
            elif kind == "function":
                out = resolve_ref(node.op.target)(*args, **kwargs)
            elif kind == "method":
                out = getattr(args[0], node.op.target)(*args[1:], **kwargs)
            elif kind == "param":
                shape, dtype = _init_spec_shape(node.op.spec)
                out = torch.zeros(shape, dtype=dtype)  # (any value has the shape)
            elif kind == "constant":
                out = decode(node.op.spec["value"])
            elif kind == "output":
                out = args[0]
            else:  # a subgraph: emitted as a module of its own, left to the reference run
                raise _NeedsReferenceRun(f"node kind {kind!r}")
            env[node.uid] = out
            shapes[node.uid] = _shape(out)
    for uid, shape in shapes.items():
        graph.node_by_uid(uid).meta["shape"] = shape
    return lazy


def _reference_run(model, example_input: Any) -> None:
    gm = model.graph.to_module()
    gm.eval()  # batch statistics of a batch of one would fail in train mode
    inputs = example_input if isinstance(example_input, tuple) else (example_input,)
    with torch.no_grad():
        _Prop(gm, model).run(*inputs)
    for node in model.graph.nodes:
        if _is_lazy(node):
            _settle(model, node, gm.get_submodule(node.attr))


def _is_lazy(node) -> bool:
    return node.kind == "module" and \
        resolve_ref(node.op.spec["cls"]).__name__.startswith("Lazy")


def has_lazy(graph) -> bool:
    """Whether any module of ``graph`` still waits for its first input to know its sizes."""
    return any(_is_lazy(n) for n in graph.nodes)
