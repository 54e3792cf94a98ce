"""The logical plan: a batch of models, every node of every model keyed by what it computes.

Cross-model optimization starts here (docs/optimization.md). :func:`build_plan` takes the
models the engine has in hand (:class:`PlanModel`: trial id, the space's
:class:`~retiarii.space.Model` with its mutation history, the trainer's data key, the hparams)
and gives every node an **identity key**, a Merkle hash of

* its **origin**, read from the mutation history, never by comparing graphs: a node of the
  base model that no mutation replaced is ``(base, uid)``; a node a mutation created or
  replaced adds the history record that made it and the choices made up to that record
  (mutators are deterministic, so two models with the same choices so far have the same
  history so far and the same uids);
* its **operation** (kind, target, call template, module spec);
* its **role** (:class:`Role`): the data pipeline, a constant, frozen, weightless, or the
  model's own (trainable, stateful or random) node; an own node's key also holds the trial
  id, so it is never the same as another model's;
* the keys of its **inputs**, in port order.

The data pipeline (each input node) is the root, keyed by the trainer's data key
(``Trainer.data_key(hparams)``; None makes it unique to its model). Two nodes with equal keys
compute the same values; whether they are computed once is a pass's decision
(:mod:`retiarii.optim.cse`), recorded in :attr:`LogicalPlan.shared`.

Example::

    plan = build_plan([PlanModel(f"t{i}", space.replay(s), trainer.data_key(hp), hp)
                       for i, (s, hp) in enumerate(batch)])
    result = cse(plan)            # PassResult(plan, modified)
    result.plan.executions()      # node evaluations per step, shared ones counted once
"""
from __future__ import annotations

import enum
import functools
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx
from torch import nn

from ..graph import Graph, Node
from ..modspec import build_module
from ..space import Model

__all__ = [
    "LogicalPlan",
    "PassResult",
    "PlanError",
    "PlanModel",
    "PlanNode",
    "Role",
    "build_plan",
    "may_draw_random",
]


class PlanError(ValueError):
    """Models that cannot be planned (a dangling port, two models with one trial id)."""


class Role(enum.Enum):
    """What a node is, for sharing. Only ``OWN`` nodes are never shared."""

    DATA = "data"  # an input node: the data pipeline, keyed by the trainer's data key
    CONST = "const"  # a tensor constant, or a non-persistent buffer read directly
    FROZEN = "frozen"  # frozen base values (a frozen module or parameter, unchanged by
    # mutations); a frozen BatchNorm's running statistics are its state (PlanNode.stateful)
    PURE = "pure"  # weightless and deterministic: relu, add, a pooling layer, a merge
    OWN = "own"  # trainable, stateful (persistent buffers), random, or the output


@dataclass(frozen=True)
class PlanModel:
    """One model of a batch: what the engine knows of a ready trial."""

    trial_id: str
    model: Model  # graph + mutation history + base index (ModelSpace.sample / replay)
    data_key: str | None  # Trainer.data_key(hparams); None: shares no data pipeline
    hparams: dict = field(default_factory=dict)
    # node uid -> digest of a stateful frozen node's state (a frozen BatchNorm's running
    # statistics) at the segment start (optim/state.py); a node missing here is keyed as of
    # unknown state (None), equal in every model: the driver plans so, and the group checks
    # the values before it shares them.
    state: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PlanNode:
    """One distinct computation of the plan (one key), held by one or more models."""

    key: str
    role: Role
    inputs: tuple[str, ...]  # keys of the inputs, port order
    mutates: bool  # writes its first input in place (relu_, +=, inplace=True)
    name: str  # the node's name in the first model holding it (for messages)
    holders: tuple[str, ...]  # trial ids of the models holding it, plan order
    op_key: str = ""  # the key without the inputs: equal for one frozen op fed other values
    stateful: bool = False  # FROZEN with running statistics that train mode updates


