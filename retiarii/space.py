"""ModelSpace: base models + mutators; sample, replay, enumerate and count the models.

Example::

    >>> space = retiarii.ModelSpace(Net(), [retiarii.apply_mutator(["relu", "pool", "fc"],
    ...                                                              InceptionMutator())],
    ...                             example_input=torch.randn(1, 1, 8, 8))
    >>> space.size()
    360
    >>> model = space.random_sample(seed=0)
    >>> model.sample
    {'paths': 3, 'op0': 'conv', 'op1': 'pool', 'op2': 'dconv'}
    >>> space.replay(model.sample).graph.structural_hash() == model.graph.structural_hash()
    True
    >>> net = space.build(model.sample)        # an nn.Module, shapes checked

A *sample* maps each choice's label to the key of the chosen candidate (docs/architecture.md).
"""
from __future__ import annotations

import copy
import hashlib
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from .choice_tracing import trace_space
from .choices import ValueChoice
from .graph import Graph
from .mutator import BoundMutator, Context, Mutator
from .sampler import (PrefixSampler, RandomSampler, ReplaySampler, SampleError, as_sampler,
                      walk_choices)
from .shapes import has_lazy, propagate

_TOUCHING = {"replace": ("node",), "delete_node": ("node",), "connect": ("dst",),
             "disconnect": ("dst",), "materialize": ("node",)}


_CHANGING_OPS = ("replace", "splice", "materialize")


class SpaceError(ValueError):
    """A request the space cannot serve (enumerating an unbounded space, ...)."""


@dataclass
class Model:
    """One instantiated model of a space."""

    graph: Graph
    sample: dict  # label -> chosen key, in the order the choices were made
    history: list  # the primitives applied, one record each
    base: int = 0  # index of the base model it came from
    hparams: dict = field(default_factory=dict)  # trainer hyper-parameters chosen in the sample

    def structural_hash(self) -> str:
        return self.graph.structural_hash()

    def to_module(self) -> nn.Module:
        return self.graph.to_module()

    def touched(self) -> set[int]:
        """uids of base nodes whose operation or inputs the mutations changed (or deleted)."""
        out = set()
        for rec in self.history:
            for key in _TOUCHING.get(rec["primitive"], ()):
                out.add(rec[key])
        return out

    def changed_ops(self) -> set[int]:
        """uids of base nodes whose operation the mutations replaced (``replace``, a splice,
        lazy sizes settled): their weights are new, not the base model's."""
        return {rec["node"] for rec in self.history if rec["primitive"] in _CHANGING_OPS}

    def created(self) -> set[int]:
        return {rec["node"] for rec in self.history if rec["primitive"] == "create_node"} | {
            uid for rec in self.history if rec["primitive"] == "splice" for uid in rec["nodes"]}

    def shared_nodes(self, other: "Model") -> set[int]:
        """uids of base nodes that both models hold unchanged (same op, same inputs' uids).

        This is read from the mutation histories, not by comparing graphs: cross-model
        optimization relies on it. Nodes downstream of a changed node are still reported
        shared (same op and weights shape); whether their *values* agree is the optimizer's
        question, answered by also requiring their ancestors to be shared.
        """
        if other.base != self.base:
            return set()
        mine = set(self.graph.uids()) - self.created() - self.touched()
        theirs = set(other.graph.uids()) - other.created() - other.touched()
        return mine & theirs

    def differing_nodes(self, other: "Model") -> set[int]:
        """uids present in either model that are not shared."""
        return (set(self.graph.uids()) | set(other.graph.uids())) - self.shared_nodes(other)


