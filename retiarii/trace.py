"""torch.fx -> Graph IR.

``trace(model)`` runs torch.fx's symbolic tracer and turns its graph into ours: built-in
``torch.nn`` layers become module nodes re-created from their attributes, user modules are
traced through (unless marked leaf), and parameters/buffers read directly become param nodes.

Example::

    >>> g = retiarii.trace(torchvision_like_resnet18())
    >>> g["layer1.0.conv1"].op.spec
    {'cls': 'torch.nn.modules.conv:Conv2d', 'args': [64, 64, 3], 'kwargs': {...}}

A model fx cannot trace (a branch on a tensor's value, iterating over a tensor) raises
:class:`TraceError` naming the module path and the source line, and how to fix it.
"""
from __future__ import annotations

import linecache
import os
import sys
import traceback
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
from torch import nn

from .codec import EncodeError, PortRef, encode, ref_of
from .graph import Graph, Operation
from .modspec import SpecError, is_frozen, is_marked_leaf, is_torch_builtin, module_spec

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(__file__)
_FX_TRACE = fx.Tracer.trace.__code__  # the frame that calls the model's forward

# Modules with their own conversion (inline choices register here): type -> handler.
# A handler gets (converter, fx_node, module) and returns the Node it created.
LEAF_HANDLERS: dict[type, Callable] = {}


class TraceError(Exception):
    """A model that cannot be turned into the IR; the message says where and how to fix it."""