@dataclass(frozen=True)
class LogicalPlan:
    """A batch of models, their nodes keyed (see the module docstring), and what passes
    decided to share. Immutable: passes return a new plan."""

    models: tuple[PlanModel, ...]
    nodes: Mapping[str, PlanNode]  # key -> node, in a topological order of the keys
    keys: Mapping[str, Mapping[int, str]]  # trial id -> node uid -> key
    shared: frozenset[str] = frozenset()  # keys computed once for all their holders
    # Operator batching (batching.py): each batch is ((trial, key), ...), pairs of one op_key
    # that run as one call on their inputs concatenated along dim 0, in trial (plan) order.
    batches: tuple[tuple[tuple[str, str], ...], ...] = ()

    def model(self, trial_id: str) -> PlanModel:
        return next(m for m in self.models if m.trial_id == trial_id)

    @functools.cached_property
    def readers(self) -> Mapping[str, frozenset[str]]:
        """key -> keys of the nodes reading it, in any model of the plan."""
        out: dict[str, set[str]] = {k: set() for k in self.nodes}
        for key, node in self.nodes.items():
            for src in node.inputs:
                out[src].add(key)
        return {k: frozenset(v) for k, v in out.items()}

    def executions(self) -> int:
        """Node evaluations one training step of every model costs under this plan: a shared
        key counts once, a batch once, any other (key, holder) pair once."""
        batched = {pair for batch in self.batches for pair in batch}
        return len(self.batches) + sum(
            1 if key in self.shared else sum((t, key) not in batched for t in node.holders)
            for key, node in self.nodes.items())

    @functools.cached_property
    def batched(self) -> Mapping[tuple[str, str], int]:
        """(trial, key) -> index of its batch in :attr:`batches`."""
        return {pair: i for i, batch in enumerate(self.batches) for pair in batch}

    def data_roots(self, trial_id: str) -> tuple[str, ...]:
        """Keys of the model's input nodes (its data pipeline), in argument order."""
        graph = self.model(trial_id).model.graph
        return tuple(self.keys[trial_id][n.uid] for n in graph.input_nodes)

    def groups(self) -> list[tuple[str, ...]]:
        """Trials that can run as one executable: those fed by one data pipeline (equal data
        keys), each model with a None data key alone; in plan order."""
        out: dict[tuple, list[str]] = {}
        for m in self.models:
            roots = self.data_roots(m.trial_id)
            shared = all(r in self.shared for r in roots) and m.data_key is not None
            out.setdefault(roots if shared else (m.trial_id,), []).append(m.trial_id)
        return [tuple(g) for g in out.values()]

    def restrict(self, trial_ids: Iterable[str]) -> LogicalPlan:
        """The plan of some of its models (a physical group), sharing what this plan shares
        among them."""
        wanted = set(trial_ids)
        unknown = wanted - {m.trial_id for m in self.models}
        if unknown:
            raise PlanError(f"trials {sorted(unknown)} are not in the plan")
        sub = build_plan([m for m in self.models if m.trial_id in wanted])
        batches = tuple(kept for kept in (tuple(p for p in batch if p[0] in wanted)
                                          for batch in self.batches) if len(kept) > 1)
        return replace(sub, shared=frozenset(k for k in self.shared
                                             if len(sub.nodes.get(k, _NONE).holders) > 1),
                       batches=batches)

    def describe(self) -> str:
        """One line per key: role, holders, shared or not (for logs and tests)."""
        return "\n".join(f"{n.name:24} {n.role.value:6} x{len(n.holders)}"
                         f"{' shared' if k in self.shared else ''}"
                         f"{' batched' if any((t, k) in self.batched for t in n.holders) else ''}"
                         for k, n in self.nodes.items())


@dataclass(frozen=True)
class PassResult:
    """What a pass returns (as torch.fx's ``PassResult``): the new plan, and whether it
    differs from the one given."""

    plan: LogicalPlan
    modified: bool


# ---- keys -----------------------------------------------------------------------------------

_RANDOM_NAMES = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like",
                 "randperm", "bernoulli", "bernoulli_", "multinomial", "normal", "normal_",
                 "poisson", "uniform_", "exponential_", "geometric_", "cauchy_",
                 "log_normal_", "random_", "rrelu", "rrelu_", "gumbel_softmax",
                 "native_dropout", "dropout_"}
