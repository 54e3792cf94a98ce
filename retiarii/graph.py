"""The Graph IR: the single source of truth for a model.

A :class:`Graph` holds :class:`Node` s connected by edges into numbered input ports. Each node
computes one value (its single output) with an :class:`Operation` (graph_operation.py, whose
names this module re-exports: the node kinds, and call templates in which ``{"__in__": k}``
stands for the value arriving on input port ``k``). The edges live in a networkx
``MultiDiGraph`` (key = destination port), so there is exactly one place that says what feeds
what. Structural hashes are graph_hash.py's.

Node names follow the module hierarchy (``layer1.0.conv1``); a module node's ``attr`` is the
attribute path its module lives at (several call nodes may share one module). Every node has a
``uid`` that never changes once assigned: copies keep it, and edits of other nodes do not touch
it, which is what lets the engine tell which nodes two models of one base share.

Example::

    >>> g = retiarii.trace(nn.Sequential(nn.Linear(4, 8), nn.ReLU()))
    >>> [n.name for n in g.nodes]
    ['input', '0', '1', 'output']
    >>> g.lint(); m = g.to_module()
"""
from __future__ import annotations

import heapq
import json
from typing import Any, Iterator, KeysView

import networkx as nx

from . import graph_hash
from .codec import DROP, map_tags
from .graph_checks import (KINDS, GraphError, check_constructible, check_op,  # noqa: F401
                           check_owned_tensor, check_schema, check_tensor_spec, is_int)
from .graph_operation import Operation, copy_data

SCHEMA_VERSION = 1


class Node:
    """One operation in a graph. Edges are read through the graph (``inputs``, ``users``)."""

    __slots__ = ("graph", "uid", "name", "op", "meta", "_seq")

    def __init__(self, graph: "Graph", uid: int, name: str, op: Operation, seq: int):
        self.graph = graph
        self.uid = uid
        self.name = name
        self.op = op
        self.meta: dict[str, Any] = {}  # JSON data: shape, scope, source line, ...
        self._seq = seq  # creation order; breaks ties in the topological order

    @property
    def kind(self) -> str:
        return self.op.kind

    @property
    def inputs(self) -> list["Node | None"]:
        """The node feeding each input port (None for a dangling port)."""
        ports: list[Node | None] = [None] * self.op.num_ports
        nodes = self.graph._nodes
        # NOTE: networkx's adjacency dicts (pred[dst][src][port]) are read directly here and in
        # ``users``/``_topological``: these run for every node on every edit, and the public
        # edge views cost several times more.
        for src, edges in self.graph._nx._pred[self.uid].items():
            for port in edges:
                if port < len(ports):
                    ports[port] = nodes[src]
        return ports

    @property
    def users(self) -> list["Node"]:
        return [self.graph._nodes[u] for u in self.graph._nx._succ[self.uid]]

    @property
    def attr(self) -> str:
        return self.op.attr or self.name

    @property
    def seq(self) -> int:
        """Creation order in its graph (later nodes are larger); breaks topological ties."""
        return self._seq

    def __repr__(self):
        return f"Node({self.name!r}, {self.op.describe()}, uid={self.uid})"