class _Tracer(fx.Tracer):
    def __init__(self, leaf_modules: Iterable):
        super().__init__()
        self.proxy_buffer_attributes = True  # else buffer-only math is folded to a constant
        self._leaf_types = tuple(x for x in leaf_modules if isinstance(x, type))
        self._leaf_ids = {id(x) for x in leaf_modules if isinstance(x, nn.Module)}
        self._leaf_names = {x for x in leaf_modules if isinstance(x, str)}
        self.failed_scope: str | None = None

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return (id(m) in self._leaf_ids or isinstance(m, self._leaf_types)
                or qualname in self._leaf_names or type(m).__name__ in self._leaf_names
                or is_marked_leaf(m) or type(m) in LEAF_HANDLERS or is_torch_builtin(m))

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        node.meta["scope"] = self.scope.module_path
        # The user's line, found by walking frames: fx's record_stack_traces would format the
        # whole stack for every node, a third of the time of tracing a ResNet-50.
        if kind not in ("placeholder", "output"):  # made by fx itself, not by a user line
            node.meta["source"] = _caller_source(sys._getframe(1))
        return node

    def call_module(self, m, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_scope is None:  # the innermost module is the culprit
                self.failed_scope = self.path_of_module(m)
            raise


def _user_frame(tb) -> traceback.FrameSummary | None:
    """The innermost frame of the user's own code (not torch's, not ours)."""
    for frame in reversed(traceback.extract_tb(tb)):
        fname = os.path.abspath(frame.filename)
        if not fname.startswith(_TORCH_DIR) and not fname.startswith(_OWN_DIR):
            return frame
    return None


def _caller_source(frame) -> str | None:
    """``"file:line: code"`` of the innermost frame of user code, from ``frame`` outwards;
    None for nodes fx makes itself, outside the model's code."""
    while frame is not None and frame.f_code is not _FX_TRACE:
        fname = frame.f_code.co_filename
        if not fname.startswith((_TORCH_DIR, _OWN_DIR)):
            code = linecache.getline(fname, frame.f_lineno).strip()
            return f"{fname}:{frame.f_lineno}: {code}"
        frame = frame.f_back
    return None


def _trace_error(root: nn.Module, tracer: _Tracer, exc: Exception) -> TraceError:
    scope = tracer.failed_scope
    where = f"module {scope!r} ({type(root.get_submodule(scope)).__name__})" if scope \
        else f"the top-level module ({type(root).__name__})"
    leaf_name = type(root.get_submodule(scope)).__name__ if scope else "TheModule"
    frame = _user_frame(exc.__traceback__)
    line = f' at {frame.filename}:{frame.lineno}: "{(frame.line or "").strip()}"' if frame else ""
    # the top-level module cannot be an opaque node of its own graph: the branch moves out
    leaf = (f"mark that module a leaf (trace(model, leaf_modules=[{leaf_name}]) or decorate "
            f"its class with @retiarii.leaf) so it is kept as one opaque node" if scope else
            "move that code into a submodule of its own and mark the submodule a leaf "
            "(decorate its class with @retiarii.leaf, or trace(model, leaf_modules=[TheClass])) "
            "so it is kept as one opaque node")
    return TraceError(
        f"cannot trace {where}{line}: {type(exc).__name__}: {exc}\n"
        f"How to fix: if the code branches on or iterates over a tensor's value, {leaf}; if it "
        f"branches on a forward argument that is fixed for the whole search, pass "
        f"concrete_args={{'name': value}}.")


class _Converter:
    """Builds our Graph from a traced fx.Graph."""

    def __init__(self, root: nn.Module, tensor_names: set[str], constants: dict[str, Any],
                 concrete_args: dict[str, Any] | None = None):
        self.root = root
        self.concrete_args = concrete_args or {}
        self.constants = constants
        self.graph = Graph()
        self.tensor_names = tensor_names  # parameters and buffers of the model itself
        self.env: dict[fx.Node, Any] = {}  # fx node -> our Node
        self.inline: list = []  # mutators compiled from inline choices (choices.py)
        self.module_calls: dict[str, int] = {}

    def template(self, value: Any) -> tuple[Any, list]:
        """fx args -> (encoded template, fx nodes feeding the ports in order)."""
        feeds: list[fx.Node] = []

        def walk(v):
            if isinstance(v, fx.Node):
                feeds.append(v)
                return PortRef(len(feeds) - 1)
            if isinstance(v, (list, tuple)):
                out = [walk(x) for x in v]
                return type(v)(out) if not isinstance(v, torch.Size) else torch.Size(out)
            if isinstance(v, dict):
                return {k: walk(x) for k, x in v.items()}
            if isinstance(v, slice):
                return slice(walk(v.start), walk(v.stop), walk(v.step))
            return v

        return encode(walk(value), module_spec), feeds

    def add(self, name: str, op: Operation, feeds: list[fx.Node], fx_node: fx.Node):
        node = self.graph.add_node(self.graph.unique_name(name), op)
        for port, src in enumerate(feeds):
            self.graph.connect(self.env[src], node, port)
        if fx_node.meta.get("source"):
            node.meta["source"] = fx_node.meta["source"]
        self.env[fx_node] = node
        return node

    def convert(self, fx_graph: fx.Graph) -> Graph:
        for n in fx_graph.nodes:
            getattr(self, "on_" + n.op)(n)
        return self.graph

    def _scoped(self, n: fx.Node) -> str:
        scope = n.meta.get("scope", "")
        return f"{scope}.{n.name}" if scope else n.name

    def on_placeholder(self, n):
        spec = {"default": encode(n.args[0])} if n.args else None
        name = str(n.target).lstrip("*")
        base = name.rpartition("_")[0]
        value = self.concrete_args.get(base, fx.PH)
        if name == f"{base}_1" and (value is None or type(value) in (bool, int, float, str)):
            # fx renames a concrete argument ``flag`` to ``flag_1`` (asserting its value) and
            # keeps the old default; restore the name and default to the traced value.
            name, spec = base, {"default": encode(value)}
        self.add(name, Operation("input", target=name, spec=spec), [], n)

    def on_get_attr(self, n):
        target = str(n.target)
        value = self.constants[target] if target in self.constants else _get_attr(self.root, target)
        if isinstance(value, torch.Tensor) and target in self.tensor_names:
            is_param = isinstance(value, nn.Parameter)
            owner, _, leaf = target.rpartition(".")
            owner_mod = self.root.get_submodule(owner) if owner else self.root
            spec = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
                    "buffer": not is_param,
                    "requires_grad": bool(value.requires_grad) if is_param else False,
                    "persistent": is_param or leaf not in owner_mod._non_persistent_buffers_set}
            try:
                spec["init"] = encode(value.detach())
            except EncodeError:
                pass  # large: re-created with a default init; weights come from the state dict
            self.add(target, Operation("param", spec=spec, attr=target), [], n)
        elif isinstance(value, torch.Tensor):
            try:
                spec = {"value": encode(value.detach())}
            except EncodeError as e:
                raise TraceError(f"the forward creates a tensor constant {target} that is too "
                                 f"large to store in the IR ({e}); register it as a buffer "
                                 f"(self.register_buffer) instead") from None
            self.add(self._scoped(n), Operation("constant", spec=spec), [], n)
        else:
            raise TraceError(f"attribute {target!r} of type {type(value).__name__} is read in "
                             f"forward but is neither a parameter nor a buffer")

    def on_call_module(self, n):
        target = str(n.target)
        module = self.root.get_submodule(target)
        handler = LEAF_HANDLERS.get(type(module))
        if handler is not None:
            handler(self, n, module)
            return
        try:
            spec = module_spec(module)
        except SpecError as e:
            raise TraceError(f"module {target!r}: {e}") from None
        if is_frozen(module):
            spec["frozen"] = True
        args, feeds = self.template([list(n.args), dict(n.kwargs)])
        calls = self.module_calls.get(target, 0)
        self.module_calls[target] = calls + 1
        name = target if calls == 0 else f"{target}@{calls}"
        self.add(name, Operation("module", args=args[0], kwargs=plain_kwargs(args[1]),
                                 spec=spec, attr=target), feeds, n)

    def on_call_function(self, n):
        try:
            ref = ref_of(n.target)
        except EncodeError as e:
            raise TraceError(f"function call {n.name} in forward: {e}") from None
        args, feeds = self.template([list(n.args), dict(n.kwargs)])
        self.add(self._scoped(n), Operation("function", target=ref, args=args[0],
                                            kwargs=plain_kwargs(args[1])), feeds, n)

    def on_call_method(self, n):
        args, feeds = self.template([list(n.args), dict(n.kwargs)])
        self.add(self._scoped(n), Operation("method", target=str(n.target), args=args[0],
                                            kwargs=plain_kwargs(args[1])), feeds, n)

    def on_output(self, n):
        args, feeds = self.template(n.args[0])
        self.add("output", Operation("output", args=[args]), feeds, n)


