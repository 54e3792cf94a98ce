"""Reading a space as a union of node variants: what :mod:`.relax` turns into a supernet.

A relaxation needs, for every node the space can produce, *how its computation depends on the
choices*. This is read from the space itself, by replaying it (never by asking mutators what
they do): starting from the all-first sample, each label is moved to each of its candidates
and the replayed graphs are compared node by node (nodes are identified by name, which base
nodes keep and mutators and splices make unique). A node's **variant** is its operation plus
the names of the nodes feeding its ports::

    label "cell/op" = conv  ->  node "cell.op": Conv2d(8, 8, 3)  <- ("cell.pre",)
    label "cell/op" = pool  ->  node "cell.op": MaxPool2d(3)     <- ("cell.pre",)   an operator choice
    label "skip"    = 0     ->  node "merge":   Sum              <- ("a",)
    label "skip"    = 1     ->  node "merge":   Sum              <- ("b",)          an input choice

The result is a :class:`NodePlan` per node: the labels it depends on and a table from their
candidate indices to its variant (or ``None`` where the node does not exist, e.g. inside a
spliced candidate that is not chosen). A node that depends on two labels (an op whose stride
follows its input, as in DARTS' reduction cells) gets its table from a replay of every
combination, unless the labels touch different fields of the variant (one the operation, the
other a port), where the table is composed from the single moves. Labels a choice makes
appear (choices inside a spliced candidate) are explored from a sample where they exist.

Finally a few random samples are replayed and every node compared with what the tables
predict: choices that interact in a way the tables do not capture are refused with an error
that names them, rather than relaxed wrongly.
"""
from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass, field
from typing import Any

from ..graph import Operation
from ..shapes import has_lazy, propagate

__all__ = ["NodePlan", "RelaxError", "SpaceReading", "read_space"]

MAX_COMBINATIONS = 4096  # per node: the table of a node depending on several labels jointly
MAX_REPLAYS = 20000  # per space: what reading it may cost (a replay is milliseconds)
CHECK_SAMPLES = 6  # random samples replayed to confirm the tables

_ADVICE = ("use a one-shot strategy that samples whole architectures (spos, enas) or a "
           "multi-trial strategy instead")


class RelaxError(ValueError):
    """A space (or a choice of it) that a continuous relaxation cannot represent."""


@dataclass
class NodePlan:
    """How one node of the union depends on the choices.

    ``table`` maps a tuple of candidate indices (one per label of ``labels``, in order) to an
    index into ``variants`` or to None (the node does not exist there). A node that depends on
    no label has ``labels == ()`` and ``table == {(): 0}``.
    """

    name: str
    labels: tuple[str, ...]
    table: dict[tuple[int, ...], int | None]
    variants: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)  # (op key, sources)

    @property
    def may_be_absent(self) -> bool:
        return any(v is None for v in self.table.values())

    def labels_changing(self, part: str) -> tuple[str, ...]:
        """The labels that, moved alone, change the node's operation (``part="op"``) or the
        nodes feeding it (``"sources"``)."""
        cache = self.__dict__.setdefault("_changing", {})
        if part not in cache:
            field = 0 if part == "op" else 1
            found = set()
            for j, label in enumerate(self.labels):
                seen: dict[tuple, set] = {}  # the other labels' indices -> values of the field
                for combo, vid in self.table.items():
                    if vid is not None:
                        rest = combo[:j] + combo[j + 1:]
                        seen.setdefault(rest, set()).add(self.variants[vid][field])
                if any(len(values) > 1 for values in seen.values()):
                    found.add(label)
            cache[part] = tuple(label for label in self.labels if label in found)
        return cache[part]


@dataclass
class SpaceReading:
    """What :func:`read_space` found: labels and their candidate keys, the operations (by key)
    and one plan per node of the union, in a topological order."""

    labels: dict[str, list]  # label -> candidate keys, in discovery order
    ops: dict[str, Operation]  # op key -> operation
    nodes: list[NodePlan]
    inputs: list[str]  # graph input nodes, in the forward's argument order
    output: str  # the output node
    reference: Any  # the Model of the all-first sample (frozen values are read from it)
    replays: int = 0


def op_key(op: Operation) -> str:
    return json.dumps(op.to_data(), sort_keys=True)