_INPLACE_FUNCTIONS = {"_operator:iadd", "_operator:isub", "_operator:imul",
                      "_operator:itruediv", "_operator:ifloordiv", "_operator:imod",
                      "_operator:ipow", "_operator:iand", "_operator:ior", "_operator:ixor",
                      "_operator:ilshift", "_operator:irshift", "_operator:imatmul",
                      "_operator:setitem"}
# BatchNorm and friends as functions update the running statistics they are given.
_STATEFUL_FUNCTIONS = {"batch_norm", "instance_norm"}


def _short(target: str | None) -> str:
    return str(target).rpartition(":")[2].rpartition(".")[2]


def _random_name(name: str) -> bool:
    return name in _RANDOM_NAMES or "dropout" in name


def _mutates(node: Node) -> bool:
    """Whether ``node`` writes its first input in place."""
    op = node.op
    if op.kwargs.get("inplace") is True:
        return True
    if op.kind == "function":
        short = _short(op.target)
        return op.target in _INPLACE_FUNCTIONS or (short.endswith("_")
                                                   and not short.startswith("_"))
    if op.kind == "method":
        return op.target.endswith("_") and not op.target.startswith("__") \
            or op.target in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__")
    if op.kind == "module":
        return (op.spec or {}).get("kwargs", {}).get("inplace") is True
    return False


@functools.lru_cache(maxsize=4096)
def module_facts(spec_json: str) -> tuple[bool, bool, bool]:
    """(has parameters, has persistent buffers, draws random numbers in train mode) of a
    module spec, read from the module built on the meta device."""
    with torch.device("meta"):
        module = build_module(json.loads(spec_json))
    params = any(True for _ in module.parameters())
    persistent = bool(module.state_dict(keep_vars=True).keys() - dict(module.named_parameters(
        remove_duplicate=False)).keys())
    return params, persistent, any(_random_module(m) for m in module.modules())


def _random_module(m: nn.Module) -> bool:
    if isinstance(m, nn.modules.dropout._DropoutNd):
        return m.p > 0  # p=0 returns its input without drawing
    if isinstance(m, nn.MultiheadAttention):
        return m.dropout > 0
    return isinstance(m, nn.RReLU)


# Modules whose code this engine knows: torch's own and retiarii's. Anything else (a user's
# leaf module, a user's function) may draw random numbers however it likes.
_KNOWN_CODE = ("torch", "retiarii", "_operator", "operator", "math", "builtins")


def _known_module(name: str) -> bool:
    """Whether the Python module ``name`` ("torch.nn.functional") is code this engine knows."""
    return name.split(".")[0] in _KNOWN_CODE


def _known(obj: Any) -> bool:
    """Whether ``obj`` (a class or function) is code this engine knows (``_KNOWN_CODE``)."""
    return _known_module(str(getattr(obj, "__module__", None)))


@functools.lru_cache(maxsize=4096)
def _module_may_draw(spec_json: str) -> bool:
    """Whether a module spec's module may draw random numbers (train or eval mode): random by
    type (dropout, RReLU, attention with dropout); a module of torch's or retiarii's is known
    otherwise. A user's module (an adapter, a block inserted by a mutator) is traced
    (:func:`_traced_may_draw`); one that cannot be is assumed to draw."""
    with torch.device("meta"):
        module = build_module(json.loads(spec_json))
    if any(_random_module(m) for m in module.modules()):
        return True
    if all(_known(type(m)) for m in module.modules()):
        return False
    return _traced_may_draw(module)


