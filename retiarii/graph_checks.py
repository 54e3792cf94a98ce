"""Checks of graph JSON and of single operations, used by :meth:`Graph.from_data` and
:meth:`Graph.lint` (kept apart from graph.py: they read specs, not the graph's structure)."""
from __future__ import annotations

import json
from typing import Any

import torch

from .codec import decode, port_indices, resolve_ref
from .modspec import build_module

KINDS = ("input", "output", "module", "function", "method", "param", "constant", "subgraph")


class GraphError(ValueError):
    """A graph that breaks an invariant, or JSON that does not describe a graph."""


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_schema(data: dict) -> None:
    """Raise :class:`GraphError` naming the first field of graph JSON with a wrong type, so a
    corrupt file fails on load, not somewhere in lint or codegen."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise GraphError(f"malformed graph JSON: {what}")

    need(isinstance(data.get("nodes"), list), '"nodes" must be a list')
    need(isinstance(data.get("edges"), list), '"edges" must be a list')
    need(is_int(data.get("next_uid", 0)), '"next_uid" must be an integer')
    meta = data.get("meta", {})
    need(isinstance(meta, dict), '"meta" must be an object')
    modules = meta.get("modules", [])
    need(isinstance(modules, list) and all(isinstance(m, str) for m in modules),
         '"meta.modules" must be a list of module paths')
    for i, nd in enumerate(data["nodes"]):
        need(isinstance(nd, dict), f"node #{i} must be an object")
        where = f"node #{i} ({nd.get('name')!r})"
        need(is_int(nd.get("uid")), f'{where}: "uid" must be an integer')
        need(isinstance(nd.get("name"), str) and nd["name"] != "",
             f'{where}: "name" must be a non-empty string')
        need(isinstance(nd.get("meta", {}), dict), f'{where}: "meta" must be an object')
        op = nd.get("op")
        need(isinstance(op, dict), f'{where}: "op" must be an object')
        need(op.get("kind") in KINDS, f'{where}: op "kind" must be one of {KINDS}, '
                                      f'not {op.get("kind")!r}')
        for key, typ in (("target", str), ("attr", str), ("spec", dict), ("graph", dict)):
            need(op.get(key) is None or isinstance(op[key], typ),
                 f'{where}: op "{key}" must be {typ.__name__} or absent')
        need(isinstance(op.get("args", []), list), f'{where}: op "args" must be a list')
        need(isinstance(op.get("kwargs", {}), dict), f'{where}: op "kwargs" must be an object')
        ports = port_indices([op.get("args", []), op.get("kwargs", {})])
        need(all(is_int(p) and p >= 0 for p in ports),
             f'{where}: every {{"__in__": port}} must name a port number >= 0')
    for j, edge in enumerate(data["edges"]):
        need(isinstance(edge, list) and len(edge) == 3 and all(is_int(x) for x in edge)
             and edge[2] >= 0, f"edge #{j} must be [source uid, destination uid, port], "
                               f"not {edge!r}")


def check_op(node: Any, where: str, deep: bool) -> list[str]:
    op = node.op
    problems = []
    try:
        if op.kind == "function":
            fn = resolve_ref(op.target)
            if not callable(fn):
                problems.append(f"{where}: target {op.target!r} is not callable")
        elif op.kind == "module":
            if not op.spec or "cls" not in op.spec:
                problems.append(f"{where}: a module operation needs a spec with 'cls'")
            else:
                resolve_ref(op.spec["cls"])
                if deep:
                    check_constructible(op.spec)
        elif op.kind == "method" and not isinstance(op.target, str):
            problems.append(f"{where}: a method operation needs the method name as target")
        elif op.kind == "method" and not (op.args and isinstance(op.args[0], dict)
                                          and set(op.args[0]) == {"__in__"}):
            problems.append(f"{where}: a method's first argument (the object it is called on) "
                            f"must be an input port")
        elif op.kind == "subgraph":
            if op.graph is None:
                problems.append(f"{where}: a subgraph operation holds no graph")
            else:
                op.graph.lint(deep)
        elif op.kind in ("param", "constant") and not op.spec:
            problems.append(f"{where}: needs a spec (shape, dtype or value)")
        elif op.kind in ("param", "constant"):
            check_tensor_spec(op.kind, op.spec)
        elif op.kind == "input" and op.spec:
            decode(op.spec.get("default"))
        if port_indices(op.spec):
            problems.append(f"{where}: its spec refers to an input port ({{\"__in__\": ...}})")
        decode(op.args)
        for value in op.kwargs.values():
            decode(value)
    except GraphError as e:
        problems.append(f"{where}: subgraph: {e}")
    except Exception as e:  # noqa: BLE001 - report any failure to re-create as a lint problem
        problems.append(f"{where}: not re-creatable: {type(e).__name__}: {e}")
    return problems


def check_tensor_spec(kind: str, spec: dict) -> None:
    """Raise if a param/constant spec cannot give its tensor (what codegen will build)."""
    if kind == "constant":
        if not isinstance(decode(spec["value"]), torch.Tensor):
            raise ValueError("the constant's value is not a tensor")
        return
    dtype = getattr(torch, spec["dtype"])
    if not isinstance(dtype, torch.dtype) or not isinstance(spec["shape"], list) \
            or not all(is_int(d) and d >= 0 for d in spec["shape"]):
        raise ValueError(f"bad shape {spec['shape']!r} or dtype {spec['dtype']!r}")
    for flag in ("buffer", "requires_grad", "persistent"):
        if not isinstance(spec[flag] if flag == "buffer" else spec.get(flag, False), bool):
            raise ValueError(f"{flag!r} must be true or false")
    if "init" in spec:
        init = decode(spec["init"])
        if not isinstance(init, torch.Tensor) or list(init.shape) != spec["shape"] \
                or init.dtype != dtype:
            raise ValueError("the initial value does not match the shape and dtype")


def check_owned_tensor(node: Any, owner: Any, name: str) -> list[str]:
    """A param node inside a module's path must name a tensor of that module, same shape."""
    try:
        with torch.device("meta"):
            module = build_module(owner.op.spec)
    except Exception:  # noqa: BLE001 - the owner's own check reports it
        return []
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    where = f"node {node.name!r} (param)"
    if name not in tensors:
        return [f"{where}: the module {owner.name!r} has no parameter or buffer {name!r}"]
    if list(tensors[name].shape) != node.op.spec.get("shape"):
        return [f"{where}: shape {node.op.spec.get('shape')} differs from {name!r} of the "
                f"module {owner.name!r}: {list(tensors[name].shape)}"]
    return []


_CONSTRUCTIBLE: set[str] = set()


def check_constructible(spec: dict) -> None:
    key = json.dumps(spec, sort_keys=True)
    if key in _CONSTRUCTIBLE:
        return
    with torch.device("meta"):
        build_module(spec)
    _CONSTRUCTIBLE.add(key)

