"""Which models may fuse, read from the IR: :func:`fusion_key` (one architecture) and
:func:`fusion_family` (one architecture up to its weightless activations).

Example::

    fusion_family(relu_model) == fusion_family(gelu_model)   # True: they may fuse
    fusable_groups({"a": m1, "b": m1_other_seed, "c": m2})   # [("a", "b"), ("c",)]
"""
from __future__ import annotations

import hashlib
import json
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


def fusion_family(model: Model) -> str:
    """Models with equal families may fuse: :func:`fusion_key` except that a weightless
    element-wise layer (an activation module: ``nn.ReLU``, ``nn.GELU``, ``nn.Tanh``, ...) may
    differ between them, as the models of a space choosing activations do. Their layers with
    weights are then one fused call each, and each distinct activation runs on the slices
    of the models holding it (:class:`~.fused_ops.PerModelPointwise`)."""
    hashes: dict[int, str] = {}
    attrs: list[str] = []
    seen: set[str] = set()
    for node in model.graph.nodes:
        op = node.op.to_data(with_names=False)
        if node.kind == "subgraph":
            op["graph"] = node.op.graph.structural_hash()
        if node.kind == "module":
            op["reuses_module"] = node.attr in seen
            seen.add(node.attr)
            if (op.get("spec") or {}).get("cls") in _POINTWISE_SPECS:
                op["spec"] = "pointwise"  # which one may differ between the models
            else:
                attrs.append(node.attr)
        elif node.kind in ("param", "subgraph"):
            attrs.append(node.attr)
        if node.kind == "input":
            op.pop("target", None)
            op["position"] = [n.uid for n in model.graph.input_nodes].index(node.uid)
        ins = [hashes[i.uid] if i is not None else None for i in node.inputs]
        hashes[node.uid] = hashlib.sha256(json.dumps([op, ins], sort_keys=True).encode()).hexdigest()
    payload = "".join(sorted(hashes.values())) + "|" + ",".join(attrs)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def fusable_groups(models: Mapping[str, Model]) -> list[tuple[str, ...]]:
    """The trials that may fuse (equal :func:`fusion_key`), in the given order; a trial of
    its own kind is a group of one."""
    out: dict[str, list[str]] = {}
    for trial, model in models.items():
        out.setdefault(fusion_key(model), []).append(trial)
    return [tuple(g) for g in out.values()]
