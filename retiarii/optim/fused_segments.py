"""Fusion across architectures that differ at a few places by layers with weights: the
places found on the traced models (:func:`find_segments`), and the operator running each
model's own layers there on its slice of the fused batch (:class:`PerModelSegment`).

Models of a space that chose another operator at one place (a 3x3 convolution, a 5x5 one, a
depthwise-separable block) trace to graphs that agree everywhere else: the same nodes by name,
with the same layers, reading the same values. Those common nodes fuse as usual; each place
where they differ is a *segment*, a connected set of nodes per model with one output, read by
the same common nodes in every model::

    model a:  x ─▶ stem ─▶ relu ─▶ [mid: Conv2d 3x3]              ─▶ relu_1 ─▶ fc
    model b:  x ─▶ stem ─▶ relu ─▶ [mid_dw_dw ─▶ mid_dw_pw]       ─▶ relu_1 ─▶ fc
    fused:    x ─▶ FusedConv ─▶ relu ─▶ PerModelSegment(a's, b's) ─▶ relu ─▶ FusedLinear

:class:`PerModelSegment` runs the models' own segments, grouped by identical sub-architecture:
a group of two or more runs fused among itself (a nested fused model over its slices), a
model alone runs its own layers on its slice, reading its parameters through a stacked
``(1, ...)`` tensor so that the fused optimizer steps it with its own settings. Each model's
parameters and buffers stay its own objects (views of the stacked storage), so its
``state_dict()`` is its layout alone, as everywhere in fusion.

Example::

    segments = find_segments(traced)          # traced: K fx.GraphModules, one per model
    segments.regions                          # [Segment(output=..., inputs=(...), nodes=...)]
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from .fused_ops import FusionError, stack_tensors

__all__ = ["PerModelSegment", "Segment", "find_segments", "region_module", "segment_module",
           "segments_fit"]

_FALLBACK = "train these models separately (unfused)"


@dataclass(frozen=True)
class Segment:
    """One place where the models differ: per model, its nodes (by name, in graph order) and
    the one among them the common nodes read (``outputs[k]``); ``inputs``: the common nodes it
    reads, by name, in model 0's order (the same in every model)."""

    nodes: tuple[tuple[str, ...], ...]
    outputs: tuple[str, ...]
    inputs: tuple[str, ...]


def _local(gm: fx.GraphModule, node: fx.Node, pointwise: Callable[[nn.Module], bool]) -> Any:
    """What a node is, apart from where its inputs come from: its opcode, target and constant
    arguments, and for a layer its type and configuration (an activation: "pointwise", as
    weightless activations may differ between fused models)."""
    def shape(a: Any) -> Any:
        return fx.node.map_arg(a, lambda _: "#node")

    what: Any = None
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        what = "pointwise" if pointwise(m) else (type(m).__name__, m.extra_repr(), tuple(
            (n, tuple(t.shape), t.dtype, t.requires_grad)
            for n, t in m.state_dict(keep_vars=True).items()))
    return node.op, str(node.target), repr(shape(node.args)), repr(shape(node.kwargs)), what