class Graph:
    """A dataflow graph of :class:`Node` s; see the module docstring."""

    def __init__(self):
        self._nx = nx.MultiDiGraph()
        self._nodes: dict[int, Node] = {}
        self._by_name: dict[str, int] = {}
        self._next_uid = 0
        self._next_seq = 0
        self._order: list[Node] | None = None
        self.meta: dict[str, Any] = {}  # JSON data: forward signature, origin, ...

    # ---- reading ------------------------------------------------------------------------
    @property
    def nodes(self) -> list[Node]:
        """All nodes in a topological order that keeps creation order where it is free."""
        if self._order is None:
            self._order = self._topological()
        return list(self._order)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Node:
        try:
            return self._nodes[self._by_name[name]]
        except KeyError:
            raise KeyError(f"no node named {name!r} in the graph") from None

    def node_by_uid(self, uid: int) -> Node:
        return self._nodes[uid]

    def uids(self) -> KeysView[int]:
        """The uids of the graph's nodes: a live read-only view (``uid in g.uids()``)."""
        return self._nodes.keys()

    def out_edges(self, node: Node) -> list[tuple[Node, int]]:
        """``(user, port)`` for every edge leaving ``node``, one per input port it feeds."""
        nodes = self._nodes
        return [(nodes[dst], port) for dst, ports in self._nx._succ[node.uid].items()
                for port in ports]

    def edges(self) -> list[tuple[Node, Node, int]]:
        """Every edge as ``(source, destination, port)``."""
        nodes = self._nodes
        return [(nodes[src], nodes[dst], port) for src, succ in self._nx._succ.items()
                for dst, ports in succ.items() for port in ports]

    def descendant_uids(self, node: Node) -> set[int]:
        """uids of every node that ``node``'s value flows into (``node`` itself excluded)."""
        return self._reach(node.uid, self._nx._succ)

    def ancestor_uids(self, node: Node) -> set[int]:
        """uids of every node whose value flows into ``node`` (``node`` itself excluded)."""
        return self._reach(node.uid, self._nx._pred)

    def reaches(self, src: Node, dst: Node) -> bool:
        """Whether ``src``'s value flows into ``dst`` (a node reaches itself): feeding ``src``
        from ``dst`` would close a cycle."""
        if src.uid == dst.uid:
            return True
        succ, seen, todo = self._nx._succ, {src.uid}, [src.uid]
        while todo:
            for nxt in succ[todo.pop()]:
                if nxt == dst.uid:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    @staticmethod
    def _reach(start: int, adjacency: dict) -> set[int]:
        # NOTE: the adjacency dict itself, as in ``inputs``: mutators ask this for every
        # target of every model they build.
        seen: set[int] = set()
        todo = [start]
        while todo:
            for nxt in adjacency[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    @property
    def input_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == "input"]

    def _topological(self) -> list[Node]:
        pred, succ, nodes = self._nx._pred, self._nx._succ, self._nodes
        indeg = {u: len(pred[u]) for u in nodes}  # distinct predecessors not yet emitted
        ready = [(n._seq, u) for u, n in nodes.items() if not indeg[u]]
        heapq.heapify(ready)
        order: list[Node] = []
        while ready:
            _, u = heapq.heappop(ready)
            order.append(nodes[u])
            for dst in succ[u]:
                indeg[dst] -= 1
                if not indeg[dst]:
                    heapq.heappush(ready, (nodes[dst]._seq, dst))
        if len(order) != len(self._nodes):
            cycle = nx.find_cycle(self._nx)
            names = " -> ".join(self._nodes[e[0]].name for e in cycle)
            raise GraphError(f"the graph has a cycle: {names}")
        return order

    # ---- editing (the primitives mutators build on) -----------------------------------------
    def add_node(self, name: str, op: Operation, uid: int | None = None) -> Node:
        if name in self._by_name:
            raise GraphError(f"a node named {name!r} already exists")
        if uid is None:
            uid = self._next_uid
        elif uid in self._nodes:
            raise GraphError(f"uid {uid} is already used by {self._nodes[uid].name!r}")
        self._next_uid = max(self._next_uid, uid + 1)
        node = Node(self, uid, name, op, self._next_seq)
        self._next_seq += 1
        self._nodes[uid] = node
        self._by_name[name] = uid
        self._nx.add_node(uid)
        self._order = None
        return node

    def unique_name(self, base: str) -> str:
        if base not in self._by_name:
            return base
        i = 1
        while f"{base}_{i}" in self._by_name:
            i += 1
        return f"{base}_{i}"

    def remove_node(self, node: Node) -> None:
        if node.users:
            raise GraphError(f"cannot remove {node.name!r}: still used by "
                             f"{[u.name for u in node.users]}")
        self._nx.remove_node(node.uid)
        del self._nodes[node.uid]
        del self._by_name[node.name]
        self._order = None

    def connect(self, src: Node, dst: Node, port: int) -> None:
        """Feed ``src``'s output into ``dst``'s input ``port`` (replacing what fed it)."""
        self.disconnect_port(dst, port)
        self._nx.add_edge(src.uid, dst.uid, key=port)
        self._order = None

    def disconnect_port(self, dst: Node, port: int) -> Node | None:
        for src, _, p in list(self._nx.in_edges(dst.uid, keys=True)):
            if p == port:
                self._nx.remove_edge(src, dst.uid, key=port)
                self._order = None
                return self._nodes[src]
        return None

    def append_port(self, node: Node, in_list: bool = False) -> int:
        """Add one input port at the end of ``node``'s call template and return its number;
        it dangles until :meth:`connect` feeds it. ``in_list``: append it to the list that is
        the first argument (the tensors of ``torch.cat``), creating that list if needed."""
        op = node.op
        port = op.num_ports
        if in_list:
            if not op.args or not isinstance(op.args[0], list):
                op.args = [[]] + list(op.args)
            op.args[0].append({"__in__": port})
        else:
            op.args.append({"__in__": port})
        return port  # (no edge changed: the topological order stands)

    def remove_port(self, node: Node, port: int) -> None:
        """Drop input ``port`` of a node taking any number of inputs (a sum, ``torch.cat``):
        its edge and its ``{"__in__": port}`` item in the call template go, and the ports
        after it are renumbered, edges included."""
        def renumber(k: int) -> Any:
            return DROP if k == port else {"__in__": k - (k > port)}

        edges = [(s, p) for s, _, p in self._nx.in_edges(node.uid, keys=True)]
        for s, p in edges:
            self._nx.remove_edge(s, node.uid, key=p)
        node.op.args = map_tags(node.op.args, "__in__", renumber)
        node.op.kwargs = map_tags(node.op.kwargs, "__in__", renumber)
        for s, p in edges:
            if p != port:
                self._nx.add_edge(s, node.uid, key=p - (p > port))
        self._order = None

    def ports_between(self, src: Node, dst: Node) -> list[int]:
        data = self._nx.get_edge_data(src.uid, dst.uid) or {}
        return sorted(data)

    def set_op(self, node: Node, op: Operation) -> None:
        """Give ``node`` a new operation; edges into ports the new op lacks are dropped."""
        node.op = op
        ports = op.num_ports
        for src, _, p in list(self._nx.in_edges(node.uid, keys=True)):
            if p >= ports:
                self._nx.remove_edge(src, node.uid, key=p)
                self._order = None  # only a removed edge can change the order

    def rename(self, node: Node, name: str) -> None:
        if name != node.name:
            if name in self._by_name:
                raise GraphError(f"a node named {name!r} already exists")
            del self._by_name[node.name]
            node.name = name
            self._by_name[name] = node.uid

    # ---- invariants ------------------------------------------------------------------------
    def lint(self, deep: bool = True) -> None:
        """Check every invariant; raise :class:`GraphError` listing all that are broken.

        Acyclic; exactly one output, with no users; every port an op references fed by exactly
        one edge and no edge into a port that does not exist; names and attribute paths
        consistent; every referenced class/function importable and (``deep``) every module
        spec constructible.
        """
        problems: list[str] = []
        try:
            self._order = self._topological()
        except GraphError as e:
            problems.append(str(e))
        outs = [n for n in self._nodes.values() if n.kind == "output"]
        if len(outs) != 1:
            problems.append(f"expected exactly one output node, found {len(outs)}")
        modules_at: dict[str, Node] = {}
        for node in self._nodes.values():
            where = f"node {node.name!r} ({node.op.describe()})"
            if self._by_name.get(node.name) != node.uid:
                problems.append(f"{where}: name index out of sync")
            ports = node.op.num_ports
            fed: dict[int, int] = {}
            for _, _, p in self._nx.in_edges(node.uid, keys=True):
                fed[p] = fed.get(p, 0) + 1
            for p in range(ports):
                if fed.get(p, 0) != 1:
                    problems.append(f"{where}: input port {p} has {fed.get(p, 0)} edges "
                                    f"(expected 1)")
            for p in fed:
                if p >= ports:
                    problems.append(f"{where}: an edge enters port {p}, which the operation "
                                    f"does not read")
            if node.kind == "output" and node.users:
                problems.append(f"{where}: the output node has users")
            if node.kind == "input" and ports:
                problems.append(f"{where}: an input node takes no inputs")
            problems += check_op(node, where, deep)
            if node.kind == "module":
                other = modules_at.setdefault(node.attr, node)
                if other is not node and (other.op.spec != node.op.spec):
                    problems.append(f"{where}: shares attribute {node.attr!r} with "
                                    f"{other.name!r} but their module specs differ")
        owners = set(modules_at) | {n.attr for n in self._nodes.values() if n.kind == "subgraph"}
        for path in owners:
            parts = path.split(".")
            for i in range(1, len(parts)):
                if ".".join(parts[:i]) in owners:
                    problems.append(f"module path {path!r} lies inside the module "
                                    f"{'.'.join(parts[:i])!r}")
        for node in self._nodes.values():  # a module's own tensor read directly (tied weights)
            parts = node.attr.split(".") if node.kind == "param" and deep else []
            owner = next((".".join(parts[:i]) for i in range(1, len(parts))
                          if ".".join(parts[:i]) in modules_at), None)
            if owner is not None:
                problems += check_owned_tensor(node, modules_at[owner], node.attr[len(owner) + 1:])
        if problems:
            raise GraphError("graph lint failed:\n  - " + "\n  - ".join(problems))

    # ---- copies, JSON ------------------------------------------------------------------------
    def copy(self) -> "Graph":
        """A deep copy; every node keeps its uid, and nothing is shared with ``self`` (mutators
        edit call templates in place)."""
        g = Graph()
        for node in sorted(self._nodes.values(), key=lambda n: n._seq):
            g.add_node(node.name, node.op.copy(), uid=node.uid).meta = copy_data(node.meta)
        for src, dst, port in sorted(self._nx.edges(keys=True)):  # as from_data adds them
            g._nx.add_edge(src, dst, key=port)
        g._next_uid = max(g._next_uid, self._next_uid)
        g.meta = copy_data(self.meta)
        return g

    def to_data(self) -> dict:
        nodes = []
        for node in sorted(self._nodes.values(), key=lambda n: n._seq):
            nodes.append({"uid": node.uid, "name": node.name, "op": node.op.to_data(),
                          **({"meta": node.meta} if node.meta else {})})
        edges = sorted([s, d, p] for s, d, p in self._nx.edges(keys=True))
        return {"format": "retiarii.graph", "version": SCHEMA_VERSION, "nodes": nodes,
                "edges": edges, "next_uid": self._next_uid,
                **({"meta": self.meta} if self.meta else {})}

    def to_json(self, indent: int | None = None) -> str:
        """Serialize to JSON (never pickle). ``Graph.from_json(g.to_json())`` equals ``g``."""
        return json.dumps(self.to_data(), indent=indent, allow_nan=False)

    @classmethod
    def from_data(cls, data: Any) -> "Graph":
        if not isinstance(data, dict) or data.get("format") != "retiarii.graph":
            raise GraphError("not a retiarii graph: expected an object with "
                             "\"format\": \"retiarii.graph\"")
        version = data.get("version")
        if not is_int(version) or version < 1:
            raise GraphError(f"graph JSON has an invalid schema version {version!r}; expected "
                             f"an integer from 1 to {SCHEMA_VERSION}")
        if version > SCHEMA_VERSION:
            raise GraphError(f"graph JSON has schema version {version!r}; this retiarii reads "
                             f"versions up to {SCHEMA_VERSION}. Upgrade retiarii to load it")
        check_schema(data)
        g = cls()
        try:
            for nd in data["nodes"]:
                sub = nd["op"].get("graph")  # a subgraph's Graph: read here, where Graph is
                op = Operation.from_data(nd["op"], Graph.from_data(sub) if sub is not None else None)
                node = g.add_node(nd["name"], op, uid=nd["uid"])
                node.meta = nd.get("meta", {})
            for src, dst, port in data["edges"]:
                if src not in g._nodes or dst not in g._nodes:
                    raise GraphError(f"edge {src}->{dst} names a node that does not exist")
                g._nx.add_edge(src, dst, key=port)
            g._next_uid = max(g._next_uid, data.get("next_uid", 0))
            g.meta = data.get("meta", {})
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, GraphError):
                raise
            raise GraphError(f"malformed graph JSON: {type(e).__name__}: {e}") from None
        return g

    @classmethod
    def from_json(cls, text: str) -> "Graph":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise GraphError(f"graph JSON does not parse: {e}") from None
        return cls.from_data(data)

    # ---- structural hash (graph_hash.py) -----------------------------------------------------
    def node_hashes(self, view=None, chain=lambda _node, ins: ins) -> dict[int, str]:
        """uid -> hash of (op, inputs' hashes), names/uids ignored; ``view``, ``chain``: rewrite them."""
        return graph_hash.node_hashes(self, view, chain)

    def structural_hash(self) -> str:
        """Hash of the whole structure: equal structures hash equal, whatever names and uids."""
        return graph_hash.structural_hash(self)

    # ---- emitting ----------------------------------------------------------------------------
    # NOTE: [The one upward import] codegen sits above graph (it imports Graph), so these two
    # methods import it when called: ``g.to_module()`` / ``g.to_source()`` are the IR's public
    # face (README, docs/ir.md) and stay. This is the only edge of the IR core that points up;
    # tests/test_layering.py allows exactly this one. Code inside retiarii calls
    # ``retiarii.codegen`` directly.
    def to_module(self, class_name: str = "GeneratedModel"):
        """A runnable ``nn.Module`` (fresh weights) whose state-dict keys follow the node names."""
        from .codegen import to_module

        return to_module(self, class_name)

    def to_source(self, class_name: str = "Model") -> str:
        """Standalone, readable Python source of one ``nn.Module`` class (imports torch only)."""
        from .codegen import to_source

        return to_source(self, class_name)

    def __repr__(self):
        return f"Graph({len(self._nodes)} nodes)"
