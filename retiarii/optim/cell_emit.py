"""A group's cell graph -> its fx module, calling the modules of the models built alone.

build.py cuts a group into cells (the shared cell, each model's parts, each batched region);
:func:`emit_cell` emits one through codegen and then *adopts* the models' modules: each
module, cell and tensor of the emitted code is replaced by the object at the same node in the
model that holds it, so a model's parameters stay its own objects (its optimizer, its
``state_dict``) and a shared frozen module is one object. A cell whose every module is
adopted reuses the cached code of an equal cell (emit_cache.py); nested submodules are called
by one flat name (``_direct_calls``). :func:`get_path`, :func:`set_path` and
:func:`same_values` read, replace and compare a module, parameter or buffer at a dotted path:
build.py makes a frozen value that several models share one object with them.

Example::

    module = emit_cell(cell, lambda node: (models[trial], node.attr), models_device(models))
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..codegen import to_module
from ..graph import Graph, Node
from . import emit_cache
from .group_module import GroupError

__all__ = ["emit_cell", "get_path", "models_device", "same_values", "set_path"]


def get_path(root: nn.Module, path: str) -> Any:
    """The module, parameter or buffer at the dotted ``path`` of ``root``."""
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def set_path(root: nn.Module, path: str, value: Any) -> None:
    """Point ``path`` of ``root`` at ``value`` (a module, parameter or buffer) in place."""
    *parents, leaf = path.split(".")
    owner = root
    for part in parents:
        owner = owner._modules[part]
    if isinstance(value, nn.Module):
        owner._modules[leaf] = value
    elif leaf in owner._parameters:
        owner._parameters[leaf] = value
    elif leaf in owner._buffers:
        owner._buffers[leaf] = value
    else:
        raise GroupError(f"{path!r} is neither a parameter nor a buffer of the model")


def _state(obj: Any) -> dict[str, torch.Tensor]:
    return obj.state_dict(keep_vars=True) if isinstance(obj, nn.Module) else {"": obj}


def same_values(a: Any, b: Any) -> bool:
    sa, sb = _state(a), _state(b)
    return sa.keys() == sb.keys() and all(
        sa[k].shape == sb[k].shape and sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k])
        for k in sa)


def emit_cell(graph: Graph, adopt: Callable[[Node], tuple[nn.Module, str] | None],
          device: torch.device | None) -> nn.Module:
    """The cell's fx module, its modules and tensors then replaced by the adopted ones
    (``adopt(node) -> (model, attr)``, None: keep the emitted one, e.g. a constant), and
    what it keeps moved to ``device``, the models' (None: leave it where it was made)."""
    owners = {n.attr for n in graph.nodes if n.kind in ("module", "subgraph")}
    sources = []
    for node in graph.nodes:
        if node.kind not in ("module", "subgraph", "param"):
            continue
        parts = node.attr.split(".")
        if node.kind == "param" and any(".".join(parts[:i]) in owners
                                        for i in range(1, len(parts))):
            continue  # a tensor of an adopted module: adopted with it
        sources.append((node.attr, adopt(node)))
    # Everything adopted: the cached code of an equal cell serves (emit_cache.py).
    key, module = emit_cache.lookup(graph) \
        if all(source is not None for _, source in sources) else (None, None)
    fresh = module is None
    if fresh:
        with torch.random.fork_rng(devices=[]):  # fresh weights: not in any trial's stream
            module = to_module(graph, "Cell")
    for attr, source in sources:
        if source is not None:
            set_path(module, attr, get_path(*source))
    if device is not None:  # only the kept tensors (constants) are elsewhere: made on the CPU
        for owner in module.modules():
            for name, buffer in owner._buffers.items():
                if buffer is not None and buffer.device != device:
                    owner._buffers[name] = buffer.to(device)
    _direct_calls(module)
    if fresh and key is not None:
        emit_cache.keep(key, module, graph)
    return module


def _direct_calls(module: nn.Module) -> None:
    """Let each fx module of the cell call its submodules by one flat name.

    fx's code reaches a submodule ``backbone.layers.5.body.0.0`` by one lookup per part, each
    a ``Module.__getattr__`` (six per call; about a hundred per call of a batched region of
    MobileNetV2 blocks). Each called submodule whose target has a dot is also put in the fx
    module's instance dict under a flat name (found by plain attribute lookup, before
    ``__getattr__``) and called by it. Not registered: the hierarchy alone holds the modules
    for ``modules()``, ``state_dict()`` and ``.to()``, which move tensors, never modules, so
    the flat names keep pointing at the right objects."""
    for gm in [m for m in module.modules() if isinstance(m, torch.fx.GraphModule)]:
        # A copy of a cached cell (emit_cache.py) has its code already flat: point its flat
        # names at its own submodules, kept by name here.
        called = gm.__dict__.setdefault("_flat_calls", {})  # flat name -> target
        for name, target in called.items():
            gm.__dict__[name] = gm.get_submodule(target)
        flat: dict[str, str] = {}  # target -> its flat name
        for node in gm.graph.nodes:
            if node.op != "call_module" or "." not in node.target:
                continue
            if node.target not in flat:
                name = "_call_" + node.target.replace(".", "_")
                while hasattr(gm, name):  # taken (by another target's flat name): another
                    name += "_"
                gm.__dict__[name] = gm.get_submodule(node.target)
                flat[node.target], called[name] = name, node.target
            node.target = flat[node.target]
        if flat:
            gm.recompile()


def models_device(models: Mapping[str, nn.Module]) -> torch.device | None:
    """Where the models live (a model trains on one device), or None when they hold no
    tensor."""
    for model in models.values():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            return tensor.device
    return None