def find_segments(traced: Sequence[fx.GraphModule],
                  pointwise: Callable[[nn.Module], bool]) -> list[Segment]:
    """The places where ``traced`` (one graph per model) differ (see the module docstring);
    [] when they agree everywhere.

    Raises:
        FusionError: the graphs differ in a way segments cannot hold: a place read by other
            nodes in different models, one with several outputs or other inputs, a model with
            nothing where the others have a layer.
    """
    names = [{n.name: n for n in gm.graph.nodes} for gm in traced]
    first = traced[0]
    common = set(names[0])
    for k, gm in enumerate(traced[1:], 1):
        common &= {n for n in names[k] if n in names[0] and _local(gm, names[k][n], pointwise)
                   == _local(first, names[0][n], pointwise)}

    def fail(why: str) -> FusionError:
        return FusionError(f"the models differ at a place fusion cannot hold ({why}); "
                           f"{_FALLBACK}")

    # a common node reads, at each argument, the same common node in every model, or in
    # every model the output of that model's segment
    for name in common:
        reads = []
        for k in range(len(traced)):
            found: list[str | None] = []
            node = names[k][name]
            fx.node.map_arg((node.args, node.kwargs),
                            lambda a: found.append(a.name if a.name in common else None))
            reads.append(found)
        if any(r != reads[0] for r in reads[1:]):
            raise fail(f"node {name!r} reads other values in different models")
    per_model = []  # per model: output name -> (nodes, inputs), the components of its rest
    for k, gm in enumerate(traced):
        rest = [n for n in gm.graph.nodes if n.name not in common]
        if any(n.op in ("placeholder", "output") for n in rest):
            raise fail("another signature")
        parent = {n.name: n.name for n in rest}

        def root(x: str) -> str:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x
        for n in rest:
            for a in n.all_input_nodes:
                if a.name in parent:
                    parent[root(a.name)] = root(n.name)
        parts: dict[str, list[fx.Node]] = {}
        for n in rest:
            parts.setdefault(root(n.name), []).append(n)
        found: dict[str, tuple] = {}
        for nodes in parts.values():
            inside = {n.name for n in nodes}
            outs = [n for n in nodes if any(u.name not in inside for u in n.users)]
            if len(outs) != 1:
                raise fail(f"a place with {len(outs)} outputs")
            ins = tuple(dict.fromkeys(a.name for n in nodes for a in n.all_input_nodes
                                      if a.name not in inside))
            users = tuple(sorted(u.name for u in outs[0].users))
            found[users] = (tuple(n.name for n in nodes), outs[0].name, ins)
        per_model.append(found)
    places = list(per_model[0])
    if any(set(p) != set(places) for p in per_model[1:]):
        raise fail("the places where the models differ are read by other nodes")
    order = {n.name: i for i, n in enumerate(first.graph.nodes)}
    segments = []
    for users in places:
        ins = per_model[0][users][2]
        if any(set(p[users][2]) != set(ins) for p in per_model[1:]):
            raise fail(f"the place read by {list(users)} reads other inputs in different models")
        segments.append(Segment(tuple(p[users][0] for p in per_model),
                                tuple(p[users][1] for p in per_model),
                                tuple(sorted(ins, key=order.__getitem__))))
    return segments


def region_module(gm: fx.GraphModule, seg: Segment, k: int) -> fx.GraphModule:
    """Model k's nodes of ``seg`` as a module of its own: ``(*inputs) -> output``, holding
    the model's own layers (the same objects: their weights stay the model's)."""
    graph, env = fx.Graph(), {}
    nodes = {n.name: n for n in gm.graph.nodes}
    for name in seg.inputs:
        env[nodes[name]] = graph.placeholder(name)
    for name in seg.nodes[k]:
        env[nodes[name]] = graph.node_copy(nodes[name], lambda a: env[a])
    graph.output(env[nodes[seg.outputs[k]]])
    return fx.GraphModule(gm, graph, "Segment")


class PerModelSegment(nn.Module):
    """Each model's own layers at one place where the fused models differ (see the module
    docstring). Inputs and output K ``(K, B, ...)``; every model's output must have one shape.

    Args:
        groups: per group of models with one sub-architecture: its members (model indices,
            ascending) and what runs them: a fused model over their segments (called with
            the members' slices stacked, and ``rng=``) or, for one model, its segment module.
        params: per lone model, its segment's parameters by name -> the stacked ``(1, ...)``
            parameter its forward reads (so that gradients reach the fused optimizer's).
    """

    def __init__(self, groups: Sequence[tuple[list[int], nn.Module]],
                 params: dict[int, dict[str, nn.Parameter]], k: int):
        super().__init__()
        self.k, self.members = k, [list(m) for m, _ in groups]
        # the fused groups' and lone models' modules are not submodules: their tensors are
        # the models' own (as FusedModel keeps them); train() reaches them below
        self.__dict__["runners"] = [r for _, r in groups]
        self.stacked = nn.ParameterList(p for k_ in sorted(params) for p in params[k_].values())
        self._params = params
        order = [i for m in self.members for i in m]
        self.inverse = [order.index(i) for i in range(k)]
        self.streams: Sequence[Callable[[], ContextManager]] | None = None
        self._index: dict[torch.device, tuple[list[torch.Tensor], torch.Tensor]] = {}

    def train(self, mode: bool = True) -> PerModelSegment:
        super().train(mode)
        for r in self.runners:
            r.train(mode)
        return self

    def _indices(self, device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor]:
        if device not in self._index:
            self._index[device] = ([torch.tensor(m, device=device) for m in self.members],
                                   torch.tensor(self.inverse, device=device))
        return self._index[device]

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        index, inverse = self._indices(xs[0].device)
        streams = self.streams
        parts = []
        for members, runner, idx in zip(self.members, self.runners, index):
            if len(members) > 1:  # (K, B, ...) -> (g, B, ...): one fused call for the group
                rng = None if streams is None else [streams[i] for i in members]
                parts.append(runner(*(x.index_select(0, idx) for x in xs), rng=rng))
                continue
            i = members[0]
            ctx = streams[i]() if streams is not None and streams[i] is not None else \
                contextlib.nullcontext()
            with ctx:  # model i alone on its slice, its weights read through the stacked ones
                weights = {n: p[0] for n, p in self._params[i].items()}
                out = torch.func.functional_call(runner, weights, tuple(x[i] for x in xs))
            parts.append(out.unsqueeze(0))
        shapes = {tuple(p.shape[1:]) for p in parts}
        if len(shapes) > 1:
            raise FusionError(f"the models' layers at one place give outputs of shapes "
                              f"{sorted(shapes)}; only places with one output shape fuse: "
                              f"{_FALLBACK}")
        return torch.cat(parts).index_select(0, inverse)  # back in model order


