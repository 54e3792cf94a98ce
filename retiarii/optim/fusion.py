"""Fused training of same-shape models (horizontal fusion, HFTA's recipe).

K models with one architecture and their own weights (other hyper-parameters, other seeds)
train as one model: K linear layers become one batched matmul, K convolutions one grouped
convolution, K batch norms one norm over K*C channels with each model's own statistics;
element-wise operations run once on the fused tensors. :func:`fuse_models` traces the first
model with torch.fx, checks every other model has the same graph and layer shapes, and emits
a fused graph whose values travel in the layouts of :mod:`retiarii.optim.fused_ops`::

    one model:  x ─▶ fc1 ─▶ relu ─▶ fc2
    fused:      x (B, in) ─▶ FusedLinear ─▶ relu ─▶ FusedLinear ─▶ (K, B, out)
                             (one F.linear,          (baddbmm over the stacked
                              K weights side by side) (K, out, h) weights)

The fused layers adopt the models' tensors: each model's parameters and buffers become
views of slice k of the stacked ones, so ``models[k].state_dict()`` is, live, exactly what
training model k alone would hold, and :mod:`retiarii.optim.fused_optim` steps the stacked
parameters with each model's own optimizer settings. Which models may fuse is decided from
the IR (:func:`fusion_key`); :func:`fuse_models` checks it again on the modules.

Example::

    fused = fuse_models(models)                      # models[k] alias the fused weights
    opt = FusedOptimizer(fused, optimizers)          # optimizers[k]: model k's own
    out = fused(x, rng=streams)                      # (K, B, classes)
    sum(F.cross_entropy(out[k], y) for k in range(len(models))).backward()
    opt.step(); [s.step() for s in schedulers]       # schedulers of optimizers[k]
"""
from __future__ import annotations

import copy
import functools
import itertools
import inspect
import operator
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch
from torch import fx, nn
from torch.nn import functional as F

from . import fused_ops as ops
from .fused_ops import FusionError, shift_dim
from .fused_segments import PerModelSegment, Segment, find_segments, region_module, segment_module
from .fusion_check import (POINTWISE_MODULES, generated_signature, is_pointwise_layer, segments_fit,
                           signature, trace_model)
from .fusion_keys import fusable_groups, fusion_family, fusion_key

__all__ = ["FusedModel", "FusionError", "fusable_groups", "fuse_models", "fusion_family",
           "fusion_key", "segments_fit"]


_FALLBACK = "train these models separately (unfused)"


# ---- what each operation does to layouts -------------------------------------------------

S, K, C = "S", "K", "C"

_POINTWISE_MODULES = POINTWISE_MODULES
_CHANNEL_MODULES = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d,
                    nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
                    nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
                    nn.AdaptiveMaxPool3d)
_POINTWISE_FUNCTIONS = {
    torch.relu, F.relu, F.relu6, F.leaky_relu, F.gelu, F.silu, F.elu, F.hardswish,
    F.hardsigmoid, F.mish, F.softplus, torch.sigmoid, torch.tanh, F.sigmoid, F.tanh, torch.exp,
    torch.abs, torch.neg, torch.square, torch.sqrt, torch.clamp, torch.add, torch.sub,
    torch.mul, torch.div, torch.maximum, torch.minimum, torch.where, operator.add,
    operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow, operator.iadd,
    operator.imul, torch.relu_}
_POINTWISE_METHODS = {"relu", "relu_", "sigmoid", "tanh", "exp", "abs", "neg", "clamp", "add",
                      "sub", "mul", "div", "add_", "mul_", "sub_", "div_", "sqrt", "pow",
                      "square", "contiguous", "float", "clamp_", "__add__", "__mul__"}
_CHANNEL_FUNCTIONS = {F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d,
                      F.avg_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d,
                      F.adaptive_avg_pool3d, F.adaptive_max_pool2d}


