"""The mutators inline choices compile to (one per kind of choice), and graph splicing.

:mod:`.choice_tracing` builds them while tracing a model that holds inline choices
(:mod:`.choices`); each holds uids of the graph it was traced in and edits that graph when a
space is sampled, as any mutator does.
"""
from __future__ import annotations

from typing import Any

from .codec import decode, encode, evaluate_choice, find_tags, map_tags
from .graph import Graph, Node
from .mutator import MutationError, Mutator

# ---- compiled mutators ---------------------------------------------------------------------------


class InlineMutator(Mutator):
    """Base of the mutators compiled from inline choices. They hold uids of the graph they were
    traced in; ``remap`` translates them once that graph was spliced into another. Their
    labels are final (made absolute at trace time)."""

    def __init__(self, label: str):
        super().__init__(label)
        self.remap: dict[int, int] = {}

    def node(self, uid: int) -> Node:
        return self.graph.node_by_uid(self.remap.get(uid, uid))

    def reachable(self, uid: int) -> bool:
        """Whether the node is still in the graph: an input choice upstream of the output
        deletes what only its unchosen inputs used, and the choices of those nodes are then
        not made (they are not in the sample, nor counted in the space's size)."""
        try:
            self.node(uid)
        except KeyError:
            return False
        return True

    def run_nested(self, nested: list, mapping: dict[int, int]) -> None:
        """Run the mutators of a spliced candidate/block, translated to this graph."""
        ctx = self._ctx
        for m in nested:
            m.remap = {k: self.remap.get(v, v) for k, v in mapping.items()}
            m.apply(ctx, [])
        self._ctx = ctx


def splice_graph(g: Graph, sub: Graph, prefix: str, sources: list[Node]) -> tuple[dict, Node]:
    """Copy the body of ``sub`` into ``g`` (names and module paths prefixed), its inputs fed by
    ``sources`` in order. Returns (sub uid -> new uid, the node computing sub's output)."""
    mapping: dict[int, int] = {}
    out_src = None
    inputs = iter(sources)
    for n in sub.nodes:
        if n.kind == "input":
            src = next(inputs, None)
            if src is None:
                raise MutationError(f"the block spliced at {prefix!r} takes more inputs than "
                                    f"the {len(sources)} it is given")
            mapping[n.uid] = src.uid
        elif n.kind == "output":
            if n.op.args != [{"__in__": 0}]:
                raise MutationError(f"the block spliced at {prefix!r} must return a single "
                                    f"tensor (it returns {n.op.args[0]!r})")
            out_src = n.inputs[0]
        else:
            op = n.op.copy()
            if op.kind in ("module", "param", "subgraph"):
                op.attr = prefix + n.attr
            new = g.add_node(g.unique_name(prefix + n.name), op)
            new.meta = dict(n.meta)
            mapping[n.uid] = new.uid
    for s, d, port in sub.edges():
        if d.kind != "output":
            g.connect(g.node_by_uid(mapping[s.uid]), g.node_by_uid(mapping[d.uid]), port)
    return mapping, g.node_by_uid(mapping[out_src.uid])


def _splice(mutator: Mutator, node: Node, sub: Graph, prefix: str) -> dict[int, int]:
    """Replace ``node`` by the body of ``sub`` (a primitive built from the graph's own edits,
    recorded as one ``splice`` in the history)."""
    g = mutator.graph
    mapping, out = splice_graph(g, sub, prefix, node.inputs)
    created = [v for k, v in mapping.items() if sub.node_by_uid(k).kind != "input"]
    mutator._ctx.created.update(created)
    users = [u.uid for u in node.users]
    for dst, port in g.out_edges(node):
        g.connect(out, dst, port)
    for port in range(node.op.num_ports):
        g.disconnect_port(node, port)
    g.remove_node(node)
    mutator._record("splice", node=node.uid, name=node.name, users=users, nodes=created)
    return mapping


class LayerChoiceMutator(InlineMutator):
    def __init__(self, uid: int, keys: list, options: list, label: str):
        super().__init__(label)
        self.uid, self.keys, self.options = uid, keys, options

    def mutate(self, targets):
        if not self.reachable(self.uid):
            return
        node = self.node(self.uid)
        index = self.choose(dict(zip(self.keys, range(len(self.keys)))), self.label)
        kind, payload, nested = self.options[index]
        if kind == "op":
            self.replace(node, payload)
        else:
            key = str(self.keys[index]).replace("#", "_")
            mapping = _splice(self, node, payload, f"{node.name}.{key}.")
            self.run_nested(nested, mapping)


