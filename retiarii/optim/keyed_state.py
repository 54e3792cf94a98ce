"""An optimizer's state by parameter *name* instead of position.

``torch.optim.Optimizer.state_dict()`` numbers parameters by their position in the param
groups, so it loads only into an optimizer over the same parameters in the same order. A
super-graph split over devices (:mod:`retiarii.optim.split`) gives each rank a different part
of the pool, and the part changes as training goes: its state must travel per weight. Here a
state is keyed by the super-graph's parameter names (``"{weight key}:{name}"``, the same on every
rank, :meth:`~retiarii.optim.supergraph.SuperGraph.named_parameters`):

* :func:`keyed_optimizer_state` saves ``{"format": "keyed", "param_groups": [...], "state":
  {name: {...}}}``: each group's hyper-parameters and its members' names, each parameter's state;
* :func:`load_keyed_optimizer_state` loads it into an optimizer over any subset of those
  parameters (each moved into the group the state names; names it lacks are skipped);
* :func:`forget_parameters` takes parameters out of an optimizer (groups and state), for a
  rank that hands a weight on.

Example::

    names = dict(sg.named_parameters())
    saved = keyed_optimizer_state(opt, names)
    load_keyed_optimizer_state(other_opt, dict(other_sg.named_parameters()), saved)
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

__all__ = ["FORMAT", "forget_parameters", "is_keyed", "keyed_optimizer_state",
           "load_keyed_optimizer_state", "param_state_to"]

FORMAT = "keyed"


def is_keyed(state: Any) -> bool:
    """Whether ``state`` is a keyed optimizer state (else torch's positional one)."""
    return isinstance(state, dict) and state.get("format") == FORMAT


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def keyed_optimizer_state(optimizer: torch.optim.Optimizer,
                          params: Mapping[str, torch.nn.Parameter]) -> dict:
    """``optimizer``'s groups and per-parameter state by the names of ``params`` (copies).

    Raises:
        ValueError: the optimizer holds a parameter that ``params`` does not name.
    """
    name_of = {id(p): n for n, p in params.items()}
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        members = []
        for p in group["params"]:
            if id(p) not in name_of:
                raise ValueError(f"optimizer group {i} holds a parameter of shape "
                                 f"{tuple(p.shape)} that is not one of the named parameters; "
                                 "pass every parameter the optimizer trains")
            members.append(name_of[id(p)])
        groups.append({**{k: _clone(v) for k, v in group.items() if k != "params"},
                       "params": members})
    state = {name_of[id(p)]: {k: _clone(v) for k, v in s.items()}
             for p, s in optimizer.state.items() if id(p) in name_of and s}
    return {"format": FORMAT, "param_groups": groups, "state": state}


def param_state_to(param: torch.nn.Parameter, state: Mapping[str, Any]) -> dict:
    """One parameter's saved state made ready for it, as torch's own loading does: floating
    tensors to the parameter's device and dtype, ``step`` left where it is (a CPU scalar
    unless the optimizer is capturable or fused), other tensors to its device."""
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            if key == "step":
                value = value.clone()
            elif value.is_floating_point():
                value = value.to(device=param.device, dtype=param.dtype, copy=True)
            else:
                value = value.to(device=param.device, copy=True)
        out[key] = value
    return out


def load_keyed_optimizer_state(optimizer: torch.optim.Optimizer,
                               params: Mapping[str, torch.nn.Parameter], saved: dict,
                               names: Iterable[str] | None = None) -> None:
    """Load a :func:`keyed_optimizer_state` into ``optimizer`` over ``params``.

    Group hyper-parameters are set from the saved groups (the optimizer must have as many
    groups); each parameter of ``names`` (default: every saved name ``params`` has) moves into
    the group the state lists it in and gets its saved state (none saved: the state is
    cleared, as a parameter never stepped). Parameters the state does not name keep their
    group and state.

    Raises:
        ValueError: not a keyed state, or another number of groups.
    """
    if not is_keyed(saved):
        raise ValueError("not a keyed optimizer state (keyed_optimizer_state makes one)")
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"the saved optimizer state has {len(saved['param_groups'])} parameter "
                         f"groups, this optimizer {len(optimizer.param_groups)}: build it the "
                         "same way (the trainer's configure_optimizers)")
    group_of = {n: g for g, group in enumerate(saved["param_groups"]) for n in group["params"]}
    for group, have in zip(optimizer.param_groups, saved["param_groups"]):
        for k, v in have.items():
            if k != "params":
                group[k] = _clone(v)
    wanted = [n for n in (group_of if names is None else names) if n in params and n in group_of]
    moving = {id(params[n]): group_of[n] for n in wanted}
    for g, group in enumerate(optimizer.param_groups):
        group["params"] = [p for p in group["params"]
                           if id(p) not in moving or moving[id(p)] == g]
    for n in wanted:
        p, g = params[n], group_of[n]
        members = optimizer.param_groups[g]["params"]
        if not any(q is p for q in members):
            members.append(p)
        state = saved["state"].get(n)
        if state:
            optimizer.state[p] = param_state_to(p, state)
        else:
            optimizer.state.pop(p, None)


def forget_parameters(optimizer: torch.optim.Optimizer,
                      params: Iterable[torch.nn.Parameter]) -> None:
    """Take ``params`` out of every group of ``optimizer`` and drop their state."""
    gone = {id(p) for p in params}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in gone]
    for p in [p for p in optimizer.state if id(p) in gone]:
        del optimizer.state[p]