def segment_module(regions: Sequence[fx.GraphModule], signature: Callable[[nn.Module], Any],
                   fuse: Callable[[list], Any]) -> tuple[PerModelSegment, list]:
    """The :class:`PerModelSegment` of one place from each model's ``regions``
    (:func:`region_module`), and its parameters for the fused optimizer: (stacked parameter,
    the models' parameters it holds, their model indices). Regions of equal ``signature``
    fuse among themselves (``fuse``: a fused model over stacked inputs); a lone one reads
    its parameters through a stacked ``(1, ...)`` one."""
    kinds: dict[Any, list[int]] = {}
    for k, r in enumerate(regions):
        kinds.setdefault(signature(r), []).append(k)
    groups, params, partial = [], {}, []
    for members in kinds.values():
        if len(members) > 1:  # one sub-architecture: fused among themselves
            inner = fuse([regions[k] for k in members])
            partial += [(p, ts, list(members)) for p, ts in inner.slices]
            partial += [(p, ts, [members[i] for i in m]) for p, ts, m in inner.partial_slices]
            groups.append((members, inner))
            continue
        k = members[0]
        own = dict(regions[k].named_parameters())
        params[k] = {n: nn.Parameter(stack_tensors([p]), p.requires_grad)
                     for n, p in own.items()}  # (1, *shape): its slice of the fused step
        partial += [(params[k][n], [p], [k]) for n, p in own.items()]
        groups.append((members, regions[k]))
    return PerModelSegment(groups, params, len(regions)), partial


def _meta_shapes(gm: fx.GraphModule, inputs: Sequence[Any]) -> dict[str, tuple]:
    """Node name -> the shapes of the values it reads, from one run of ``gm`` on **meta**
    copies of its weights and ``inputs`` (nothing computed, no state moved)."""
    memo: dict[int, Any] = {}
    for t in list(gm.parameters()) + list(gm.buffers()):
        memo[id(t)] = (nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad)
                       if isinstance(t, nn.Parameter) else torch.empty_like(t, device="meta"))
    shadow = copy.deepcopy(gm, memo)
    seen: dict[str, Any] = {}
    out: dict[str, tuple] = {}

    class _Rec(fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            seen[n.name] = tuple(result.shape) if isinstance(result, torch.Tensor) else None
            out[n.name] = tuple(seen.get(a.name) for a in n.all_input_nodes)
            return result
    meta = [torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x
            for x in inputs]
    with torch.no_grad():
        _Rec(shadow).run(*meta)
    return out


def segments_fit(traced: Sequence[fx.GraphModule], inputs: Sequence[Any] | None,
                 pointwise: Callable[[nn.Module], bool]) -> bool:
    """Whether models that differ at places (``traced``, one graph each) fit one fused model
    on inputs shaped like ``inputs``: :func:`find_segments` finds their places, and every
    node they hold in common reads values of one shape in every model (so each place gives
    one shape, as :class:`PerModelSegment` needs). Models that agree everywhere fit; models
    that differ at places do not without ``inputs`` (nothing to check the shapes on)."""
    try:
        segments = find_segments(traced, pointwise)
    except FusionError:
        return False
    if not segments:
        return True
    if inputs is None:
        return False
    inside = [{n for s in segments for n in s.nodes[k]} for k in range(len(traced))]
    shapes = [_meta_shapes(gm, inputs) for gm in traced]
    common = set(shapes[0]) - inside[0]
    return all(s[n] == shapes[0][n] for s in shapes[1:] for n in common)