def _traced_may_draw(module: nn.Module) -> bool:
    """Whether a user's module (on the meta device) may draw, from its torch.fx traces in
    train and in eval mode: False only when both trace, every traced node is known not to
    draw (a torch module, function or tensor method whose name is not a random one) and
    tracing drew nothing itself (a Python-level ``random.random()`` runs *during* the trace
    and leaves no node: its draw shows in the streams). Anything else: True."""
    from ..rng import native_rng  # the engine's stream snapshot (rng.py)

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, (tuple, list)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, torch.Tensor):
            return torch.equal(a, b)
        if hasattr(a, "shape"):  # NumPy's key array
            return bool((a == b).all())
        return a == b

    for mode in (True, False):
        module.train(mode)
        before = native_rng()
        try:
            traced = torch.fx.symbolic_trace(module)
        except Exception:  # noqa: BLE001 (untraceable: unknown, so it may draw)
            return True
        finally:
            after = native_rng()
        if not same(before, after):
            return True
        for node in traced.graph.nodes:
            if node.op == "call_module":
                sub = traced.get_submodule(node.target)
                if any(_random_module(m) or not _known(type(m)) for m in sub.modules()):
                    return True
            elif node.op == "call_function":
                if not _known(node.target) or _random_name(getattr(node.target, "__name__", "")):
                    return True
            elif node.op == "call_method":
                if _random_name(str(node.target)):
                    return True
    return False


def may_draw_random(graph: Graph) -> bool:
    """Whether running ``graph`` may draw random numbers (from any stream: torch's, Python's
    or NumPy's). False only when every node is known not to: an input, output, constant or
    parameter; a module of torch's or retiarii's that is not random (:func:`_random_module`),
    or a user's module whose torch.fx traces show no draw (:func:`_traced_may_draw`); a
    function or method of torch, ``operator``, ``math`` or builtins whose name is not a
    random one; a subgraph of such nodes. A group swaps a model's RNG streams in only around
    the cells that may draw (build.py): swapping costs about 0.2 ms (NumPy's state)."""
    for node in graph.nodes:
        kind = node.kind
        if kind in ("input", "output", "constant", "param"):
            continue
        if kind == "subgraph":
            if may_draw_random(node.op.graph):
                return True
        elif kind == "module":
            if _module_may_draw(json.dumps(node.op.spec or {}, sort_keys=True)):
                return True
        elif kind in ("function", "method"):
            target = str(node.op.target)
            if _random_name(_short(target)) or (
                    kind == "function" and not _known_module(target.partition(":")[0])):
                return True
        else:
            return True
    return False


def cell_is_pure(graph: Graph) -> bool:
    """A cell (subgraph) is weightless and deterministic when all its nodes are."""
    for node in graph.nodes:
        if node.kind in ("input", "output", "constant"):
            continue
        if node.kind == "param":
            if node.op.spec.get("buffer") and not node.op.spec.get("persistent", True):
                continue
            return False
        if node.kind == "subgraph":
            if not cell_is_pure(node.op.graph):
                return False
        elif _node_role(node, frozen_ok=False) is not Role.PURE:
            return False
    return True


def _node_role(node: Node, frozen_ok: bool) -> Role:
    """The role of a node; ``frozen_ok``: it holds the base model's values (an untouched
    base node), so a frozen spec means frozen values."""
    op, spec = node.op, node.op.spec or {}
    if op.kind == "input":
        return Role.DATA
    if op.kind == "output":
        return Role.OWN
    if op.kind == "constant":
        return Role.CONST
    if op.kind == "param":
        if spec.get("buffer"):  # a persistent buffer is state; a non-persistent one a constant
            return Role.OWN if spec.get("persistent", True) else Role.CONST
        return Role.FROZEN if frozen_ok and spec.get("requires_grad") is False else Role.OWN
    if op.kind == "module":
        params, persistent, random = module_facts(json.dumps(spec, sort_keys=True))
        if random:
            return Role.OWN
        if persistent:  # state: the model's own, unless frozen running statistics (below)
            return Role.FROZEN if frozen_ok and spec.get("frozen") else Role.OWN
        if not params:
            return Role.PURE
        return Role.FROZEN if frozen_ok and spec.get("frozen") else Role.OWN
    if op.kind == "subgraph":
        return Role.PURE if cell_is_pure(op.graph) else Role.OWN
    name = _short(op.target)  # function or method
    if _random_name(name) or name in _STATEFUL_FUNCTIONS:
        return Role.OWN
    return Role.PURE