def plain_kwargs(encoded: dict) -> dict:
    """{"__dict__": [[k, v], ...]} -> {k: v} (keyword names are always strings)."""
    return {k: v for k, v in encoded["__dict__"]}


def _get_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def trace_with_choices(module: nn.Module, concrete_args: dict[str, Any] | None = None,
                       leaf_modules: Iterable = ()) -> tuple[Graph, list]:
    """:func:`trace`, also returning the mutators compiled from inline choices."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"trace() takes an nn.Module, not {type(module).__name__}")
    tensor_names = {k for k, _ in module.named_parameters(remove_duplicate=False)}
    tensor_names |= {k for k, _ in module.named_buffers(remove_duplicate=False)}
    before = set(vars(module))
    tracer = _Tracer(leaf_modules)
    try:
        fx_graph = tracer.trace(module, concrete_args=concrete_args)
    except TraceError:
        raise
    except Exception as e:  # noqa: BLE001 - every trace failure becomes a TraceError
        raise _trace_error(module, tracer, e) from e
    finally:
        # fx parks tensor constants (``_tensor_constant0``) on the root; keep them, undo that.
        parked = {name: vars(module)[name] for name in set(vars(module)) - before}
        for name in parked:
            delattr(module, name)
    converter = _Converter(module, tensor_names, parked, concrete_args)
    graph = converter.convert(fx_graph)
    graph.meta = {"class": type(module).__name__,
                  "forward": [n.op.target for n in graph.input_nodes],
                  # registration order, which codegen follows so state-dict keys keep theirs
                  "modules": [name for name, _ in module.named_modules()]}
    return graph, converter.inline


def trace(module: nn.Module, concrete_args: dict[str, Any] | None = None,
          leaf_modules: Iterable = ()) -> Graph:
    """Trace ``module`` with torch.fx into a :class:`~retiarii.graph.Graph`.

    Example::

        >>> g = retiarii.trace(model, leaf_modules=[MyOpaqueBlock])
        >>> g.lint(); g.to_module()

    Args:
        module: the model. Its own attributes are not changed.
        concrete_args: forward arguments fixed to a value for the trace (fx semantics), e.g.
            ``{"return_features": False}`` to remove a branch on a flag.
        leaf_modules: classes, instances or qualified names of submodules to keep as one
            opaque node instead of tracing through them. Their constructor arguments must be
            recoverable: decorate the class with :func:`retiarii.leaf`, or it must be a
            ``torch.nn`` layer.

    Inline choices (LayerChoice, ...) trace to their first candidate; use
    :class:`retiarii.ModelSpace` to explore them.

    Raises:
        TraceError: fx cannot trace the model, or a module/tensor cannot be stored in the IR.
    """
    return trace_with_choices(module, concrete_args, leaf_modules)[0]

