"""Weight keys: which shared weights each operator of a model uses (the super-graph's index).

Every *operator* of a model (a module node with parameters or persistent buffers, a cell
holding any, a parameter or persistent buffer read directly) gets a **weight key**, read from
the mutation history, never by comparing graphs (as :mod:`retiarii.optim.plan` reads node
origins). Two operators of two models of one space use the same weights exactly when their
keys are equal:

* a node of the base model that no mutation replaced: ``base{i}/{attr}@{spec}``, the base's
  own operator (frozen or trainable);
* a node a mutation created, replaced or spliced in:
  ``{mutator}[{label}={value},...]/{attr}@{spec}``, where the choices are the ones *that
  mutator* made for this edit (the ``choose`` records of the same mutator just before it,
  since its previous edit), not every choice made so far. So the candidate ``choice_3`` of
  ``block3`` has one set of weights whatever blocks 1 and 2 chose (SPOS's single-path
  semantics), and no key holds a trial or a model;
* a node whose constructor arguments are inline ValueChoices:
  ``{origin}/{attr}~{template}``, the origin of the node before the values were written in and
  the hash of the op with its choices *still in* (all its candidates), so every value of the
  choice maps to one key. Candidates whose weights have one shape share the module; widths
  and kernel sizes of Conv2d, Linear and BatchNorm share the largest candidate's weights
  sliced (:mod:`retiarii.optim.sliced`); any other shape change is a :class:`SuperGraphError`;
* a lazy module settled by shape propagation: its settled spec is in the key (its sizes come
  from the nodes upstream, so each size has its own weights).

``{spec}`` is a hash of the operator's spec (module class and constructor arguments, the
cell's graph, the tensor's declaration), so an edit that changes the operator's weights'
shape never aliases the old weights.

Example::

    >>> ops = weight_keys(space, space.replay(sample))
    >>> ops["layers.2.choice_3.branch.0.0"].key
    'block3[block3=choice_3]/layers.2.choice_3.branch.0.0@5f0c...'
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Any

import torch

from ..codec import decode, encode, evaluate_choice, find_tags, map_tags
from ..graph import Node
from ..modspec import build_module
from ..space import Model
from .plan import cell_is_pure, module_facts

__all__ = ["OpKey", "SuperGraphError", "weight_keys"]

_MAKING = ("create_node", "replace", "splice", "materialize")
_VALUE_MUTATOR = "valuechoices"  # the label of every compiled ValueChoice mutator
_MAX_COMBINATIONS = 4096  # candidate value combinations of one node read to find its shapes


class SuperGraphError(ValueError):
    """A model or request the super-graph cannot serve (a sample of another space, an
    operator whose candidates differ in a way weights cannot be shared across)."""


@dataclass(frozen=True)
class OpKey:
    """One operator of a model, as the super-graph sees it.

    ``mode`` says how the model's operator uses the pooled weights: ``"same"`` (the pooled
    module itself), ``"rebind"`` (the model's own module, holding the pooled tensors: value
    candidates that change no shape, e.g. a stride) or ``"slice"`` (the leading slice of the
    largest candidate's weights).
    """

    key: str
    attr: str  # the operator's attribute path in the model
    name: str  # a node calling it (for messages)
    kind: str  # "module" | "cell" | "param"
    mode: str  # "same" | "rebind" | "slice"
    recipe: dict  # JSON: how to build the pooled operator (see SuperGraph.state_dict)
    frozen: bool  # holds the base model's frozen values (no grad)


def _hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def _making_records(model: Model) -> dict[int, list[int]]:
    """uid -> indices of the history records that created it or changed its operation."""
    out: dict[int, list[int]] = {}
    for i, rec in enumerate(model.history):
        if rec["primitive"] in ("create_node", "replace", "materialize"):
            out.setdefault(rec["node"], []).append(i)
        elif rec["primitive"] == "splice":
            for uid in rec["nodes"]:
                out.setdefault(uid, []).append(i)
    return out


def _own_choices(history: list, index: int) -> list:
    """The choices the mutator of record ``index`` made for that edit: its ``choose`` records
    right before it, back to its previous edit."""
    mutator, out = history[index]["mutator"], []
    for rec in reversed(history[:index]):
        if rec["mutator"] != mutator or rec["primitive"] != "choose":
            break
        out.append([rec["label"], rec["chosen"]])
    return out[::-1]


def _origin(model: Model, records: list[int]) -> str:
    """Where a node's operator comes from: the base model, or the last edit (and the choices
    of its mutator) before the ValueChoices were written in or lazy sizes settled (those are
    in the key's spec or template)."""
    records = [i for i in records if not _is_value_record(model.history[i])
               and model.history[i]["primitive"] != "materialize"]
    if not records:
        return f"base{model.base}"
    rec = model.history[records[-1]]
    choices = ",".join(f"{label}={value}" for label, value in
                       _own_choices(model.history, records[-1]))
    return f"{rec['mutator']}[{choices}]"


def _is_value_record(rec: dict) -> bool:
    return rec["mutator"] == _VALUE_MUTATOR and rec["primitive"] == "replace" \
        and "template" in rec


def _weighted(node: Node) -> bool:
    """Whether the node holds weights or state that the super-graph shares."""
    spec = node.op.spec or {}
    if node.kind == "module":
        params, persistent, _ = module_facts(json.dumps(spec, sort_keys=True))
        return params or persistent
    if node.kind == "subgraph":
        return not cell_is_pure(node.op.graph)
    if node.kind == "param":
        return not spec.get("buffer") or spec.get("persistent", True)
    return False


def _recipe(node: Node) -> tuple[str, dict]:
    if node.kind == "module":
        return "module", {"spec": node.op.spec}
    if node.kind == "subgraph":
        return "cell", {"graph": node.op.graph.to_data()}
    return "param", {"spec": node.op.spec}


def _spec_data(node: Node) -> Any:
    if node.kind == "subgraph":
        return node.op.graph.structural_hash()
    return node.op.spec


def weight_keys(space: Any, model: Model) -> dict[str, OpKey]:
    """attr -> :class:`OpKey` of every operator of ``model`` (one of ``space``'s); see the
    module docstring for the key.

    Raises:
        SuperGraphError: a ValueChoice changes the shape of an operator's weights in a way
            that cannot be shared (only widths and kernel sizes of Conv2d, Linear and
            BatchNorm1d/2d can, by slicing).
    """
    making = _making_records(model)
    frozen = set(space.frozen_nodes(model))
    out: dict[str, OpKey] = {}
    for node in model.graph.nodes:
        if node.kind not in ("module", "subgraph", "param") or node.attr in out:
            continue
        if not _weighted(node):
            continue
        records = making.get(node.uid, [])
        kind, recipe = _recipe(node)
        mode = "same"
        last = model.history[records[-1]] if records else None
        if last is not None and _is_value_record(last):
            key = f"{_origin(model, records)}/{node.attr}~{_hash(last['template'])}"
            mode, recipe = _family(node, last["template"])
        else:
            key = f"{_origin(model, records)}/{node.attr}@{_hash(_spec_data(node))}"
        out[node.attr] = OpKey(key, node.attr, node.name, kind, mode, recipe,
                               node.uid in frozen)
    # parameters read directly inside a keyed module belong to it
    return {a: k for a, k in out.items()
            if not (k.kind == "param" and any(a.startswith(o + ".") for o in out if o != a))}


# ---- ValueChoice families --------------------------------------------------------------------


def _labels(template: Any) -> dict[str, list]:
    """label -> encoded values of every ValueChoice in ``template`` (expressions walked)."""
    out: dict[str, list] = {}

    def visit(p):
        if "op" in p:
            for a in p["args"]:
                if isinstance(a, dict) and "__choice__" in a:
                    visit(a["__choice__"])
        else:
            out.setdefault(p["label"], p["values"])

    for payload in find_tags(template, "__choice__"):
        visit(payload)
    return out


def _candidates(template: dict) -> list[dict]:
    """Every concrete spec of a tagged module op (one per combination of its choices)."""
    labels = _labels(template)
    values = [[decode(v) for v in vs] for vs in labels.values()]
    combos = list(itertools.islice(itertools.product(*values), _MAX_COMBINATIONS + 1))
    out = []
    for combo in combos[:_MAX_COMBINATIONS]:
        chosen = dict(zip(labels, combo))
        out.append(map_tags(template["spec"], "__choice__",
                            lambda p, c=chosen: encode(evaluate_choice(p, c))))
    return out


@functools.lru_cache(maxsize=1024)
def _shapes(spec_json: str) -> tuple[str, dict, dict]:
    """(class name, {tensor name: shape}, the module's sizing attributes) of a module spec,
    built on the meta device."""
    with torch.device("meta"):
        module = build_module(json.loads(spec_json))
    shapes = {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()}
    attrs = {a: getattr(module, a) for a in _SIZING.get(type(module), ())}
    attrs["bias"] = "bias" in shapes
    return type(module).__name__, shapes, attrs


_SIZING = {
    torch.nn.Conv2d: ("in_channels", "out_channels", "kernel_size", "groups", "padding_mode"),
    torch.nn.Linear: ("in_features", "out_features"),
    torch.nn.BatchNorm1d: ("num_features", "affine", "track_running_stats"),
    torch.nn.BatchNorm2d: ("num_features", "affine", "track_running_stats"),
}
_SLICEABLE = {cls.__name__: cls for cls in _SIZING}


def _family(node: Node, template: dict) -> tuple[str, dict]:
    """How the candidates of a ValueChoice node share weights: (mode, recipe)."""
    if node.kind != "module" or not isinstance(template.get("spec"), dict):
        return "same", _recipe(node)[1]
    labels = sorted(_labels(template.get("spec")))
    if not labels:  # the choices are in the call arguments only: the weights are one
        return "same", {"spec": node.op.spec}
    specs = _candidates(template)
    facts = [_shapes(json.dumps(s, sort_keys=True)) for s in specs]
    classes = {f[0] for f in facts}
    if len({json.dumps(f[1], sort_keys=True) for f in facts}) == 1:
        return "rebind", {"spec": specs[0]}
    where = (f"node {node.name!r}: the candidates of ValueChoice {', '.join(map(repr, labels))} "
             f"give {'/'.join(sorted(classes))} weights of different shapes")
    if len(classes) != 1 or next(iter(classes)) not in _SLICEABLE:
        raise SuperGraphError(
            f"{where}; the super-graph shares weights across sizes only for "
            f"{', '.join(_SLICEABLE)} (by slicing the largest candidate). Make it a "
            f"LayerChoice of separate modules, or keep this size fixed")
    cls = next(iter(classes))
    attrs = [f[2] for f in facts]
    return "slice", {"slice": cls, **_largest(cls, attrs, where)}


def _largest(cls: str, attrs: list[dict], where: str) -> dict:
    """The sizes of the module that holds every candidate as a leading slice."""
    def same(name):
        values = {json.dumps(a[name]) for a in attrs}
        if len(values) > 1:
            raise SuperGraphError(f"{where}, and they also differ in {name} "
                                  f"({sorted(values)}), which slicing cannot share; keep "
                                  f"{name} fixed across the candidates")
        return attrs[0][name]

    if cls == "Linear":
        return {"in": max(a["in_features"] for a in attrs), "bias": same("bias"),
                "out": max(a["out_features"] for a in attrs)}
    if cls.startswith("BatchNorm"):
        return {"num": max(a["num_features"] for a in attrs), "affine": same("affine"),
                "track": same("track_running_stats")}
    same("padding_mode")
    if attrs[0]["padding_mode"] != "zeros":
        raise SuperGraphError(f"{where} with padding_mode={attrs[0]['padding_mode']!r}; "
                              f"sliced convolutions pad with zeros only")
    depthwise = all(a["groups"] == a["in_channels"] == a["out_channels"] for a in attrs)
    if not depthwise:
        same("groups")
    ks = {tuple(a["kernel_size"]) for a in attrs}
    big = (max(k[0] for k in ks), max(k[1] for k in ks))
    if any((big[0] - k[0]) % 2 or (big[1] - k[1]) % 2 for k in ks):
        raise SuperGraphError(f"{where}: kernel sizes {sorted(ks)} cannot all be centred in "
                              f"{big} (they must differ by even numbers)")
    return {"in": max(a["in_channels"] for a in attrs),
            "out": max(a["out_channels"] for a in attrs), "kernel": list(big),
            "bias": same("bias"),
            "groups": "depthwise" if depthwise else attrs[0]["groups"]}