def _stateful(node: Node) -> bool:
    """Whether a module node keeps persistent buffers (for a frozen one: running
    statistics, modspec.is_frozen)."""
    return node.kind == "module" and module_facts(
        json.dumps(node.op.spec or {}, sort_keys=True))[1]


def _origin(model: Model, base_uids, node: Node, made: dict[int, int]) -> list:
    """Where a node comes from, read from the history: a base uid, plus the record (and the
    choices made up to it) of the last mutation that created or replaced it."""
    origin: list[Any] = ["base" if node.uid in base_uids else "new", model.base, node.uid]
    index = made.get(node.uid)
    if index is not None:
        rec = model.history[index]
        origin += [index, rec["mutator"], rec["primitive"],
                   [[label, model.sample.get(label)] for label in rec["choices"]]]
    return origin


def _made_by(model: Model) -> dict[int, int]:
    """uid -> index of the last history record that created it or changed its operation."""
    made: dict[int, int] = {}
    for i, rec in enumerate(model.history):
        if rec["primitive"] in ("create_node", "replace", "materialize"):
            made[rec["node"]] = i
        elif rec["primitive"] == "splice":
            for uid in rec["nodes"]:
                made[uid] = i
    return made


def _op_data(node: Node) -> Any:
    data = node.op.to_data(with_names=False)
    if node.kind == "subgraph":
        data["graph"] = node.op.graph.structural_hash()
    if node.kind == "input":
        data.pop("target", None)  # the argument's position matters, not its name
    return data


def _hash(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def build_plan(models: Iterable[PlanModel]) -> LogicalPlan:
    """Key every node of every model (see the module docstring); nothing is shared yet.

    Args:
        models: the batch; models of one space (same base) can share nodes, models of
            different spaces or bases only their data pipeline.

    Raises:
        PlanError: two models with one trial id, or a model with a dangling input port.
    """
    models = tuple(models)
    ids = [m.trial_id for m in models]
    if len(set(ids)) != len(ids):
        raise PlanError(f"trial ids must be unique in a plan, got {ids}")
    nodes: dict[str, dict] = {}
    keys: dict[str, dict[int, str]] = {}
    for pm in models:
        model, mine = pm.model, {}
        graph = model.graph
        base_uids = set(graph.uids()) - model.created()
        made = _made_by(model)
        changed = model.changed_ops()
        positions = {n.uid: i for i, n in enumerate(graph.input_nodes)}
        for node in graph.nodes:
            inputs = node.inputs
            if None in inputs:
                raise PlanError(f"trial {pm.trial_id}: node {node.name!r} has a dangling "
                                f"input port {inputs.index(None)}")
            in_keys = [mine[i.uid] for i in inputs]
            role = _node_role(node, frozen_ok=node.uid in base_uids and node.uid not in changed)
            stateful = role is Role.FROZEN and _stateful(node)
            if role is Role.DATA:
                payload = ["data", pm.data_key if pm.data_key is not None else
                           ["alone", pm.trial_id], positions[node.uid], _op_data(node)]
            else:
                payload = [role.value, _origin(model, base_uids, node, made), _op_data(node),
                           in_keys, pm.trial_id if role is Role.OWN else None]
                if stateful:  # what it computes depends on its running statistics too
                    payload.append(["state", pm.state.get(node.uid)])
            key = mine[node.uid] = _hash(payload)
            entry = nodes.get(key)
            if entry is None:
                op_key = _hash(payload[:3] + payload[4:]) if role is not Role.DATA else key
                nodes[key] = {"key": key, "role": role, "inputs": tuple(in_keys),
                              "mutates": _mutates(node), "name": node.name,
                              "holders": [pm.trial_id], "op_key": op_key,
                              "stateful": stateful}
            elif pm.trial_id not in entry["holders"]:
                entry["holders"].append(pm.trial_id)
        keys[pm.trial_id] = mine
    return LogicalPlan(models, {k: PlanNode(**{**v, "holders": tuple(v["holders"])})
                                for k, v in nodes.items()}, keys)


_NONE = PlanNode("", Role.OWN, (), False, "", ())
