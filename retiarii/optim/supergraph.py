"""The weight-sharing super-graph: every operator of every model a strategy samples, once.

The paper's third cross-model optimization (§5.1, "Super-Graph for Weight Sharing"): models of
one space that share weights are merged into one pool of operators, built from the mutation
history as models arrive, never enumerated up front. Each operator of a model has a weight key
(:mod:`retiarii.optim.weight_keys`: the base node it comes from, or the mutator and its own
choice that made it, never choices made elsewhere nor the trial); the pool holds one module
per key. A model's **path** is its own graph, emitted once (:func:`retiarii.codegen.to_module`)
with the pool's modules installed instead of fresh ones, so a step of a model trains exactly
its operators, at the speed of the model alone.

* BatchNorm running statistics are shared like weights (as SPOS does: a path's statistics
  are those of every path that went through the layer; SPOS recomputes them per architecture
  before evaluating, which is the strategy's business).
* Frozen base values (a space's frozen layers) are shared too, with ``requires_grad=False``.
* Width and kernel-size ValueChoices share the largest candidate's weights, sliced
  (:mod:`retiarii.optim.sliced`).
* A new operator's initial weights depend on its key and the super-graph's ``seed`` only, so
  two super-graphs of one space start from the same weights whatever order paths arrive in.

Example::

    sg = SuperGraph(space)
    opt = torch.optim.SGD([{"params": sg.parameters()}], lr=0.1, momentum=0.9)
    sg.attach(opt)                             # operators join opt as paths add them
    for x, y in batches:
        net = sg.path(space.random_sample().sample)
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()
    torch.save({"sg": sg.state_dict(), "opt": opt.state_dict()}, "ckpt.pt")
    best = sg.export(best_sample)              # a standalone nn.Module, inherited weights
"""
from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from ..codegen import to_module
from ..graph import Graph, Node
from ..interpreter import init_tensor
from ..modspec import build_module
from ..sampler import SampleError
from ..shapes import has_lazy, propagate
from ..space import Model
from .paths import PathBuilder, holds_tensors
from .sliced import build_big, sliced
from .weight_keys import OpKey, SuperGraphError, weight_keys

__all__ = ["SuperGraph", "SuperGraphError"]

_FORMAT = 1  # version of state_dict()'s layout


class _Tensor(nn.Module):
    """Holds a parameter or buffer read directly by a graph, so every pooled operator is a
    module with a state dict."""

    def __init__(self, value: torch.Tensor, buffer: bool, persistent: bool = True):
        super().__init__()
        if buffer:
            self.register_buffer("value", value, persistent=persistent)
        else:
            self.value = value if isinstance(value, nn.Parameter) else nn.Parameter(value)


@dataclass
class _Entry:
    op: OpKey  # as first seen (its recipe rebuilds the module)
    module: nn.Module


