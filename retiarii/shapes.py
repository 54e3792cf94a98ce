"""Shape propagation: run a model's graph once on the space's example input, node by node.

Every node's output shape lands in ``node.meta["shape"]``; a node that fails raises
:class:`ShapeMismatchError` naming it, the shape it expected (when its op says: the input
channels of a convolution, the features of a linear layer), the shapes it got, and the choices
that led there. Lazy modules (``nn.LazyConv2d``, ``nn.LazyLinear``) get their sizes from this
run and their nodes become the concrete modules, so the graph, its hash and its export are
concrete.

Two runs, the second only when the first does not succeed, both an
:class:`~retiarii.interpreter.Interpreter` that records every node's shape
(:class:`ShapeRecorder`). The direct run calls the graph's nodes one by one without emitting an
``nn.Module``, taking each layer from a cache of modules by spec shared by every model checked
in the process (building and initializing layers is most of the cost of a check, and a space's
models share their layers' specs). A graph it cannot run (a subgraph node) and every failure
hand over to the reference run, which runs the nodes with the layers and tensors of the
emitted module, fresh weights and all, and decides and reports.
"""
from __future__ import annotations

import collections
import functools
import itertools
import json
import threading
from typing import Any

import torch

from .codec import resolve_ref
from .codegen import to_module
from .interpreter import Interpreter
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


def shape_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return list(value.shape)
    if isinstance(value, (list, tuple)):
        return [shape_of(v) for v in value]
    return None


class ShapeRecorder(Interpreter):
    """Runs a graph and records what every node returns as its shape: ``shapes[uid]``."""

    def __init__(self, graph, shapes: dict | None = None):
        super().__init__(graph)
        self.shapes: dict[int, Any] = {} if shapes is None else shapes

    def run_node(self, node, inputs: list) -> Any:
        out = super().run_node(node, inputs)
        self.shapes[node.uid] = shape_of(out)
        return out


class _ReferenceRun(ShapeRecorder):
    """Runs the graph with the layers and tensors of its emitted module (``gm``), and reports
    a failing node as a :class:`ShapeMismatchError`."""

    def __init__(self, model, gm: torch.nn.Module):
        super().__init__(model.graph)
        self.model, self.gm = model, gm

    def get_module(self, node) -> torch.nn.Module:
        return self.gm.get_submodule(node.attr)

    def on_subgraph(self, node, inputs: list) -> Any:
        args, kwargs = self.call_args(node, inputs)
        return self.gm.get_submodule(node.attr)(*args, **kwargs)

    def on_param(self, node, inputs: list) -> Any:
        return functools.reduce(getattr, node.attr.split("."), self.gm)

    def run_node(self, node, inputs: list) -> Any:
        try:
            return super().run_node(node, inputs)
        except Exception as e:  # noqa: BLE001 - every failure is reported at its node
            feeders = list(dict.fromkeys(x.uid for x in node.inputs))  # each input node once
            ins = [shape_of(self.env[uid]) for uid in feeders]
            spec = node.op.spec if node.kind == "module" else None
            raise ShapeMismatchError(node.name, _expected(spec, ins) if spec else None, ins,
                                     _choices_for(self.model, node), f"{type(e).__name__}: {e}"
                                     .splitlines()[0][:300]) from None


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


def shared_module_of(spec: dict) -> torch.nn.Module:
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


class _DirectRun(ShapeRecorder):
    """The direct run: layers from :func:`shared_module_of` (a lazy one built as it is, its sizes
    come from its first input), parameters as zeros (any value has the shape), subgraphs left
    to the reference run."""

    def __init__(self, graph):
        super().__init__(graph)
        self.lazy: list = []  # (node, module) of every lazy module, settled by this run

    def get_module(self, node) -> torch.nn.Module:
        module = self.modules.get(node.attr)
        if module is None:
            if _is_lazy(node):
                module = build_module(node.op.spec).eval()
                self.lazy.append((node, module))
            else:
                module = shared_module_of(node.op.spec)
            self.modules[node.attr] = module
        return module

    def on_param(self, node, inputs: list) -> Any:
        spec = node.op.spec
        return torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]))

    def on_subgraph(self, node, inputs: list) -> Any:
        raise _NeedsReferenceRun("a subgraph node: emitted as a module of its own")


def _direct_run(graph, example_input: Any) -> list:
    """Shapes of every node from running the graph's nodes one by one (modules from
    :func:`shared_module_of`); returns the lazy nodes with their settled modules. Raises when the
    run fails or cannot be done (see the module docstring)."""
    inputs = example_input if isinstance(example_input, tuple) else (example_input,)
    run = _DirectRun(graph)
    with torch.no_grad():
        run.run(*inputs)
    for uid, shape in run.shapes.items():
        graph.node_by_uid(uid).meta["shape"] = shape
    return run.lazy


def _reference_run(model, example_input: Any) -> None:
    gm = to_module(model.graph)
    gm.eval()  # batch statistics of a batch of one would fail in train mode
    inputs = example_input if isinstance(example_input, tuple) else (example_input,)
    run = _ReferenceRun(model, gm)
    try:
        with torch.no_grad():
            run.run(*inputs)
    finally:  # the shapes up to a failing node too
        for uid, shape in run.shapes.items():
            model.graph.node_by_uid(uid).meta["shape"] = shape
    for node in model.graph.nodes:
        if _is_lazy(node):
            _settle(model, node, gm.get_submodule(node.attr))


def _is_lazy(node) -> bool:
    return node.kind == "module" and \
        resolve_ref(node.op.spec["cls"]).__name__.startswith("Lazy")


def has_lazy(graph) -> bool:
    """Whether any module of ``graph`` still waits for its first input to know its sizes."""
    return any(_is_lazy(n) for n in graph.nodes)