def _key(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', None) or fn.__name__}"


def _ref(target: Any) -> str:
    """How an emitted node names ``target``: a method name, or "fn:" and its key."""
    return target if isinstance(target, str) else "fn:" + _key(target)


def _apply(fn: str, x: Any, *args: Any, **kwargs: Any) -> Any:
    if fn.startswith("fn:"):
        return _BY_KEY[fn[3:]](x, *args, **kwargs)
    return getattr(x, fn)(*args, **kwargs)


_DIM_KEYWORDS = {"dim", "dim0", "dim1", "start_dim", "end_dim"}


def k_dims(fn, x, *args, **kwargs):
    """``fn(x, dim, ...)`` with its dims shifted (softmax, transpose, unsqueeze...): every
    positional argument after ``x`` is a dim for the operations this is emitted for."""
    kwargs = {k: shift_dim(v) if k in _DIM_KEYWORDS else v for k, v in kwargs.items()}
    if fn == "permute":
        dims = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
        return x.permute(0, *shift_dim(tuple(dims)))
    return _apply(fn, x, *shift_dim(args), **kwargs)


def k_call(fn, stacked: tuple, *args, **kwargs):
    """``fn(*args)`` where ``stacked[i]``: ``args[i]`` is a K-layout tensor. K tensors get
    ones after K so that every model's ranks align as they do alone; a shared tensor then
    broadcasts against the trailing dims, as it does against each model's value."""
    ranks = [a.dim() - 1 if s else a.dim() for a, s in zip(args, stacked)
             if isinstance(a, torch.Tensor)]
    top = max(ranks, default=0)
    args = tuple(a.view(a.shape[0], *([1] * (top - a.dim() + 1)), *a.shape[1:])
                 if s and a.dim() - 1 < top else a for a, s in zip(args, stacked))
    return _apply(fn, *args, **kwargs)


_DIM_METHODS = {"softmax", "log_softmax", "transpose", "unsqueeze", "squeeze", "permute",
                "cumsum"}
_DIM_FUNCTIONS = {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.transpose,
                  torch.unsqueeze, torch.squeeze, torch.cumsum}
_REDUCE_METHODS = {"mean", "sum", "amax", "amin"}
_REDUCE_FUNCTIONS = {torch.mean: "mean", torch.sum: "sum", torch.amax: "amax", torch.amin: "amin"}

# NOTE: fx emits a graph as Python source, which cannot spell a function object as an
# argument; a fused node names the function it applies by a "fn:" key into this table.
_BY_KEY = {_key(f): f for f in _POINTWISE_FUNCTIONS | _DIM_FUNCTIONS}


# ---- the fused model --------------------------------------------------------------------------


class FusedModel(nn.Module):
    """K same-shape models as one module (see the module docstring).

    ``fused(*inputs, rng=streams)`` takes the batch every model reads and returns each
    model's output stacked, ``(K, B, ...)`` (``out[k]`` is model k's). ``rng``: K functions
    returning context managers that swap model k's RNG streams in (``TrialRun._own_rng``),
    so each dropout layer draws what it draws alone; None: one draw over the fused tensor.

    Attributes:
        models: the K models, in order; their tensors are views of the fused ones.
        graph_module: the fused fx.GraphModule.
        slices: fused parameter -> the K models' parameters it holds (for optimizers).
        partial_slices: (stacked parameter, the parameters it holds, whose models), for the
            layers of places where the models differ (:mod:`.fused_segments`): a parameter
            of some of the models only.
    """

    def __init__(self, graph_module: fx.GraphModule, models: Sequence[nn.Module],
                 slices: list[tuple[nn.Parameter, list[nn.Parameter]]],
                 partial_slices: list[tuple[nn.Parameter, list[nn.Parameter], list[int]]]
                 | None = None):
        super().__init__()
        self.graph_module = graph_module
        self.k = len(models)
        self.__dict__["models"] = list(models)  # not submodules: their tensors are ours
        self.__dict__["slices"] = slices
        self.__dict__["partial_slices"] = list(partial_slices or [])
        # the layers drawing in the models' streams (a nested fused model's are its own)
        self._dropouts = [m for m in graph_module.children()
                          if isinstance(m, (ops.FusedDropout, PerModelSegment))]

    def forward(self, *inputs: Any,
                rng: Sequence[Callable[[], ContextManager]] | None = None) -> Any:
        if rng is not None and len(rng) != self.k:
            raise ValueError(f"rng has {len(rng)} streams for {self.k} fused models")
        for d in self._dropouts:
            d.streams = rng
        try:
            return self.graph_module(*inputs)
        finally:
            for d in self._dropouts:
                d.streams = None

    def train(self, mode: bool = True) -> FusedModel:
        super().train(mode)
        for m in self.models:  # a model asked for its mode alone answers as fused
            m.train(mode)
        return self


def _get(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class _Emitter:
    """Builds the fused fx graph node by node, each value with its layout."""

    def __init__(self, traced: list[fx.GraphModule]):
        self.traced, self.k = traced, len(traced)
        self.graph, self.root = fx.Graph(), nn.Module()
        self.env: dict[fx.Node, tuple[fx.Node, str]] = {}
        self.slices: list[tuple[nn.Parameter, list[nn.Parameter]]] = []
        self.stacked: dict[int, torch.Tensor] = {}  # id(model 0's tensor) -> stacked (ties)
        self.adopted: set[int] = set()  # ids of the models' tensors fused layers hold
        self.partial: list[tuple[nn.Parameter, list[nn.Parameter], list[int]]] = []

    def fail(self, node: fx.Node, what: str) -> FusionError:
        return FusionError(f"cannot fuse node {node.name!r} ({what}): not supported by "
                           f"retiarii.optim.fusion; {_FALLBACK}")

    def to(self, value: tuple[fx.Node, str], layout: str) -> fx.Node:
        """The node holding ``value`` in ``layout`` (a conversion when needed)."""
        node, have = value
        if have == layout:
            return node
        conv = {(C, K): ops.c_to_k, (S, K): ops.s_to_k, (S, C): ops.s_to_c}.get((have, layout))
        if (have, layout) == (K, C):
            return self.graph.call_function(ops.k_to_c, (node,))
        if conv is None:
            raise FusionError(f"no conversion from layout {have} to {layout}")
        return self.graph.call_function(conv, (node, self.k))

    def arg(self, a: Any) -> Any:
        return fx.node.map_arg(a, lambda n: self.env[n][0])

    def fused_in(self, args: Any, kwargs: Any) -> list[fx.Node]:
        found: list[fx.Node] = []
        fx.node.map_arg((args, kwargs), lambda n: found.append(n) if self.env[n][1] != S else None)
        return found

    def add(self, name: str, module: nn.Module, layers: Sequence[nn.Module] = ()) -> str:
        """Register ``module`` (the fused form of ``layers``, whose tensors it adopted)."""
        name = name.replace(".", "_")
        while hasattr(self.root, name):  # a layer called twice: fused once per call
            name += "_"
        self.root.add_module(name, module)
        for pname, param in module.named_parameters(recurse=False):
            self.slices.append((param, [getattr(layer, pname) for layer in layers]))
        return name

    def adopt(self, node: fx.Node, layers: list[nn.Module]) -> None:
        """Refuse layers whose tensors were adopted already (a layer called twice, weights
        tied between layers): their models' tensors would be stacked twice."""
        for layer in layers:
            for t in itertools.chain(layer.parameters(recurse=False), layer.buffers(recurse=False)):
                if id(t) in self.adopted:
                    raise self.fail(node, "a layer called twice or weights tied between layers")
                self.adopted.add(id(t))

    def module(self, node: fx.Node) -> tuple[fx.Node, str]:
        layers = [_get(gm, node.target) for gm in self.traced]
        first, (x, layout) = layers[0], self.env[node.args[0]]
        if len(node.args) != 1 or node.kwargs:
            raise self.fail(node, f"{type(first).__name__} called with more than one input")
        call = self.graph.call_module
        if len({(type(m), m.extra_repr()) for m in layers}) > 1:  # activations that differ
            if not all(is_pointwise_layer(m) for m in layers):
                raise self.fail(node, "layers that differ between the models")
            return call(self.add(node.target, ops.PerModelPointwise(layers)),
                        (self.to((x, layout), K),)), K
        if any(True for _ in first.parameters()) or any(True for _ in first.buffers()):
            self.adopt(node, layers)
        if isinstance(first, nn.Linear):
            shared = layout == S
            fused = ops.FusedLinear(layers, shared)
            return call(self.add(node.target, fused, layers), (x if shared else self.to((x, layout), K),)), K
        if isinstance(first, nn.modules.conv._ConvNd) and not first.transposed:
            if first.padding_mode != "zeros":
                raise self.fail(node, f"convolution with padding_mode={first.padding_mode!r}")
            shared = layout == S and first.groups == 1
            fused = ops.FusedConv(layers, shared)
            return call(self.add(node.target, fused, layers), (x if shared else self.to((x, layout), C),)), C
        if isinstance(first, nn.modules.batchnorm._BatchNorm) and not isinstance(
                first, nn.SyncBatchNorm):
            if first.momentum is None and first.track_running_stats:
                raise self.fail(node, "BatchNorm with momentum=None (a cumulative average)")
            return call(self.add(node.target, ops.FusedBatchNorm(layers), layers),
                        (self.to((x, layout), C),)), C
        if isinstance(first, nn.LayerNorm):
            return call(self.add(node.target, ops.FusedLayerNorm(layers), layers),
                        (self.to((x, layout), K),)), K
        # Dropout layers are copied: model 0 set to eval mode alone (its validation) must not
        # switch the fused layer off.
        if isinstance(first, (nn.Dropout, nn.AlphaDropout)):  # element-wise: any layout
            fused = ops.FusedDropout(copy.deepcopy(first), self.k, layout)
            return call(self.add(node.target, fused), (x,)), K if layout == S else layout
        if isinstance(first, nn.modules.dropout._DropoutNd):  # whole channels: the C layout
            fused = ops.FusedDropout(copy.deepcopy(first), self.k, C)
            return call(self.add(node.target, fused), (self.to((x, layout), C),)), C
        if any(True for _ in first.parameters()) or any(True for _ in first.buffers()):
            raise self.fail(node, f"layer {type(first).__name__} with weights")
        name = self.add(node.target, copy.deepcopy(first))  # weightless: a copy, as dropout
        if isinstance(first, _POINTWISE_MODULES):
            return call(name, (x,)), layout
        if isinstance(first, _CHANNEL_MODULES):
            return call(name, (x if layout == S else self.to((x, layout), C),)), \
                S if layout == S else C
        if isinstance(first, nn.Flatten):
            if layout == S:
                return call(name, (x,)), S
            args = (self.to((x, layout), K), first.start_dim, first.end_dim)
            return self.graph.call_function(ops.k_flatten, args), K
        if isinstance(first, (nn.Softmax, nn.LogSoftmax)):
            if layout == S:
                return call(name, (x,)), S
            fn = "softmax" if isinstance(first, nn.Softmax) else "log_softmax"
            return self.graph.call_function(k_dims, (fn, self.to((x, layout), K), first.dim)), K
        raise self.fail(node, f"layer {type(first).__name__}")

    def function(self, node: fx.Node) -> tuple[fx.Node, str]:
        """A call_function or call_method node."""
        target, method = node.target, node.op == "call_method"
        fused = self.fused_in(node.args, node.kwargs)
        g = self.graph
        if not fused:  # every model computes the same value: compute it once
            op = g.call_method if method else g.call_function
            return op(target, self.arg(node.args), self.arg(node.kwargs)), S
        layouts = {self.env[n][1] for n in fused}
        if (target in _POINTWISE_METHODS if method else target in _POINTWISE_FUNCTIONS):
            shared = [n for n in _nodes(node.args, node.kwargs) if self.env[n][1] == S]
            if layouts == {C} and not shared:  # channel-concatenated values and scalars
                op = g.call_method if method else g.call_function
                return op(target, self.arg(node.args), self.arg(node.kwargs)), C
            stacked = tuple(isinstance(a, fx.Node) and self.env[a][1] != S for a in node.args)
            if sum(stacked) != len(fused):
                raise self.fail(node, f"{_name(target)} with a fused tensor as a keyword or "
                                      f"inside a container")
            args = tuple(self.to(self.env[a], K) if s else self.arg(a)
                         for a, s in zip(node.args, stacked))
            return g.call_function(k_call, (_ref(target), stacked, *args),
                                   self.arg(node.kwargs)), K
        if target in (_CHANNEL_FUNCTIONS if not method else ()):
            x, layout = self.env[node.args[0]]
            return g.call_function(target, (self.to((x, layout), C), *self.arg(node.args[1:])),
                                   self.arg(node.kwargs)), C
        if target is torch.cat:
            parts = [self.to(self.env[n], K) for n in node.args[0]]
            return g.call_function(ops.k_cat, (parts, *self.arg(node.args[1:])),
                                   self.arg(node.kwargs)), K
        if len(fused) != 1 or not node.args or node.args[0] is not fused[0]:
            raise self.fail(node, f"{_name(target)} over several fused tensors")
        x = self.to(self.env[node.args[0]], K)
        rest, kwargs = self.arg(node.args[1:]), self.arg(node.kwargs)
        if target is torch.flatten or target == "flatten" and method:
            return g.call_function(ops.k_flatten, (x, *rest), kwargs), K
        if method and target in ("view", "reshape") or target is torch.reshape:
            return g.call_function(ops.k_reshape, (x, *rest), kwargs), K
        if method and target == "size":
            return g.call_function(ops.k_size, (x, *rest), kwargs), S
        if method and target == "dim":
            return g.call_function(ops.k_dim, (x,)), S
        if target is getattr and rest == ("shape",):
            return g.call_function(ops.k_shape, (x,)), S
        if target is operator.getitem:
            return g.call_function(ops.k_getitem, (x, *rest)), K
        if method and target in _REDUCE_METHODS or target in _REDUCE_FUNCTIONS:
            name = target if method else _REDUCE_FUNCTIONS[target]
            return g.call_function(ops.k_reduce, (name, x, *rest), kwargs), K
        if method and target in _DIM_METHODS or not method and target in _DIM_FUNCTIONS:
            return g.call_function(k_dims, (_ref(target), x, *rest), kwargs), K
        raise self.fail(node, _name(target))

    def segment(self, seg: Segment) -> tuple[fx.Node, str]:
        """A place where the models differ (:mod:`.fused_segments`): each model's own layers
        there, models of one sub-architecture fused among themselves."""
        regions = [region_module(gm, seg, k) for k, gm in enumerate(self.traced)]
        for r in regions:  # weights tied to a common layer would be stacked twice
            for t in itertools.chain(r.parameters(), r.buffers()):
                if id(t) in self.adopted:
                    raise FusionError(f"a layer at the place of {seg.outputs[0]!r} shares "
                                      f"weights with another; {_FALLBACK}")
                self.adopted.add(id(t))
        module, partial = segment_module(regions, lambda r: signature(r, r), functools.partial(
            fuse_models, stacked_inputs=True))
        self.partial += partial
        name = self.add("segment_" + seg.outputs[0], module)
        first = {n.name: n for n in self.traced[0].graph.nodes}
        if any(first[n] not in self.env for n in seg.inputs):
            raise FusionError(f"the place of {seg.outputs[0]!r} reads a value computed after "
                              f"it; {_FALLBACK}")
        ins = tuple(self.to(self.env[first[n]], K) for n in seg.inputs)
        return self.graph.call_module(name, ins), K

    def stacked_attr(self, node: fx.Node) -> tuple[fx.Node, str]:
        tensors = [_get(gm, node.target) for gm in self.traced]
        if not isinstance(tensors[0], torch.Tensor):
            raise self.fail(node, f"attribute of type {type(tensors[0]).__name__}")
        name = "attr_" + node.target.replace(".", "_")
        if id(tensors[0]) not in self.stacked:
            if isinstance(tensors[0], nn.Parameter):
                value = nn.Parameter(ops.stack_tensors(tensors), tensors[0].requires_grad)
                self.root.register_parameter(name, value)
                self.slices.append((value, tensors))
            else:
                value = ops.stack_tensors(tensors)
                self.root.register_buffer(name, value)
            self.stacked[id(tensors[0])] = value
        return self.graph.get_attr(name), K


def _nodes(args: Any, kwargs: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((args, kwargs), found.append)
    return found


def _name(target: Any) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", repr(target))


def fuse_models(models: Sequence[nn.Module], stacked_inputs: bool = False) -> FusedModel:
    """One :class:`FusedModel` training ``models`` (same architecture, own weights) at once.

    The models' parameters and buffers become views of the fused ones (their values are kept:
    a model loaded from a checkpoint fuses with its loaded values), so build the models, load
    their checkpoints, make each model's optimizer, and then fuse. Do not move the models to
    another device afterwards (``.to()`` would break the views): fuse on the device they
    train on.

    Args:
        models: two or more ``nn.Module`` s with the same traced graph, layer types,
            configurations and tensor shapes (``fusion_key`` equal for models of a space),
            or graphs that differ in their activations (``fusion_family``) or at places
            where each runs its own layers (:mod:`.fused_segments`: another operator at one
            place, every value the common layers read of one shape).
        stacked_inputs: the inputs are per-model values stacked ``(K, B, ...)`` (a fused
            model nested in another's segment), not one batch every model reads.

    Raises:
        FusionError: the models differ, one cannot be traced, or an operation has no fused
            form (the message names the node and says to train the models separately).
    """
    models = list(models)
    if len(models) < 2:
        raise FusionError(f"fusing needs two or more models, got {len(models)}")
    traced = [trace_model(models[0], 0)]
    first = signature(traced[0], models[0])
    family = signature(traced[0], models[0], family=True)
    known = generated_signature(models[0])
    differ = []
    for i, m in enumerate(models[1:], 1):
        if known is not None and generated_signature(m) == known:
            traced.append(m)  # traces as model 0 does: its own tensors are read by path
            continue
        gm = trace_model(m, i)
        if signature(gm, m) != first and signature(gm, m, family=True) != family:
            differ.append(i)
        traced.append(gm)
    segments: list[Segment] = []
    if differ:  # other layers at some places: each model's own there, if the graphs allow
        try:
            segments = find_segments(traced, is_pointwise_layer)
        except FusionError as err:
            raise FusionError(f"model {differ[0]} differs from model 0 (its graph, a layer's "
                              f"type or configuration other than an activation's, a tensor's "
                              f"shape, dtype or device, or a train/eval mode) where fusion "
                              f"cannot run each model's own layers ({err}); {_FALLBACK}") from err
        if not segments or any(m.training != models[0].training for m in models):
            raise FusionError(f"model {differ[0]} differs from model 0 (a tensor's shape, "
                              f"dtype or device, or a train/eval mode); {_FALLBACK}")
        inside = {n for seg in segments for n in seg.nodes[0]}
        if not any(n.op == "call_module" and n.name not in inside and any(
                True for _ in traced[0].get_submodule(n.target).parameters())
                for n in traced[0].graph.nodes):
            raise FusionError(f"model {differ[0]} differs from model 0 in every layer with "
                              f"weights: nothing would fuse; {_FALLBACK}")
    at = {seg.outputs[0]: seg for seg in segments}  # emitted at model 0's output node
    inside = {n for seg in segments for n in seg.nodes[0]}
    em = _Emitter(traced)
    for node in traced[0].graph.nodes:
        if node.name in inside:
            if node.name in at:
                em.env[node] = em.segment(at[node.name])
            continue
        if node.op == "placeholder":
            em.env[node] = em.graph.placeholder(node.name, default_value=(
                node.args[0] if node.args else inspect.Signature.empty)), K if stacked_inputs else S
        elif node.op == "get_attr":
            em.env[node] = em.stacked_attr(node)
        elif node.op == "call_module":
            em.env[node] = em.module(node)
        elif node.op in ("call_function", "call_method"):
            em.env[node] = em.function(node)
        elif node.op == "output":
            em.graph.output(fx.node.map_arg(node.args[0], lambda n: em.to(em.env[n], K)))
    gm = fx.GraphModule(em.root, em.graph, "FusedModel")
    fused = FusedModel(gm, models, em.slices, em.partial)
    fused.train(models[0].training)
    return fused
