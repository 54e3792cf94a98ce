"""The pieces of a group's executable (build.py): its cells, its batched calls, and the
whole group as one IR graph (``GroupModule.graph``)."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..codec import PortRef, encode
from ..graph import Graph, Node, Operation

__all__ = ["Batch", "Cell", "merged_graph"]


@dataclass
class Cell:
    """A run of one model's own nodes between two batched calls (its nodes of one stage)."""

    name: str
    trial: str
    stage: int
    module: nn.Module
    reads: list[str]  # keys of its arguments: shared values, batched outputs, earlier cells'
    own_reads: list[bool]  # per argument: an earlier cell's value of this model (no clone);
    # shared values and batched outputs are cloned first when the cell writes in place
    exports: list[str]  # keys of what it returns (a tuple), read by later cells or batches
    final: bool  # holds the model's output node: returns the model's output
    clones: bool  # writes a value in place: gets copies of shared and batched values
    random: bool = True  # may draw random numbers (plan.may_draw_random): runs in its streams


@dataclass
class Batch:
    """One batched call (batching.py, regions.py): a region of frozen or weightless
    per-example operators run once on its models' inputs concatenated along dim 0 (per input
    position), in trial order; the outputs read outside it are split back per model."""

    name: str
    level: int  # runs before the cells of this stage
    module: nn.Module  # (x_0, ..., x_m) -> a tuple: each exported output
    pairs: list[tuple[str, tuple[str, ...], tuple[str, ...]]]  # (trial, input keys, output keys)
    mutates: bool  # writes its input in place (ReLU(inplace=True))
    graph: Graph  # the region as a cell (the IR of ``module``)
    operators: int = 1  # batched operators (plan.batches entries) it runs


def merged_graph(shared: Graph, frontier: list[str], cells: list[Cell],
                  cell_graphs: list[Graph], batches: list[Batch],
                  trials: tuple[str, ...]) -> Graph:
    """The group as one IR graph: inputs -> shared cell -> per stage, each batch (cat, the
    operator, split) and each model's cell of that stage -> a dict of the models' outputs."""
    g = Graph()
    inputs = [g.add_node(n.name, n.op.copy()) for n in shared.input_nodes]
    cell = g.add_node("shared", Operation("subgraph", args=[encode(PortRef(i))
                                                            for i in range(len(inputs))],
                                          graph=shared, attr="shared"))
    for port, node in enumerate(inputs):
        g.connect(node, cell, port)
    common = {}
    for j, k in enumerate(frontier):
        common[k] = g.add_node(f"shared_{j}", Operation(
            "function", target="_operator:getitem", args=[encode(PortRef(0)), j]))
        g.connect(cell, common[k], 0)
    values: dict[str, dict[str, Node]] = {t: {} for t in trials}

    def value(trial: str, key: str) -> Node:
        return values[trial].get(key) or common[key]

    def item(src: Node, name: str, j: int) -> Node:
        node = g.add_node(g.unique_name(name), Operation(
            "function", target="_operator:getitem", args=[encode(PortRef(0)), j]))
        g.connect(src, node, 0)
        return node

    outs = {}
    stages = max([c.stage for c in cells] + [b.level for b in batches] + [0]) + 1
    for stage in range(stages):
        for bt in (b for b in batches if b.level == stage):
            n, arity = len(bt.pairs), len(bt.pairs[0][1])
            # per input position j: n x (B_i, ...) -cat-> (sum B_i, ...); -region-> per
            # exported output e: -split-> n x (B_i, ...)
            cats = []
            for j in range(arity):
                cat = g.add_node(f"{bt.name}_cat" + (f"{j}" if arity > 1 else ""), Operation(
                    "function", target="torch:cat", args=[
                        encode([PortRef(p) for p in range(n)]), 0]))
                for p, (t, srcs, _) in enumerate(bt.pairs):
                    g.connect(value(t, srcs[j]), cat, p)
                cats.append(cat)
            sizes = []
            for p, (t, srcs, _) in enumerate(bt.pairs):
                size = g.add_node(f"{bt.name}_size{p}", Operation(
                    "method", target="size", args=[encode(PortRef(0)), 0]))
                g.connect(value(t, srcs[0]), size, 0)
                sizes.append(size)
            call = g.add_node(bt.name, Operation("subgraph", args=[encode(PortRef(j))
                                                                   for j in range(arity)],
                                                 graph=bt.graph, attr=f"batched.{bt.name}"))
            for j, cat in enumerate(cats):
                g.connect(cat, call, j)
            for e in range(len(bt.pairs[0][2])):
                whole = item(call, f"{bt.name}_out{e}", e)
                split = g.add_node(f"{bt.name}_split{e}", Operation("method", target="split",
                                   args=[encode(PortRef(0)),
                                         encode([PortRef(p + 1) for p in range(n)])]))
                g.connect(whole, split, 0)
                for p, size in enumerate(sizes):
                    g.connect(size, split, p + 1)
                for p, (t, _, keys) in enumerate(bt.pairs):
                    values[t][keys[e]] = item(split, f"{bt.name}_{e}_{p}", p)
        for c, graph in zip(cells, cell_graphs):
            if c.stage != stage:
                continue
            node = g.add_node(f"part_{c.name}", Operation(
                "subgraph", args=[encode(PortRef(p)) for p in range(len(c.reads))],
                graph=graph, attr=f"parts.{c.name}"))
            for port, k in enumerate(c.reads):
                g.connect(value(c.trial, k), node, port)
            if c.final:
                outs[c.trial] = node
            for j, k in enumerate(c.exports):
                values[c.trial][k] = item(node, f"part_{c.name}_{j}", j)
    out = g.add_node("output", Operation("output", args=[encode(
        {t: PortRef(i) for i, t in enumerate(trials)})]))
    for i, t in enumerate(trials):
        g.connect(outs[t], out, i)
    return g