class _Reader:
    def __init__(self, space):
        self.space = space
        self.cache: dict[str, tuple[dict, dict]] = {}
        self.ops: dict[str, Operation] = {}
        self.first_model = None

    def replay(self, assignment: dict[str, int]) -> tuple[dict, dict]:
        """(name -> (op key, sources), label -> candidate keys asked) of a full assignment
        (labels it does not give take their first candidate)."""
        key = json.dumps(assignment, sort_keys=True)
        if key in self.cache:
            return self.cache[key]
        if len(self.cache) >= MAX_REPLAYS:
            raise RelaxError(f"reading the space took more than {MAX_REPLAYS} replays: its "
                             f"choices interact too much to relax; {_ADVICE}")
        asked: dict[str, list] = {}

        def choose(label, candidates, context):
            asked[label] = list(candidates)
            return min(assignment.get(label, 0), len(candidates) - 1)

        model = self.space.sample(choose)
        if self.space.example_input is not None and has_lazy(model.graph):
            propagate(model, self.space.example_input)  # settles lazy sizes
        if self.first_model is None:
            self.first_model = model
        snap = {}
        for node in model.graph.nodes:
            k = op_key(node.op)
            self.ops.setdefault(k, node.op)
            snap[node.name] = (k, tuple(x.name if x is not None else "" for x in node.inputs))
        self.cache[key] = (snap, asked)
        return snap, asked


def _check_space(space) -> None:
    if len(space.bases) > 1:
        raise RelaxError(f"the space has {len(space.bases)} base models (label 'base'): a "
                         f"relaxation mixes operations of one graph; {_ADVICE}")
    if space.open_ended:
        raise RelaxError(f"the space is open-ended (mutators "
                         f"{[b.mutator.label for b in space.mutators if b.mutator.open_ended]}"
                         f" grow it without bound); {_ADVICE}")
    if space.hparams:
        labels = sorted(space.hparam_labels().values())
        raise RelaxError(f"labels {labels} are trainer hyper-parameters, which "
                         f"a relaxation cannot mix inside one model; search them with a "
                         f"multi-trial strategy (or remove them from the space)")


def _fields(variant: tuple[str, tuple]) -> dict:
    op, sources = variant
    return {"op": op, "ports": len(sources), **{i: s for i, s in enumerate(sources)}}


def read_space(space, check_samples: int = CHECK_SAMPLES, seed: int = 0) -> SpaceReading:
    """Read ``space`` into node plans; see the module docstring.

    Raises:
        RelaxError: the space or one of its labels cannot be relaxed (the message names it).
    """
    _check_space(space)
    reader = _Reader(space)
    ref, asked = reader.replay({})
    labels: dict[str, list] = dict(asked)
    homes: dict[str, dict[str, int]] = {label: {} for label in labels}
    moves: dict[str, list[dict]] = {}  # label -> the snapshot at each of its candidates
    todo = list(labels)
    while todo:
        label = todo.pop(0)
        moves[label] = []
        for i in range(len(labels[label])):
            snap, asked = reader.replay({**homes[label], label: i})
            moves[label].append(snap)
            for new, keys in asked.items():
                if new not in labels:
                    labels[new], homes[new] = keys, {**homes[label], label: i}
                    todo.append(new)
                elif keys != labels[new]:
                    raise RelaxError(f"label {new!r} offers different candidates in different "
                                     f"models ({labels[new]} and {keys}): a choice whose "
                                     f"candidates depend on other choices cannot be relaxed; "
                                     f"{_ADVICE}")
    names: dict[str, None] = {}  # the union of nodes, in order of first appearance
    for snap in [ref] + [s for label in moves for s in moves[label]]:
        names.update(dict.fromkeys(snap))
    depends: dict[str, dict[str, set]] = {n: {} for n in names}  # node -> label -> fields
    for label, snaps in moves.items():
        for n in names:
            seen = [s.get(n) for s in snaps]
            if len({json.dumps(v) for v in seen}) > 1:
                touched: set = set()
                if None in seen:
                    touched.add("presence")
                present = [_fields(v) for v in seen if v is not None]
                for f in set().union(*present) if present else ():
                    if len({json.dumps(p.get(f)) for p in present}) > 1:
                        touched.add(f)
                depends[n][label] = touched
    plans = {n: _plan(n, depends[n], labels, homes, moves, reader) for n in names}
    _confirm(plans, labels, reader, check_samples, seed)
    order = _topological(plans, reader)
    inputs = [n for n in ref if reader.ops[ref[n][0]].kind == "input"]
    output = next(n for n in ref if reader.ops[ref[n][0]].kind == "output")
    return SpaceReading(labels, reader.ops, [plans[n] for n in order], inputs, output,
                        reader.first_model, len(reader.cache))


