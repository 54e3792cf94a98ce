"""Weight inheritance: a child model starts from its parent's trained tensors where their shapes match.

Large-Scale Evolution (Real et al., ICML 2017) trains each child from its parent's weights: the
layers whose shapes the mutation left unchanged keep their trained weights, a changed layer
starts afresh. A strategy asks for it by a true ``inherit_weights`` attribute
(``RegularizedEvolution(inherit=True)``) and names each child's parent (``parent_of``); the
driver puts the parent trial's latest checkpoint name in the child's spec (``"inherit"``,
journaled with the trial, so a crash or a resume starts it from the same file), the trial starts
its first segment from that file (``Trial.resume_point``), and the worker builds the child as
usual (its own seed, so fresh layers are what a fresh trial would have) and copies in, by name,
every layer of the parent's checkpoint whose tensors all fit the child's (:func:`inherit_matching`).
A module of the child that knows how it derives from its parent's (a method
``inherit_state(parent_state) -> bool``, the parent's tensors under its name) takes them itself:
path-level NAS's cells (model_spaces/path_level.py) map them through their function-preserving
transformations, where names and shapes differ.
Optimizer moments, the RNG streams and the step are the child's own: it trains for its full
budget from step 0, as the paper's children do.

Example::

    kept, fresh = inherit_matching(child, torch.load("parent.pt")["model"])
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..storage import checkpoint as ckpt


def _layer(name: str) -> str:
    return name.rpartition(".")[0]  # "lse_0_conv.weight" -> "lse_0_conv"


def inherit_matching(model: nn.Module, parent: dict[str, torch.Tensor]
                     ) -> tuple[list[str], list[str]]:
    """Copy into ``model`` the tensors of every layer of ``parent`` (a state dict) whose
    tensors all have the model's names and shapes (a layer: the entries under one module
    name); returns the names copied and those left as they were, in the model's order.

    A conv whose kernel changed keeps none of its tensors, not even its bias of unchanged
    shape: it is a changed layer, which the paper trains afresh.

    Example:
        >>> child = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 4))
        >>> parent = nn.Sequential(nn.Linear(2, 3), nn.Linear(5, 4)).state_dict()
        >>> inherit_matching(child, parent)
        (['0.weight', '0.bias'], ['1.weight', '1.bias'])
    """
    own = model.state_dict()
    taken: dict[str, bool] = {}  # names under a module that inherits itself -> whether it did
    for prefix, module in model.named_modules():
        if prefix and callable(getattr(module, "inherit_state", None)):
            inside = {k[len(prefix) + 1:]: v for k, v in parent.items()
                      if k.startswith(prefix + ".")}
            ok = bool(inside) and bool(module.inherit_state(inside))
            taken.update({name: ok for name in own if name.startswith(prefix + ".")})
    fits: dict[str, bool] = {}
    for name, t in own.items():
        if name in taken:
            continue
        ok = name in parent and tuple(parent[name].shape) == tuple(t.shape)
        fits[_layer(name)] = fits.get(_layer(name), True) and ok
    kept = [name for name in own if taken.get(name, fits.get(_layer(name)))]
    fresh = [name for name in own if name not in set(kept)]
    with torch.no_grad():
        for name in kept:
            if name not in taken:  # (the module copied its own)
                own[name].copy_(parent[name])  # state_dict tensors share the model's storage
    return kept, fresh


def inherit_from(run: Any, path: str) -> tuple[list[str], list[str]]:
    """Start ``run`` (a fresh :class:`~.trial_training.TrialRun`) from the tensors of the
    checkpoint at ``path`` that fit its model (:func:`inherit_matching`).

    Raises:
        CheckpointError: the file is not a readable trial checkpoint (the donor is gone or
            corrupt: the runner reports it as the environment's fault, as for PBT's donors).
    """
    state = ckpt.load(path, map_location="cpu")  # names the file when it cannot
    try:
        parent = dict(state["model"])
    except (KeyError, TypeError, ValueError) as err:
        raise ckpt.CheckpointError(f"the parent checkpoint {path} that trial {run.trial_id} "
                                   f"inherits from cannot be read: {err}") from err
    return inherit_matching(run.model, parent)