def _frozen_values(module: nn.Module, graph: Graph) -> dict[str, dict[str, torch.Tensor]]:
    """attr -> {state key in a built model: the base's tensor} for the frozen nodes of a
    traced base (see :meth:`ModelSpace.frozen_nodes`); tensors by reference."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for node in graph.nodes:
        spec = node.op.spec or {}
        if node.kind == "module" and spec.get("frozen") and node.attr not in out:
            sub = module.get_submodule(node.attr)
            out[node.attr] = {f"{node.attr}.{k}": p.detach()
                              for k, p in sub.named_parameters(remove_duplicate=False)}
            # A frozen BatchNorm's running statistics (modspec.is_frozen) start every model
            # at the base's values; copied now, so running the base later changes nothing.
            out[node.attr].update({f"{node.attr}.{k}": b.detach().clone()
                                   for k, b in sub.state_dict(keep_vars=True).items()
                                   if f"{node.attr}.{k}" not in out[node.attr]})
        elif node.kind == "param" and not spec.get("buffer") \
                and spec.get("requires_grad") is False:
            out[node.attr] = {node.attr: module.get_parameter(node.attr).detach()}
    return out


# ---- the space -----------------------------------------------------------------------------


class ModelSpace:
    """Base models and the mutators that define a space around them.

    Args:
        base_model_or_models: an ``nn.Module`` or a list of them (a choice labelled
            ``"base"`` then picks one). Inline choices inside them (LayerChoice, InputChoice,
            ValueChoice, Repeat) compile into mutators that run before ``mutators``.
        mutators: :class:`~retiarii.Mutator` s, bound to targets with
            :func:`~retiarii.apply_mutator` (an unbound mutator gets ``targets=[]`` and finds
            its own nodes through ``self.graph``).
        example_input: a tensor (or tuple of tensors) used by :meth:`instantiate` to check
            shapes and settle lazy modules' sizes.
        concrete_args, leaf_modules: passed to :func:`retiarii.trace`.

    Two attributes tell the continuous relaxation (:mod:`retiarii.optim.relax`) what the
    space's paper does, where the graph cannot say it: ``derivation``, how the relaxed
    weights become a discrete sample (None: the argmax of every label; DARTS' cells keep the
    top-2 incoming edges of each node: :class:`retiarii.optim.derivation.EdgeDerivation`),
    and ``relaxation``, a class built as ``relaxation(space, mode=..., seed=...)`` in place
    of :class:`~retiarii.optim.relax.Relaxation` for a space whose choices live inside one
    module (DARTS' recurrent cell unrolled over time: model_spaces/recurrent.py).
    """

    derivation: Any = None
    relaxation: Any = None

    def __init__(self, base_model_or_models: nn.Module | Sequence[nn.Module],
                 mutators: Sequence[Mutator | BoundMutator] = (), example_input: Any = None,
                 concrete_args: dict | None = None, leaf_modules: Sequence = ()):
        bases = base_model_or_models if isinstance(base_model_or_models, (list, tuple)) \
            else [base_model_or_models]
        if not bases:
            raise ValueError("a ModelSpace needs at least one base model")
        self.bases = [trace_space(m, concrete_args, leaf_modules) for m in bases]
        # Frozen values (docs/optimization.md): read from the base module objects, by
        # reference (no copy), and copied into every model built; see frozen_fingerprint.
        self._frozen = [_frozen_values(m, g) for m, (g, _) in zip(bases, self.bases)]
        self._frozen_fp: str | None = None
        self.base_names = [type(m).__name__ for m in bases]
        if len(set(self.base_names)) < len(bases):
            self.base_names = [f"{n}#{i}" for i, n in enumerate(self.base_names)]
        self.mutators: list[BoundMutator] = []
        for i, m in enumerate(mutators):
            bound = m if isinstance(m, BoundMutator) else BoundMutator(None, m)
            if bound.mutator.label is None:
                bound.mutator.label = f"{type(bound.mutator).__name__.lower()}{i}"
            self.mutators.append(bound)
        self.example_input = example_input
        self.hparams: dict[str, Any] = {}  # name -> ValueChoice, see with_hparams
        # The module that built this space: where worker processes import it from.
        self.defined_in = sys._getframe(1).f_globals.get("__name__")

    def hparam_labels(self) -> dict[str, str]:
        """Each trainer setting's label in a sample: its choice's label, else the setting's
        name (``batch_size=ValueChoice(..., label="bs")`` is ``sample["bs"]``)."""
        return {name: choice.label or name for name, choice in self.hparams.items()}

    def with_hparams(self, hparams: dict) -> "ModelSpace":
        """This space plus trainer hyper-parameters (ValueChoices) as choices, explored like
        architecture choices; the chosen values land in ``Model.hparams``. Returns a new space
        (sharing the traced bases); plain values in ``hparams`` are not choices and are
        ignored."""
        space = copy.copy(self)
        space.hparams = dict(self.hparams)
        for name, value in hparams.items():
            if isinstance(value, ValueChoice):
                space.hparams[name] = ValueChoice(value.values, label=value.label or name)
        return space

    @property
    def open_ended(self) -> bool:
        return any(b.mutator.open_ended for b in self.mutators)

    # ---- building models ------------------------------------------------------------------
    def sample(self, sampler: Any) -> Model:
        """Build one model, asking ``sampler.choose(label, candidates, context)`` for every
        choice as it is reached (conditional choices only when they exist)."""
        sampler = as_sampler(sampler)
        ctx = Context(graph=None, sampler=sampler, sample={}, history=[], created=set(),
                      deleted={}, example_input=self.example_input)
        base = 0
        if len(self.bases) > 1:
            base = sampler.choose("base", list(self.base_names), {})
            ctx.sample["base"] = self.base_names[base]
        graph, inline = self.bases[base]
        ctx.graph = graph.copy()
        for mutator in inline:
            mutator.apply(ctx, [])
        for bound in self.mutators:
            bound.apply(ctx)
        hparams = {}
        for name, choice in self.hparams.items():
            hparams[name] = choice.choose_in(ctx)
        return Model(ctx.graph, ctx.sample, ctx.history, base, hparams)

    def random_sample(self, seed: int | None = None) -> Model:
        return self.sample(RandomSampler(seed))

    def base_model(self) -> Model:
        """The model of the all-defaults sample: every choice takes its first candidate.

        For mutator spaces that is the (first) base model itself, since built-in mutators
        offer the base's operation or input first and evolving mutators stop growing by
        default; for inline choices, the model as it runs eagerly. It is where an evolving
        (open-ended) space starts, e.g. ``RegularizedEvolution(initial="base")``.
        """
        return self.sample(lambda label, candidates, context: 0)

    def default_sample(self) -> dict:
        """The sample of :meth:`base_model` (``label -> first key``), e.g. for ``replay``."""
        return dict(self.base_model().sample)

    def replay(self, sample: dict) -> Model:
        """Rebuild the model of ``sample`` exactly (same structural hash)."""
        sampler = ReplaySampler(sample)
        model = self.sample(sampler)
        unknown = set(sample) - sampler.used - {"base"}
        if unknown:
            raise SampleError(f"the sample has labels this space never asks for: "
                              f"{sorted(unknown)}; known labels: {list(model.sample)}")
        return model

    def instantiate(self, sample: dict) -> Model:
        """:meth:`replay`, then check shapes on ``example_input`` and settle lazy modules.

        Raises:
            ShapeMismatchError: naming the node, the expected and actual shapes, and the
                choices that led there.
        """
        return self.check_shapes(self.replay(sample))

    def check_shapes(self, model: Model) -> Model:
        """Check the shapes of ``model`` (one of this space's, e.g. from :meth:`sample`) on
        ``example_input`` and settle its lazy modules, in place; returns it.

        Raises:
            ShapeMismatchError: as :meth:`instantiate`.
        """
        if self.example_input is not None:
            propagate(model, self.example_input)
        return model

    def build(self, sample: dict, check: bool = True) -> nn.Module:
        """The runnable ``nn.Module`` of ``sample`` (fresh weights); what workers call.

        Args:
            check: propagate ``example_input`` to check shapes. Workers pass False for
                samples the driver already instantiated; lazy modules are still settled.
        """
        return self.build_with_model(sample, check)[1]

    def build_with_model(self, sample: dict, check: bool = True) -> tuple[Model, nn.Module]:
        """:meth:`build`, and the :class:`Model` (graph IR, mutation history) it was emitted
        from: a worker plans grouped jobs on that IR instead of replaying the sample again."""
        if check:
            # The shape check builds (and caches) layers: keep their init out of the caller's
            # RNG streams, or the first model built in a process would get other weights.
            with torch.random.fork_rng(devices=[]):
                model = self.instantiate(sample)
        else:
            model = self.replay(sample)
            if self.example_input is not None and has_lazy(model.graph):
                propagate(model, self.example_input)
        return model, self.load_frozen(model, model.to_module())

    # ---- frozen parameters ------------------------------------------------------------------
    def frozen_nodes(self, model: Model) -> dict[int, str]:
        """uid -> attribute path of the nodes of ``model`` that hold frozen base values: module
        nodes the trace marked frozen and parameters read directly with
        ``requires_grad=False``, both from the base model and with their operation unchanged
        by the mutations (a replaced node has new weights)."""
        base_graph = self.bases[model.base][0]
        base_uids, changed = base_graph.uids(), model.changed_ops()
        out = {}
        for node in model.graph.nodes:
            if node.uid not in base_uids or node.uid in changed:
                continue
            spec = node.op.spec or {}
            if (node.kind == "module" and spec.get("frozen")) or (
                    node.kind == "param" and not spec.get("buffer")
                    and spec.get("requires_grad") is False):
                out[node.uid] = node.attr
        return out

    def load_frozen(self, model: Model, module: nn.Module) -> nn.Module:
        """Copy the base model's frozen values into ``module`` (built from ``model``); returns it.

        Raises:
            SpaceError: a frozen node's tensors no longer fit the base's (a choice changed
                its sizes without replacing it).
        """
        values = self._frozen[model.base]
        owned = {**dict(module.named_buffers(remove_duplicate=False)),
                 **dict(module.named_parameters(remove_duplicate=False))}
        with torch.no_grad():
            for uid, attr in self.frozen_nodes(model).items():
                for key, value in values.get(attr, {}).items():
                    target = owned.get(key)
                    if target is None or target.shape != value.shape:
                        raise SpaceError(
                            f"frozen node {model.graph.node_by_uid(uid).name!r}: {key} has "
                            f"shape {None if target is None else tuple(target.shape)} in the "
                            f"model but {tuple(value.shape)} in the base model; a frozen layer "
                            f"must keep its sizes (replace it to give it new weights)")
                    target.copy_(value)
                    if isinstance(target, nn.Parameter):
                        target.requires_grad_(False)
        return module

    def frozen_fingerprint(self) -> str | None:
        """A hash of every frozen value of the base models (None when there is none).

        Frozen values come from the base module objects of the process that made the space,
        so they must be deterministic (loaded pretrained weights, or an init under a fixed
        seed): the experiment records this hash in the space's fingerprint, and a worker
        whose space hashes differently refuses to train (:meth:`check_frozen`).
        """
        if self._frozen_fp is None and any(self._frozen):
            digest = hashlib.sha256()
            for i, values in enumerate(self._frozen):
                for attr in sorted(values):
                    for key, t in sorted(values[attr].items()):
                        t = t.detach().cpu().contiguous()
                        digest.update(f"{i}|{key}|{t.dtype}|{list(t.shape)}|".encode())
                        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            self._frozen_fp = digest.hexdigest()
        return self._frozen_fp

    def check_frozen(self, fingerprint: str | None) -> None:
        """Raise :class:`SpaceError` when this process's frozen values are not those hashed
        as ``fingerprint`` (e.g. by the driver)."""
        mine = self.frozen_fingerprint()
        if fingerprint != mine:
            raise SpaceError(
                f"the frozen parameters of this space differ from the driver's (fingerprint "
                f"{str(mine)[:12]} here, {str(fingerprint)[:12]} there): frozen values are "
                f"read from the base model object in each process, so they must be "
                f"deterministic (load pretrained weights, or initialise under a fixed seed)")

    # ---- the whole space --------------------------------------------------------------------
    def _run(self, prefix: Sequence[int]) -> tuple[Model, list[int]]:
        sampler = PrefixSampler(prefix)
        model = self.sample(sampler)
        return model, sampler.arity

    def enumerate(self) -> Iterator[Model]:
        """Every model of a finite space, once each, in a deterministic order."""
        if self.open_ended:
            raise SpaceError("the space is unbounded (it has open-ended mutators); it cannot "
                             "be enumerated")
        yield from walk_choices(self._run)

    def size(self, exact: bool = False) -> int | float:
        """The number of distinct samples, counted without emitting any module.

        Returns ``math.inf`` for an unbounded space. The count walks the tree of choices; a
        choice whose every value leads to the same sequence of later choices is counted as a
        factor instead of being walked (so a space of 10^20 independent choices is counted in
        a few hundred mutator runs). Later choices are compared by label and number of
        candidates, so two values that open different choices (two branches of an input
        choice) are both walked. The shortcut assumes choices only change which choices
        follow one at a time, not through combinations of values; ``exact=True`` walks every
        branch instead.
        """
        if self.open_ended:
            return math.inf

        def shape(prefix):
            sampler = PrefixSampler(prefix)
            self.sample(sampler)
            return list(zip(sampler.labels, sampler.arity))

        def count(prefix: list[int]) -> int:
            choices = shape(prefix)
            arity = [n for _, n in choices]
            k = len(prefix)
            if len(arity) == k:
                return 1
            n = arity[k]
            if not exact:
                tails = {tuple(shape(prefix + [i])[k + 1:]) for i in range(1, n)}
                if tails <= {tuple(choices[k + 1:])}:
                    return n * count(prefix + [0])
            return sum(count(prefix + [i]) for i in range(n))

        return count([])

    def __repr__(self):
        return (f"ModelSpace(bases={self.base_names}, mutators="
                f"{[b.mutator.label for b in self.mutators]})")