class InputChoiceMutator(InlineMutator):
    """Keeps the chosen inputs of the merge node, then deletes what fed only the others.

    Input choices run before the space's other inline choices, the one nearest the output
    first, so the choices of the nodes they delete are never made."""

    def __init__(self, uid: int, n: int, subsets: list[tuple[int, ...]], label: str):
        super().__init__(label)
        self.uid, self.n = uid, n
        self.options = {(c[0] if len(c) == 1 else ",".join(map(str, c))): c for c in subsets}

    def mutate(self, targets):
        if not self.reachable(self.uid):
            return
        node = self.node(self.uid)
        kept = self.choose(self.options, self.label)
        sources = node.inputs
        # a repeated input: every port is dropped and the kept ones appended in order
        drop = range(self.n) if len(set(kept)) < len(kept) else \
            [p for p in range(self.n) if p not in kept]
        for port in reversed(drop):
            self.graph.remove_port(node, port)
            self._record("disconnect", src=sources[port].uid, dst=node.uid, ports=[port])
        if len(set(kept)) < len(kept):
            for i in kept:
                port = self.graph.append_port(node)
                self.graph.connect(sources[i], node, port)
                self._record("connect", src=sources[i].uid, dst=node.uid, port=port)
        _delete_unused(self, [sources[p] for p in range(self.n) if p not in kept])


def _delete_unused(mutator: Mutator, nodes: list[Node]) -> None:
    """Delete ``nodes`` if nothing uses them any more, then their inputs likewise."""
    todo = list(nodes)
    while todo:
        node = todo.pop()
        try:
            mutator.graph.node_by_uid(node.uid)
        except KeyError:  # already deleted, through another path
            continue
        if node.kind in ("input", "output") or node.users:
            continue
        feeders = [src for src in node.inputs if src is not None]
        mutator.delete_node(node)
        todo.extend(feeders)


class RepeatMutator(InlineMutator):
    def __init__(self, depths: list, blocks: list, label: str):
        super().__init__(label)
        # one dict per block: uids (in this graph), out (uid), src (the Repeat's input uid),
        # nested (its mutators), map (block graph uid -> uid here)
        self.depths, self.blocks = depths, blocks

    def mutate(self, targets):
        if not self.reachable(self.blocks[-1]["out"]):
            return  # only its last block's output is used outside it: all of it is gone
        depth = self.choose(self.depths, self.label)
        g = self.graph
        if depth < len(self.blocks):
            dropped = {self.remap.get(u, u) for b in self.blocks[depth:] for u in b["uids"]}
            last_out = self.node(self.blocks[-1]["out"])
            keep_out = self.node(self.blocks[depth - 1]["out"] if depth else self.blocks[0]["src"])
            for dst, port in g.out_edges(last_out):
                if dst.uid not in dropped:
                    self.connect(keep_out, dst, port)
            for block in reversed(self.blocks[depth:]):
                for uid in reversed(block["uids"]):
                    self.delete_node(self.node(uid))
        for block in self.blocks[:depth]:
            self.run_nested(block["nested"], block["map"])


class ValueChoiceMutator(InlineMutator):
    """Chooses the ValueChoices used by the nodes of a graph and writes the values in.

    It runs after the graph's other inline choices, so it sees the candidates they picked; a
    ValueChoice used only by candidates that were not picked is not asked for (conditional).
    """

    def __init__(self, uids: list[int], labels: dict[str, list]):
        super().__init__("valuechoices")
        self.uids, self.labels = uids, labels  # label -> encoded values, in order of first use

    def mutate(self, targets):
        alive = self.graph.uids()
        nodes = [self.graph.node_by_uid(u) for u in (self.remap.get(u, u) for u in self.uids)
                 if u in alive]
        tagged = [n for n in nodes if labels_in([n.op.args, n.op.kwargs, n.op.spec])]
        used = set().union(*(labels_in([n.op.args, n.op.kwargs, n.op.spec]) for n in tagged))
        chosen = {label: self.choose([decode(v) for v in values], label)
                  for label, values in self.labels.items() if label in used}
        for node in tagged:
            op = node.op.copy()
            # the op with its choices still in: every candidate of the node, which weight
            # sharing reads (retiarii/optim/weight_keys.py: one module for all widths)
            template = {"args": op.args, "kwargs": op.kwargs, "spec": op.spec}
            op.args, op.kwargs = _substitute(op.args, chosen), _substitute(op.kwargs, chosen)
            op.spec = _substitute(op.spec, chosen)
            self.graph.set_op(node, op)  # keeps the module path: tied modules stay tied
            self._record("replace", node=node.uid, name=node.name, op=op.describe(),
                         template=template)


def labels_in(data: Any) -> set[str]:
    labels: set[str] = set()
    for p in find_tags(data, "__choice__"):
        labels |= labels_in(p["args"]) if "op" in p else {p["label"]}
    return labels


def _substitute(data: Any, chosen: dict) -> Any:
    return map_tags(data, "__choice__", lambda p: encode(evaluate_choice(p, chosen)))
