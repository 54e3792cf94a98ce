"""Which models may fuse, read from the IR: :func:`fusion_key` (one architecture) and
:func:`fusion_family` (one architecture up to its weightless activations and the places
where mutations put other operators).

Example::

    fusion_family(relu_model) == fusion_family(gelu_model)   # True: they may fuse
    fusable_groups({"a": m1, "b": m1_other_seed, "c": m2})   # [("a", "b"), ("c",)]
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping

from torch import nn

from ..space import Model

__all__ = ["fusable_groups", "fusion_family", "fusion_key"]

# the IR's spelling of the weightless activations (a module spec's "cls"): what may differ
# between models of one fusion family
_POINTWISE_SPECS = frozenset(f"{c.__module__}:{c.__name__}" for c in (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.ELU, nn.Tanh, nn.Sigmoid,
    nn.Hardswish, nn.Hardsigmoid, nn.Mish, nn.Softplus, nn.Identity))


def fusion_key(model: Model) -> str:
    """Models with equal keys have the same architecture (the IR's structural hash: every
    operation with its module spec, so every layer's shape) and the same parameter names (so
    the same state-dict layout): they may fuse."""
    attrs = [n.attr for n in model.graph.nodes if n.kind in ("module", "param", "subgraph")]
    payload = model.graph.structural_hash() + "|" + ",".join(attrs)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def fusion_family(model: Model, places: bool = True) -> str:
    """Models with equal families may fuse: :func:`fusion_key` except that

    - a weightless element-wise layer (an activation module: ``nn.ReLU``, ``nn.GELU``,
      ``nn.Tanh``, ...) may differ between them, as the models of a space choosing
      activations do: each distinct activation then runs on the slices of the models holding
      it (:class:`~.fused_ops.PerModelPointwise`);
    - the nodes a mutation replaced or created (read from the history: ``Model.changed_ops``,
      ``Model.created``) may differ: each connected region of them counts as "a place" known
      by the values it reads, whatever it holds (a 3x3 convolution, a 5x5 one, a
      depthwise-separable block, a Linear of another width). Each model then runs its own
      layers there (:mod:`.fused_segments`), and the rest, the same in every model, fuses.

    Every node outside the places keeps its operation (every layer's shape) and inputs, and
    its parameter names. Whether the places give values of one shape is checked on the
    modules when fusing (``segments_fit``). ``places=False``: activations only (a device
    where models differing at places never fuse: no tracing is spent on finding them).
    """
    mutated = (model.changed_ops() | model.created()) if places else set()
    boundary: dict[int, frozenset] = {}  # a mutated node -> the outside values its place reads

    def pointwise(op: dict) -> bool:
        return (op.get("spec") or {}).get("cls") in _POINTWISE_SPECS

    def view(node, op: dict) -> dict:
        if node.uid in mutated and node.kind not in ("input", "output"):
            return {"kind": "place"}  # what it holds may differ: see chain
        return {**op, "spec": "pointwise"} if pointwise(op) else op  # which may differ

    def place(uid: int) -> str:  # a place as read from outside: by the values it reads
        inside = sorted(x for x in boundary[uid] if x is not None)
        return hashlib.sha256(("place|" + ",".join(inside)).encode()).hexdigest()

    def chain(node, ins: list) -> list:
        if node.uid not in mutated or node.kind in ("input", "output"):
            return [place(i.uid) if i is not None and i.uid in boundary else h
                    for i, h in zip(node.inputs, ins)]
        seen: set = set()
        for i, h in zip(node.inputs, ins):
            seen |= boundary[i.uid] if i is not None and i.uid in boundary else {h}
        boundary[node.uid] = frozenset(seen)
        return []  # what the place holds is not hashed: only how it is read

    hashes = model.graph.node_hashes(view, chain)
    rest = [h for uid, h in hashes.items() if uid not in boundary]
    attrs = [n.attr for n in model.graph.nodes if n.uid not in boundary and (
        n.kind in ("param", "subgraph") or (n.kind == "module" and not pointwise(
            n.op.to_data(with_names=False))))]
    payload = "".join(sorted(rest)) + "|" + ",".join(attrs)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def fusable_groups(models: Mapping[str, Model]) -> list[tuple[str, ...]]:
    """The trials that may fuse (equal :func:`fusion_key`), in the given order; a trial of
    its own kind is a group of one."""
    out: dict[str, list[str]] = {}
    for trial, model in models.items():
        out.setdefault(fusion_key(model), []).append(trial)
    return [tuple(g) for g in out.values()]