def _plan(name: str, depends: dict[str, set], labels: dict, homes: dict, moves: dict,
          reader: _Reader) -> NodePlan:
    variants: list = []

    def vid(v):
        if v is None:
            return None
        if v not in variants:
            variants.append(v)
        return variants.index(v)

    if not depends:
        snap = next(s for s in [reader.replay({})[0]] + [x for m in moves.values() for x in m]
                    if name in s)
        return NodePlan(name, (), {(): vid(snap[name])}, variants)
    order = tuple(depends)
    sizes = [len(labels[label]) for label in order]
    total = 1
    for s in sizes:
        total *= s
    if total > MAX_COMBINATIONS:
        raise RelaxError(f"node {name!r} depends jointly on labels {list(order)} "
                         f"({total} combinations): too many to relax; {_ADVICE}")
    touched = [depends[label] for label in order]
    separable = all("presence" not in t for t in touched) and all(
        not (a & b) for a, b in itertools.combinations(touched, 2)) and all(
        "ports" not in t for t in touched if len(order) > 1)
    table = {}
    if len(order) == 1 or separable:
        base = _fields(moves[order[0]][0][name]) if name in moves[order[0]][0] else None
        for combo in itertools.product(*(range(s) for s in sizes)):
            if len(order) == 1:
                table[combo] = vid(moves[order[0]][combo[0]].get(name))
                continue
            fields = dict(base)
            for label, i, t in zip(order, combo, touched):
                moved = _fields(moves[label][i][name])
                fields.update({f: moved[f] for f in t})
            table[combo] = vid((fields["op"], tuple(fields[k] for k in range(fields["ports"]))))
    else:
        home: dict[str, int] = {}
        for label in order:
            home.update(homes[label])
        for combo in itertools.product(*(range(s) for s in sizes)):
            snap, _ = reader.replay({**home, **dict(zip(order, combo))})
            table[combo] = vid(snap.get(name))
    return NodePlan(name, order, table, variants)


def _confirm(plans: dict[str, NodePlan], labels: dict, reader: _Reader, count: int,
             seed: int) -> None:
    """Replay random samples and check every node against its plan."""
    rng = random.Random(seed)
    assignments = [{label: len(keys) - 1 for label, keys in labels.items()}]
    assignments += [{label: rng.randrange(len(keys)) for label, keys in labels.items()}
                    for _ in range(count)]
    for assignment in assignments:
        snap, asked = reader.replay(assignment)
        unknown = set(asked) - set(labels)
        if unknown:
            raise RelaxError(f"labels {sorted(unknown)} appear only when several choices "
                             f"change together; {_ADVICE}")
        extra = set(snap) - set(plans)
        if extra:
            raise RelaxError(f"nodes {sorted(extra)[:5]} appear only when several choices "
                             f"change together; {_ADVICE}")
        for name, plan in plans.items():
            predicted = plan.table[tuple(assignment[label] for label in plan.labels)]
            actual = snap.get(name)
            if (None if predicted is None else plan.variants[predicted]) != actual:
                others = sorted(set(labels) - set(plan.labels))[:4]
                raise RelaxError(
                    f"node {name!r} is not computed as labels {list(plan.labels)} predict one "
                    f"at a time: it also depends on other choices together with them (one of "
                    f"{others}...); choices that interact this way cannot be relaxed; {_ADVICE}")


def _topological(plans: dict[str, NodePlan], reader: _Reader) -> list[str]:
    """The union's nodes in an order where every variant's sources come first."""
    deps = {n: {s for _, sources in p.variants for s in sources} for n, p in plans.items()}
    order: list[str] = []
    state: dict[str, int] = {}
    for start in plans:
        stack = [(start, iter(sorted(deps[start])))]
        if state.get(start):
            continue
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                state[node] = 2
                order.append(node)
            elif state.get(nxt) == 1:
                raise RelaxError(f"mixing the choices makes a cycle through node {nxt!r} "
                                 f"(one candidate reads a node that another feeds); {_ADVICE}")
            elif not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(sorted(deps.get(nxt, ())))))
    return order