class SuperGraph:
    """A pool of shared operators, grown by the models of ``space`` that are asked for.

    Args:
        space: the :class:`~retiarii.ModelSpace` whose models share weights.
        device: where the pooled weights live (default CPU); paths run there.
        seed: seeds each new operator's initial weights with a hash of (seed, key).
        cache_size: how many models and paths to keep built (least recently used go).
        shared: the operators whose weights are shared, as ``fnmatch`` patterns of their
            module paths in the model (``"stem"``, ``"cells.*"``); every other operator is
            **private** to its architecture (one copy per distinct sample, trained whenever
            that architecture is). None (default): every operator is shared.

    Raises:
        SuperGraphError: a ``shared`` pattern that matches no operator of the space's default
            model (a typo would otherwise make every operator private).
    """

    def __init__(self, space: Any, device: torch.device | str | None = None, seed: int = 0,
                 cache_size: int = 256, shared: list[str] | tuple[str, ...] | None = None):
        self.space = space
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.seed = seed
        self.shared = None if shared is None else tuple(_patterns(shared))
        self._pool: dict[str, _Entry] = {}
        self.cache_size = cache_size
        # canonical sample -> model, and -> path: both kept for the ``cache_size`` most
        # recently used (a search samples without end; weights live in the pool, and paths
        # are quick to rebuild from the builder's cached cells and layouts, paths.py)
        self._models: OrderedDict[str, Model] = OrderedDict()
        self._paths: OrderedDict[str, nn.Module] = OrderedDict()
        self._optimizers: list[torch.optim.Optimizer] = []
        self._builder = PathBuilder(self.device, cache_size=4 * cache_size)
        if self.shared is not None:
            attrs = sorted({op.attr for op in weight_keys(
                space, self.model_of(space.default_sample())).values()})
            for pattern in self.shared:
                if not any(fnmatch.fnmatchcase(a, pattern) for a in attrs):
                    raise SuperGraphError(
                        f"shared={list(self.shared)}: {pattern!r} matches no operator of the "
                        f"space; operators of its default model: {attrs[:12]}"
                        f"{' ...' if len(attrs) > 12 else ''}")

    # ---- the pool ------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """The weight keys in the pool, in the order they were added."""
        return list(self._pool)

    def __len__(self) -> int:
        return len(self._pool)

    def __contains__(self, key: str) -> bool:
        return key in self._pool

    def module(self, key: str) -> nn.Module:
        """The pooled module of ``key`` (a parameter read directly is held as ``.value``)."""
        return self._pool[key].module

    def op(self, key: str) -> OpKey:
        """The operator the pool holds under ``key`` (as first seen)."""
        return self._pool[key].op

    def parameters(self) -> list[nn.Parameter]:
        """Every shared parameter so far, in the order the pool grew (frozen ones included,
        with ``requires_grad=False``); stable, so an optimizer built from it and resumed
        from a checkpoint lines up. Empty until a path is built: build an optimizer on an
        empty pool as ``SGD([{"params": sg.parameters()}], lr=...)`` (torch refuses a bare
        empty list) and :meth:`attach` it."""
        return [p for _, p in self.named_parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``("{key}:{name}", parameter)`` in :meth:`parameters` order: names that mean the
        same weight in every super-graph of the space, whatever order its pool grew in (e.g.
        to line up ranks that sampled different models)."""
        out, seen = [], set()
        for key, entry in self._pool.items():
            for name, p in entry.module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((f"{key}:{name}", p))
        return out

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Let ``optimizer`` train every parameter the pool holds or will hold.

        Parameters the pool holds now and ``optimizer`` lacks join it at once; those later
        :meth:`path` calls add join it as they appear. They join the optimizer's *first*
        parameter group (so they get its hyper-parameters, and an LR scheduler driving that
        group drives them too); then an optimizer built as ``SGD(sg.parameters(), ...)`` keeps
        its parameters in :meth:`parameters` order, and its ``state_dict`` loads into the
        optimizer of a resumed super-graph built the same way.
        """
        if not optimizer.param_groups:
            raise SuperGraphError("attach: the optimizer has no parameter group; build it "
                                  "with sg.parameters() (or any parameter) first")
        self._optimizers.append(optimizer)
        self._join(self.parameters())

    def _join(self, params: list[nn.Parameter]) -> None:
        for opt in self._optimizers:
            have = {id(p) for g in opt.param_groups for p in g["params"]}
            opt.param_groups[0]["params"].extend(p for p in params if id(p) not in have)

    def _add(self, op: OpKey, base: int | None) -> _Entry:
        """Build the pooled operator of ``op`` (deterministic: seeded by its key); a frozen
        one gets the base model's values (``base``: the model's base; None when a checkpoint
        supplies them)."""
        digest = hashlib.sha256(f"{self.seed}|{op.key}".encode()).digest()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int.from_bytes(digest[:8], "little") & (2 ** 63 - 1))
            module = _build(op)
        if op.frozen and base is not None:
            with torch.no_grad():
                for name, value in self.space._frozen[base].get(op.attr, {}).items():
                    local = name[len(op.attr) + 1:] if name != op.attr else "value"
                    # a parameter, or a frozen BatchNorm's running statistics (buffers)
                    owner, _, leaf = local.rpartition(".")
                    getattr(module.get_submodule(owner), leaf).copy_(value)
        if op.frozen:
            module.requires_grad_(False)
        module.to(self.device)
        entry = self._pool[op.key] = _Entry(op, module)
        self._join(list(module.parameters()))
        return entry

    def drop(self, keys: Iterable[str]) -> None:
        """Take the operators of ``keys`` out of the pool (a rank of a split super-graph hands
        them on, :mod:`retiarii.optim.split`): out of the attached optimizers (groups and
        state) and of every cached path, cell and layout, so their memory is freed. Keys the
        pool lacks are ignored; a later path that needs one adds it afresh (or load it)."""
        from .keyed_state import forget_parameters

        gone = [self._pool.pop(k) for k in keys if k in self._pool]
        if not gone:
            return
        params = [p for e in gone for p in e.module.parameters()]
        tensors = {id(t) for e in gone for t in [*e.module.parameters(), *e.module.buffers()]}
        for opt in self._optimizers:
            forget_parameters(opt, params)
        for canon in [c for c, net in self._paths.items() if holds_tensors(net, tensors)]:
            del self._paths[canon]
        self._builder.forget(tensors)

    def ops_of(self, sample_or_model: dict | Model) -> dict[str, OpKey]:
        """The model's operators by weight key (what its path uses), without building any."""
        model = self.model_of(sample_or_model)
        return {op.key: op for op in self._weight_keys(model).values()}

    def _weight_keys(self, model: Model) -> dict[str, OpKey]:
        """attr -> OpKey of the model's operators; an operator that ``shared`` leaves out gets
        a key of its own architecture (``{key}#{sample hash}``)."""
        ops = weight_keys(self.space, model)
        if self.shared is None:
            return ops
        mine = hashlib.sha256(_canonical(model.sample).encode()).hexdigest()[:12]
        return {attr: op if any(fnmatch.fnmatchcase(op.attr, p) for p in self.shared)
                else dataclasses.replace(op, key=f"{op.key}#{mine}") for attr, op in ops.items()}

    def _module_or_meta(self, op: OpKey) -> nn.Module:
        """The pooled module of ``op``, or one built on the meta device (nothing allocated)."""
        entry = self._pool.get(op.key)
        if entry is not None:
            return entry.module
        with torch.device("meta"):
            return _build(op)

    def training_bytes(self, op: OpKey, optimizer_slots: int = 2) -> int:
        """Bytes operator ``op`` takes on a device while training: a trained weight with its
        gradient and ``optimizer_slots`` state tensors (Adam: 2, SGD with momentum: 1), a
        frozen weight or a buffer once. Counted on the pooled module when there is one, else
        on the meta device (nothing allocated)."""
        module = self._module_or_meta(op)
        total = 0
        for p in module.parameters():
            trained = p.requires_grad and not op.frozen
            total += p.numel() * p.element_size() * ((2 + optimizer_slots) if trained else 1)
        total += sum(b.numel() * b.element_size() for b in module.buffers())
        return total

    def parameter_shapes(self, op: OpKey) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """``(name, shape, dtype)`` of each trained parameter of ``op``, named as
        :meth:`named_parameters` names them, whether or not the pool holds it (a rank of a split
        super-graph lines up gradients of weights held elsewhere by these)."""
        if op.frozen:
            return []
        module = self._module_or_meta(op)
        return [(f"{op.key}:{n}", tuple(p.shape), p.dtype)
                for n, p in module.named_parameters() if p.requires_grad]

    # ---- paths ---------------------------------------------------------------------------
    def model_of(self, sample_or_model: dict | Model) -> Model:
        """The :class:`~retiarii.space.Model` of a sample (replayed) or a model, checked to be
        one of this space's.

        Raises:
            SuperGraphError: the sample asks for labels the space does not have, or the model
                is not what replaying its sample in this space gives.
        """
        if isinstance(sample_or_model, Model):
            model = sample_or_model
            canon = _canonical(model.sample)
            if canon not in self._models:
                try:
                    mine, unsettled = self._replay(model.sample, with_unsettled_hash=True)
                except SuperGraphError:
                    mine, unsettled = None, None
                # space.sample leaves lazy modules (LazyConv2d...) unsettled; the replay here
                # settles them on example_input: either graph is this space's model
                if mine is None or model.structural_hash() not in (mine.structural_hash(),
                                                                   unsettled):
                    raise SuperGraphError(
                        f"the model (sample {model.sample}) is not a model of this space: "
                        f"replaying its sample here builds another graph. Pass models made "
                        f"by this space (space.sample / space.replay) or their samples")
                if has_lazy(model.graph):
                    model = mine  # the settled graph: paths are built from known sizes
            return self._remember(canon, model)
        if not isinstance(sample_or_model, dict):
            raise SuperGraphError(f"expected a sample (a dict label -> choice) or a Model, got "
                                  f"{type(sample_or_model).__name__}")
        canon = _canonical(sample_or_model)
        model = self._models.get(canon)
        return self._remember(canon, model if model is not None
                              else self._replay(sample_or_model))

    def _remember(self, canon: str, model: Model) -> Model:
        model = self._models.setdefault(canon, model)
        self._models.move_to_end(canon)
        while len(self._models) > self.cache_size:
            self._models.popitem(last=False)
        return model

    def _replay(self, sample: dict, with_unsettled_hash: bool = False):
        """The model of ``sample`` with its lazy modules settled; with
        ``with_unsettled_hash``, ``(model, its structural hash before settling)``."""
        try:
            with torch.random.fork_rng(devices=[]):
                model = self.space.replay(sample)
                unsettled = model.structural_hash() if with_unsettled_hash else None
                if self.space.example_input is not None and has_lazy(model.graph):
                    propagate(model, self.space.example_input)
        except SampleError as e:
            raise SuperGraphError(f"the sample is not one of this space's: {e}") from None
        return (model, unsettled) if with_unsettled_hash else model

    def path(self, sample_or_model: dict | Model) -> nn.Module:
        """The module that runs this model's graph on the shared operators (same Parameter
        objects), cached per sample; operators the pool lacks are added (and join attached
        optimizers). Its code is generated once per candidate and per layout
        (:mod:`retiarii.optim.paths`).

        Raises:
            SuperGraphError: not a model of this space (see :meth:`model_of`), or an
                operator whose candidates cannot share weights.
        """
        model = self.model_of(sample_or_model)
        canon = _canonical(model.sample)
        net = self._paths.get(canon)
        if net is None:
            net = self._paths[canon] = self._build_path(model, self._weight_keys(model))
        self._paths.move_to_end(canon)
        while len(self._paths) > self.cache_size:
            self._paths.popitem(last=False)
        return net

    def _build_path(self, model: Model, ops: dict[str, OpKey]) -> nn.Module:
        for op in ops.values():
            if op.key not in self._pool:
                self._add(op, model.base)
            else:
                _check_same(self._pool[op.key].op, op)

        def provide(node: Node, attr: str):
            op = ops.get(attr)
            if op is None:
                return None
            pooled = self._pool[op.key].module
            if op.kind == "param":
                return pooled.value
            if op.mode == "same":
                return pooled
            with torch.device("meta"):
                layer = build_module(node.op.spec)
            if op.mode == "slice":
                return sliced(pooled, layer)
            return _rebind(layer, pooled, node)

        return self._builder.build(model, provide, {a: o.key for a, o in ops.items()})

    # ---- checkpoints -----------------------------------------------------------------------
    def state_dict(self, keys: Iterable[str] | None = None) -> dict:
        """The pool as one unit: per operator its key, how to rebuild it and its tensors
        (weights and buffers), in pool order; ``torch.save``-able. Optimizer state is the
        caller's (save ``optimizer.state_dict()`` next to it). ``keys``: only these
        operators (those the pool holds)."""
        wanted = None if keys is None else set(keys)
        return {"format": _FORMAT, "seed": self.seed, "entries": [
            {"key": k, "attr": e.op.attr, "name": e.op.name, "kind": e.op.kind,
             "mode": e.op.mode, "recipe": e.op.recipe, "frozen": e.op.frozen,
             "state": {n: t.detach().clone() for n, t in e.module.state_dict().items()}}
            for k, e in self._pool.items() if wanted is None or k in wanted]}

    def load_state_dict(self, state: dict, keys: Iterable[str] | None = None) -> None:
        """Load what :meth:`state_dict` returned, into this (fresh or used) super-graph of the
        same space, its ``seed`` included (operators added later start as they would have):
        operators it has are overwritten in place (their Parameter objects stay, so paths and
        attached optimizers keep working), the others are rebuilt from their recipes, in the
        saved order. ``keys``: load only these operators (a rank of a split super-graph holds
        part of the pool); None loads them all.

        Raises:
            SuperGraphError: not a super-graph state, or an operator saved under a key this
                pool holds with another recipe.
        """
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise SuperGraphError(f"not a SuperGraph state (format {_FORMAT}): got "
                                  f"{type(state).__name__} with format "
                                  f"{state.get('format') if isinstance(state, dict) else None}")
        self.seed = state["seed"]  # operators added after a resume start as they would have
        wanted = None if keys is None else set(keys)
        for item in state["entries"]:
            if wanted is not None and item["key"] not in wanted:
                continue
            op = OpKey(item["key"], item["attr"], item["name"], item["kind"], item["mode"],
                       item["recipe"], item["frozen"])
            entry = self._pool.get(op.key)
            if entry is None:
                entry = self._add(op, None)
            else:
                _check_same(entry.op, op)
            try:
                entry.module.load_state_dict(item["state"])
            except RuntimeError as e:
                raise SuperGraphError(f"operator {op.key!r}: its saved tensors do not fit "
                                      f"({e})") from None

    # ---- export ------------------------------------------------------------------------------
    def export_state(self, sample_or_model: dict | Model) -> dict[str, torch.Tensor]:
        """The ``state_dict`` of the model's standalone module (``space.build(sample)``) with
        the weights it inherits from the pool (sliced where its sizes are smaller); copies."""
        net = self.path(sample_or_model)
        return {k: v.detach().clone() for k, v in net.state_dict().items()}

    def export(self, sample_or_model: dict | Model) -> nn.Module:
        """A standalone module of the model (as ``space.build`` gives, on this super-graph's
        device) carrying its inherited weights; training it leaves the pool untouched."""
        model = self.model_of(sample_or_model)
        with torch.random.fork_rng(devices=[]):
            net = self.space.load_frozen(model, model.to_module())
        net.load_state_dict(self.export_state(model))
        return net.to(self.device)


