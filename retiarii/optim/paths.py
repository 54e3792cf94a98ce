"""Emitting a model's path on the super-graph cheaply: spliced candidates as cached cells.

A path is the model's graph emitted with the pool's operators installed (``to_module(graph,
provide=...)``). Emitting a whole graph through torch.fx costs about as much as building the
model (most of it is fx's code generation), and a one-shot search meets a new architecture at
nearly every step (SPOS: 4^20 of them). But most of a path repeats: the candidates a
LayerChoice splices in (one ``splice`` record of the history, plus the choices nested in it)
are few, and the rest of the graph (the *layout*: stem, head, where the candidates sit) is the
same for every model. So :class:`PathBuilder` emits

* each spliced **region** once as a cell (an ``fx.GraphModule`` of its nodes, fed by the
  region's inputs; module paths relative to the spliced node), cached by its content and the
  weight keys of its operators;
* each **layout** once: the graph with every region replaced by one call to its cell, cached
  by its code (module specs left out: which module sits at a path is the pool's business);

and a path is a new instance of the layout's class with the pool's operators and the cells
installed: no code generation at all once the candidates and the layout were seen. The
forward is the generated code of the layout plus one call per cell (its own generated code):
no interpretation per step. A region that does not have exactly one output, is fed by a node
computed after it begins, or whose module paths do not sit under the spliced node's, stays
inline in the layout.

Example::

    builder = PathBuilder()
    net = builder.build(model, provide)   # provide(node, attr) -> the pooled module, or None
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import fx, nn

from ..codegen import to_module
from ..codegen.fx_backend import install_value
from ..graph import Graph, Node, Operation
from ..interpreter import init_tensor
from ..modspec import build_module
from ..space import Model

__all__ = ["PathBuilder"]

Provide = Callable[[Node, str], Any]  # (node, full attribute path) -> module/tensor or None


def _regions(model: Model) -> list[tuple[str, list[Node]]]:
    """(prefix, member nodes in graph order) of every top-level splice of the history that
    makes a valid cell: one output, every module path under ``prefix``."""
    owner: dict[int, int] = {}
    found: list[tuple[str, set[int]]] = []
    for rec in model.history:
        if rec["primitive"] != "splice":
            continue
        index = owner.get(rec["node"])
        if index is None:
            index = len(found)
            found.append((rec["name"] + ".", set()))
        for uid in rec["nodes"]:
            owner[uid] = index
            found[index][1].add(uid)
    if not found:
        return []
    graph = model.graph
    members: dict[int, list[Node]] = {i: [] for i in range(len(found))}
    position: dict[int, int] = {}
    for node in graph.nodes:
        position[node.uid] = len(position)
        i = owner.get(node.uid)
        if i is not None:
            members[i].append(node)
    out = []
    for i, (prefix, _) in enumerate(found):
        nodes = members[i]
        if not nodes:
            continue
        uids = {n.uid for n in nodes}
        exits = [n for n in nodes if any(u.uid not in uids for u in n.users)]
        # every source before the region: one call cannot need what it feeds (no cycle)
        late = any(position[s.uid] > position[nodes[0].uid] for s in _sources(nodes))
        if len(exits) != 1 or late or any(n.kind in ("input", "output") for n in nodes) or any(
                not n.attr.startswith(prefix) for n in nodes
                if n.kind in ("module", "param", "subgraph")):
            continue
        out.append((prefix, nodes))
    return out


def _sources(nodes: list[Node]) -> list[Node]:
    """The nodes outside ``nodes`` that feed them, in order of first use."""
    uids = {n.uid for n in nodes}
    out: list[Node] = []
    for n in nodes:
        for src in n.inputs:
            if src.uid not in uids and src not in out:
                out.append(src)
    return out


def _exit(nodes: list[Node]) -> Node:
    uids = {n.uid for n in nodes}
    return next(n for n in nodes if any(u.uid not in uids for u in n.users))


def _cell_graph(prefix: str, nodes: list[Node]) -> Graph:
    """The region as a graph of its own: inputs for its sources, module paths relative."""
    g = Graph()
    mapping: dict[int, Node] = {}
    for i, src in enumerate(_sources(nodes)):
        mapping[src.uid] = g.add_node(f"in{i}", Operation("input", target=f"in{i}"))
    for n in nodes:
        op = n.op.copy()
        if op.kind in ("module", "param", "subgraph"):
            op.attr = n.attr[len(prefix):]
        mapping[n.uid] = g.add_node(n.name, op)
    for n in nodes:
        for port, src in enumerate(n.inputs):
            g.connect(mapping[src.uid], mapping[n.uid], port)
    out = g.add_node("output", Operation("output", args=[{"__in__": 0}]))
    g.connect(mapping[_exit(nodes).uid], out, 0)
    return g


def _hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _node_code(node: Node, ref: Callable[[Node], str], with_spec: bool) -> list:
    op = node.op
    spec = op.spec if with_spec or op.kind in ("constant", "input") else None
    return [node.name, op.kind, op.target, op.args, op.kwargs, spec,
            op.attr if op.kind in ("module", "param", "subgraph") else None,
            [ref(src) for src in node.inputs]]


class PathBuilder:
    """Builds paths from cached cells and layouts; see the module docstring.

    Args:
        device: where paths run (the pooled operators are there already; constants and
            fresh weightless parts are moved there).
        cache_size: how many cells and layouts to keep (least recently used go).
    """

    def __init__(self, device: torch.device, cache_size: int = 1024):
        self.device = device
        self.cache_size = cache_size
        self._cells: OrderedDict[str, nn.Module] = OrderedDict()
        self._layouts: OrderedDict[str, fx.GraphModule] = OrderedDict()

    def _remember(self, cache: OrderedDict, key: str, value: Any) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > self.cache_size:
            cache.popitem(last=False)

    def forget(self, tensors: set[int]) -> None:
        """Evict the cached cells and layouts that hold any of ``tensors`` (ids of parameters
        and buffers): operators leaving the pool must not live on in a cache."""
        for cache in (self._cells, self._layouts):
            for key in [k for k, m in cache.items() if holds_tensors(m, tensors)]:
                del cache[key]

    def build(self, model: Model, provide: Provide, keys: dict[str, str]) -> nn.Module:
        """The path of ``model``: ``provide(node, attr)`` gives the operator to install at a
        module, cell or parameter node (None: a fresh one); ``keys`` maps attribute paths to
        weight keys (part of a cell's identity)."""
        graph = model.graph
        regions = _regions(model)
        region_of = {n.uid: i for i, (_, nodes) in enumerate(regions) for n in nodes}
        cells = [self._cell(prefix, nodes, provide, keys) for prefix, nodes in regions]

        def ref(src: Node) -> str:
            i = region_of.get(src.uid)
            return src.name if i is None else f"cell:{regions[i][0]}"

        top = [n for n in graph.nodes if n.uid not in region_of]
        code = [_node_code(n, ref, with_spec=False) for n in top] + [
            [prefix, [ref(s) for s in _sources(nodes)]] for prefix, nodes in regions]
        layout_key = _hash(code)
        template = self._layouts.get(layout_key)
        if template is None:
            net = self._emit(graph, top, regions, cells, provide)
            self._remember(self._layouts, layout_key, net)
            return net
        self._layouts.move_to_end(layout_key)
        net = _instance(template)
        for (prefix, _), cell in zip(regions, cells):
            install_value(net, prefix[:-1], cell)
        owners = {n.attr for n in top if n.kind in ("module", "subgraph")}
        done: set[str] = set()
        for node in top:
            attr = node.attr
            if node.kind not in ("module", "param", "subgraph") or attr in done:
                continue
            done.add(attr)
            if node.kind == "param" and any(attr.startswith(o + ".") for o in owners):
                continue  # a tensor of a module installed whole
            given = provide(node, attr)
            spec = node.op.spec or {}
            if given is None:  # a weightless module, a constant-like tensor: built afresh
                given = _fresh(node).to(self.device)
            install_value(net, attr, given, buffer=node.kind == "param" and spec.get("buffer", False),
                     persistent=spec.get("persistent", True))
        return net

    def _cell(self, prefix: str, nodes: list[Node], provide: Provide,
              keys: dict[str, str]) -> nn.Module:
        inputs = {src.uid: f"in{i}" for i, src in enumerate(_sources(nodes))}
        content = [_node_code(n, lambda s: inputs.get(s.uid, s.name), with_spec=True)
                   for n in nodes] + [keys.get(n.attr) for n in nodes]
        key = _hash([prefix, content])
        cell = self._cells.get(key)
        if cell is None:
            with torch.random.fork_rng(devices=[]):
                cell = to_module(_cell_graph(prefix, nodes), "Cell",
                                 provide=lambda n: provide(n, prefix + n.attr)).to(self.device)
            self._remember(self._cells, key, cell)
        else:
            self._cells.move_to_end(key)
        return cell

    def _emit(self, graph: Graph, top: list[Node], regions: list, cells: list,
              provide: Provide) -> fx.GraphModule:
        # Nodes are added in the model's order, each cell call where its region began: the
        # topological order breaks ties by creation, so the layout keeps the model's order
        # (in-place operations see what they saw in the model).
        g = Graph()
        mapping: dict[int, Node] = {}
        first = {nodes[0].uid: i for i, (_, nodes) in enumerate(regions)}
        cell_of: dict[str, nn.Module] = {}
        calls = []
        top_uids = {n.uid for n in top}
        for n in graph.nodes:
            if n.uid in top_uids:
                mapping[n.uid] = g.add_node(n.name, n.op.copy())
            elif n.uid in first:
                (prefix, nodes), cell = regions[first[n.uid]], cells[first[n.uid]]
                sources = _sources(nodes)
                op = Operation("subgraph", args=[{"__in__": i} for i in range(len(sources))],
                               attr=prefix[:-1], graph=Graph())
                node = g.add_node(g.unique_name(prefix[:-1]), op)
                cell_of[prefix[:-1]] = cell
                calls.append((node, sources))
                for member in nodes:
                    mapping[member.uid] = node
        for node, sources in calls:
            for i, src in enumerate(sources):
                g.connect(mapping[src.uid], node, i)
        for n in top:
            for port, src in enumerate(n.inputs):
                g.connect(mapping[src.uid], mapping[n.uid], port)

        def give(node: Node):
            if node.kind == "subgraph" and node.attr in cell_of:
                return cell_of[node.attr]
            return provide(node, node.attr)

        with torch.random.fork_rng(devices=[]):
            return to_module(g, "Path", provide=give).to(self.device)


def holds_tensors(module: nn.Module, tensors: set[int]) -> bool:
    """Whether ``module`` holds a parameter or buffer whose id is in ``tensors``."""
    return any(id(t) in tensors for t in module.parameters()) or \
        any(id(t) in tensors for t in module.buffers())


def _fresh(node: Node) -> Any:
    if node.kind == "module":
        return build_module(node.op.spec)
    if node.kind == "subgraph":
        return to_module(node.op.graph, "Cell")
    spec = node.op.spec
    value = init_tensor(spec)
    return value if spec["buffer"] else nn.Parameter(value, requires_grad=spec.get(
        "requires_grad", True))


def _instance(template: fx.GraphModule) -> fx.GraphModule:
    """A new module of ``template``'s class (its generated forward), with the template's
    constants and no submodule yet."""
    net = object.__new__(type(template))
    nn.Module.__init__(net)
    for k, v in template.__dict__.items():
        net.__dict__.setdefault(k, v)  # the fx graph and code; not the module's own dicts
    for name, buf in template._buffers.items():  # constants (non-persistent buffers)
        net.register_buffer(name, buf, persistent=name not in
                            template._non_persistent_buffers_set)
    return net