# ---- helpers ----------------------------------------------------------------------------------


def _patterns(shared: Any) -> list[str]:
    if isinstance(shared, str) or not all(isinstance(p, str) and p for p in shared):
        raise SuperGraphError(f"shared={shared!r}: give a list of module path patterns, e.g. "
                              "['stem', 'cells.*']")
    return list(shared)


def _canonical(sample: dict) -> str:
    return json.dumps(sample, sort_keys=True, default=repr)


def _build(op: OpKey) -> nn.Module:
    if op.mode == "slice":
        return build_big(op.recipe)
    if op.kind == "module":
        return build_module(op.recipe["spec"])
    if op.kind == "cell":
        return to_module(Graph.from_data(op.recipe["graph"]), "Cell")
    spec = op.recipe["spec"]
    value = init_tensor(spec)
    if not spec["buffer"]:
        value = nn.Parameter(value, requires_grad=spec.get("requires_grad", True))
    return _Tensor(value, spec["buffer"], spec.get("persistent", True))


def _check_same(have: OpKey, new: OpKey) -> None:
    if (have.kind, have.mode, have.recipe) != (new.kind, new.mode, new.recipe):
        raise SuperGraphError(
            f"operator {new.key!r} (node {new.name!r}) is in the pool as a {have.kind} "
            f"({have.mode}) with recipe {have.recipe}, but this model needs {new.kind} "
            f"({new.mode}) with {new.recipe}; is the state from another space?")


def _rebind(layer: nn.Module, pooled: nn.Module, node: Node) -> nn.Module:
    """``layer`` (built on the meta device) holding ``pooled``'s tensors: a ValueChoice that
    changes no shape (a stride, an eps) keeps one set of weights."""
    for kind in ("_parameters", "_buffers"):
        mine = {name for name, _ in (layer.named_parameters() if kind == "_parameters"
                                     else layer.named_buffers())}
        theirs = dict(pooled.named_parameters() if kind == "_parameters"
                      else pooled.named_buffers())
        if mine != set(theirs):
            raise SuperGraphError(f"node {node.name!r}: its candidates hold different "
                                  f"tensors ({sorted(mine)} vs {sorted(theirs)})")
        for name, value in theirs.items():
            owner_path, _, leaf = name.rpartition(".")
            owner = layer.get_submodule(owner_path) if owner_path else layer
            getattr(owner, kind)[leaf] = value
    return layer
