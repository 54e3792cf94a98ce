"""Fused optimizers: each model's own optimizer and hyper-parameters, stepped on the stacked
parameters of a :class:`~retiarii.optim.fusion.FusedModel`.

Each model keeps its own ``torch.optim`` optimizer (what ``configure_optimizers`` made for it
alone); it becomes a *proxy*: :class:`FusedOptimizer` never calls its ``step`` but, at every
step, reads every hyper-parameter from its ``param_groups`` (so LR schedulers attached to the
proxies, warm-up, cosine, PBT's changes, drive model k's rate) and applies model k's update
to slice k of the stacked parameters, with per-model vectors ``(K, 1, ...)`` of lr, weight
decay, momentum, betas, eps. The state (momentum buffers, Adam's moments and steps) is
stacked too, and each proxy's ``state`` holds views of its slice, so ``optimizers[k].
state_dict()`` is, live, the layout torch.optim has when model k trains alone.

Supported: ``SGD`` (momentum, dampening, weight decay, Nesterov), ``Adam`` and ``AdamW``
(weight decay, any betas and eps), each per model, following torch.optim's single-tensor
update expression by expression. Other optimizers, ``maximize``, ``amsgrad`` and
``differentiable`` raise :class:`~retiarii.optim.fusion.FusionError` naming the fallback:
train those models separately.

Example::

    fused = fuse_models(models)
    opt = FusedOptimizer(fused, [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in ...])
    loss.backward(); opt.step(); opt.zero_grad()
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch

from .fusion import FusedModel, FusionError

__all__ = ["FusedOptimizer", "unfuse"]

_KINDS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}


def _kind(optimizers: Sequence[torch.optim.Optimizer]) -> str:
    kinds = {type(o) for o in optimizers}
    if len(kinds) != 1 or next(iter(kinds)) not in _KINDS:
        names = sorted(k.__name__ for k in kinds)
        raise FusionError(f"fused training supports SGD, Adam and AdamW, one kind for every "
                          f"model; got {names}: train these models separately (unfused)")
    for opt in optimizers:
        for group in opt.param_groups:
            for flag in ("maximize", "amsgrad", "differentiable"):
                if group.get(flag):
                    raise FusionError(f"fused {type(opt).__name__} does not support {flag}="
                                      f"True: train these models separately (unfused)")
    return _KINDS[next(iter(kinds))]


class FusedOptimizer:
    """K models' optimizers as one, on a fused model's stacked parameters (see the module
    docstring).

    Args:
        fused: the :class:`FusedModel` of the K models.
        optimizers: model k's own optimizer over ``fused.models[k].parameters()``, made before
            or after fusing (its parameters are the same objects), its state possibly loaded
            from model k's checkpoint before fusing (it is stacked here).

    Raises:
        FusionError: an unsupported optimizer or option, or an optimizer that does not hold
            exactly its model's trainable parameters.
    """

    def __init__(self, fused: FusedModel, optimizers: Sequence[torch.optim.Optimizer]):
        self.fused, self.optimizers = fused, list(optimizers)
        if len(self.optimizers) != fused.k:
            raise FusionError(f"{len(self.optimizers)} optimizers for {fused.k} fused models")
        self.kind = _kind(self.optimizers)
        # (stacked parameter, per model: the param_group holding its slice)
        self.params: list[tuple[torch.nn.Parameter, list[dict]]] = []
        self._slices: list[list[torch.nn.Parameter]] = []
        # per stacked parameter, the models its slices are (all K, or those of a place where
        # the models differ: fused_segments.py); slice i is model members[i]'s
        self._members: list[list[int]] = []
        owners = []
        for opt in self.optimizers:
            owners.append({id(p): g for g in opt.param_groups for p in g["params"]})
        every = list(range(fused.k))
        for stacked, slices, members in [(p, s, every) for p, s in fused.slices] + list(
                getattr(fused, "partial_slices", [])):
            if not stacked.requires_grad:
                continue
            groups = [owners[k].get(id(p)) for k, p in zip(members, slices)]
            if any(g is None for g in groups):
                k = members[groups.index(None)]
                raise FusionError(f"optimizer {k} does not hold a trainable parameter of model "
                                  f"{k} ({tuple(slices[groups.index(None)].shape)}); fused "
                                  f"training updates every trainable parameter of each model: "
                                  f"train these separately")
            self.params.append((stacked, groups))
            self._slices.append(slices)
            self._members.append(list(members))
        held = sum(1 for opt in self.optimizers for g in opt.param_groups for p in g["params"]
                   if p.requires_grad)  # a frozen parameter in an optimizer never steps
        if held != sum(len(m) for m in self._members):
            raise FusionError("an optimizer holds parameters that are not its fused model's; "
                              "train these models separately (unfused)")
        self.state: list[dict[str, Any]] = []
        self._vectors: dict[tuple, torch.Tensor] = {}
        self._restack()

    # ---- state -------------------------------------------------------------------------------

    def _restack(self) -> None:
        """Stack the proxies' state (fresh or loaded) and point each proxy at its slice."""
        self.state = []
        for (stacked, _), slices, members in zip(self.params, self._slices, self._members):
            per = [self.optimizers[k].state.get(p, {}) for k, p in zip(members, slices)]
            entry: dict[str, Any] = {}
            if self.kind == "sgd":
                entry["has"] = [s.get("momentum_buffer") is not None for s in per]
                buf = torch.zeros_like(stacked)
                for k, s in enumerate(per):
                    if entry["has"][k]:
                        buf[k].copy_(s["momentum_buffer"])
                entry["momentum_buffer"] = buf
            else:
                entry["steps"] = [int(float(s["step"])) if "step" in s else 0 for s in per]
                entry["step"] = torch.tensor(entry["steps"], dtype=torch.float32)
                for name in ("exp_avg", "exp_avg_sq"):
                    value = torch.zeros_like(stacked, memory_format=torch.contiguous_format)
                    for k, s in enumerate(per):
                        if name in s:
                            value[k].copy_(s[name])
                    entry[name] = value
            self.state.append(entry)
            self._expose(entry, slices, members)

    def _expose(self, entry: dict[str, Any], slices: list[torch.nn.Parameter],
                members: list[int]) -> None:
        """Each proxy's state for its slice: views of the stacked state, keys in torch.optim's
        order, only once the model has stepped (as torch.optim keeps no state before)."""
        for k, (m, p) in enumerate(zip(members, slices)):
            opt = self.optimizers[m]
            if self.kind == "sgd":
                if entry["has"][k]:
                    opt.state[p] = {"momentum_buffer": entry["momentum_buffer"][k]}
            elif entry["steps"][k] > 0:
                opt.state[p] = {"step": entry["step"][k], "exp_avg": entry["exp_avg"][k],
                                "exp_avg_sq": entry["exp_avg_sq"][k]}

    def load_state_dict_of(self, k: int, state: dict) -> None:
        """Load model k's optimizer checkpoint (``optimizers[k].state_dict()`` of a run alone
        or fused) into its proxy and the stacked state."""
        self.optimizers[k].load_state_dict(state)
        self._restack()

    def state_dict_of(self, k: int) -> dict:
        """Model k's optimizer state dict, as torch.optim has it alone (values cloned)."""
        return _clone(self.optimizers[k].state_dict())

    # ---- stepping ----------------------------------------------------------------------------

    def _vector(self, values: list[float], like: torch.Tensor) -> torch.Tensor:
        """Per-model values as ``(K, 1, ..., 1)`` broadcasting over ``like`` (cached)."""
        key = (tuple(values), like.dtype, like.device, like.dim())
        vec = self._vectors.get(key)
        if vec is None:
            if len(self._vectors) > 4096:
                self._vectors.clear()
            vec = torch.tensor(values, dtype=like.dtype, device=like.device)
            vec = self._vectors[key] = vec.view(-1, *([1] * (like.dim() - 1)))
        return vec

    def _hp(self, values: list[float], like: torch.Tensor) -> float | torch.Tensor:
        """One float when every model has the same value (torch.optim's own expression then
        runs, with no vector to read), else the per-model vector."""
        first = values[0]
        return first if all(v == first for v in values) else self._vector(values, like)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for stacked, _ in self.params:
            if stacked.grad is not None:
                if set_to_none:
                    stacked.grad = None
                else:
                    stacked.grad.zero_()

    @torch.no_grad()
    def fold_grads(self) -> bool:
        """Add the gradients that reached the models' own parameters into their slices of the
        stacked gradients, and clear them; whether there were any. A loss term that reads a
        model's parameters outside the fused forward (a weight penalty over
        ``model.parameters()``) gives its gradient to model k's parameter, a view of slice k
        that the fused step never reads; the sum is what training model k alone
        accumulates (in another order: rounding differs). Call it after ``backward`` and
        before :meth:`step`.

        Example::

            loss = sum(F.cross_entropy(out[k], y) + 1e-4 * sum(p.pow(2).sum()
                       for p in models[k].parameters()) for k in range(K))
            loss.backward(); opt.fold_grads(); opt.step()
        """
        folded = False
        for (stacked, _), slices in zip(self.params, self._slices):
            for k, p in enumerate(slices):
                if p.grad is None:
                    continue
                if stacked.grad is None:
                    stacked.grad = torch.zeros_like(stacked)
                stacked.grad[k].add_(p.grad)
                p.grad, folded = None, True
        return folded

    @torch.no_grad()
    def step(self) -> None:
        """One step of every model, each with its optimizer's current settings."""
        for (param, groups), entry, slices, members in zip(self.params, self.state, self._slices,
                                                           self._members):
            if param.grad is None:
                continue
            hp = {name: [float(g[name]) for g in groups]
                  for name in ("lr", "weight_decay", "eps", "momentum", "dampening")
                  if name in groups[0]}
            if self.kind == "sgd":
                self._sgd(param, param.grad, groups, hp, entry)
            else:
                self._adam(param, param.grad, groups, hp, entry)
            self._expose(entry, slices, members)
        for opt in self.optimizers:
            # NOTE: the flag torch's LR scheduler wrapper sets when optimizer.step() runs; the
            # proxies never step themselves, so without it every scheduler warns that it was
            # stepped before its optimizer.
            opt._opt_called = True

    def _sgd(self, param, grad, groups, hp, entry) -> None:
        if any(hp["weight_decay"]):  # grad + wd * param, as torch's grad.add(param, alpha=wd)
            grad = grad.add(param * self._vector(hp["weight_decay"], param))
        momentum = hp["momentum"]
        if any(momentum):
            buf, has = entry["momentum_buffer"], entry["has"]
            mom = self._vector(momentum, param)
            if all(has):
                buf.mul_(mom).add_(grad * self._vector([1 - d for d in hp["dampening"]], param))
            else:  # a model's first step: its buffer is a copy of its gradient
                damp = self._vector([1 - d if h else 1.0 for d, h in zip(hp["dampening"], has)],
                                    param)
                new = self._vector([0.0 if h else 1.0 for h in has], param)
                buf.mul_(mom).mul_(1 - new).add_(grad * damp)
            entry["has"] = [h or m != 0 for h, m in zip(has, momentum)]
            nesterov = [bool(g["nesterov"]) for g in groups]
            step = grad.add(buf * mom) if any(nesterov) else buf
            if any(nesterov) and not all(nesterov):
                step = torch.where(self._vector([float(n) for n in nesterov], param) > 0, step,
                                   buf)
            if not all(momentum):  # a model without momentum steps along its gradient
                step = torch.where(mom != 0, step, grad)
            grad = step
        # param - lr * grad, as torch's param.add_(grad, alpha=-lr)
        neg_lr = self._hp([-lr for lr in hp["lr"]], param)
        if isinstance(neg_lr, float):
            param.add_(grad, alpha=neg_lr)
        else:
            param.add_(grad * neg_lr)

    def _adam(self, param, grad, groups, hp, entry) -> None:
        wd = hp["weight_decay"]
        decoupled = [bool(g.get("decoupled_weight_decay", self.kind == "adamw")) for g in groups]
        if any(w and d for w, d in zip(wd, decoupled)):  # AdamW: param * (1 - lr * wd)
            param.mul_(self._vector([1 - lr * w if d else 1.0
                                     for lr, w, d in zip(hp["lr"], wd, decoupled)], param))
        if any(w and not d for w, d in zip(wd, decoupled)):  # Adam: grad + wd * param
            grad = grad.add(param * self._vector([0.0 if d else w
                                                  for w, d in zip(wd, decoupled)], param))
        entry["steps"] = [s + 1 for s in entry["steps"]]
        entry["step"].add_(1)
        beta1 = [float(g["betas"][0]) for g in groups]
        beta2 = [float(g["betas"][1]) for g in groups]
        exp_avg, exp_avg_sq = entry["exp_avg"], entry["exp_avg_sq"]
        exp_avg.lerp_(grad, self._hp([1 - b for b in beta1], param))
        b2 = self._hp(beta2, param)
        if isinstance(b2, float):
            exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        else:  # (1 - b2) * grad first: torch's addcmul multiplies value * grad, then * grad
            exp_avg_sq.mul_(b2).addcmul_(grad * self._vector([1 - b for b in beta2], param), grad)
        # The bias corrections as torch computes them, in Python floats per model.
        steps = entry["steps"]
        step_size = self._hp([lr / (1 - b ** s) for lr, b, s in zip(hp["lr"], beta1, steps)],
                             param)
        bc2_sqrt = self._hp([math.sqrt(1 - b ** s) for b, s in zip(beta2, steps)], param)
        denom = exp_avg_sq.sqrt().div_(bc2_sqrt).add_(self._hp(hp["eps"], param))
        if isinstance(step_size, float):
            param.addcdiv_(exp_avg, denom, value=-step_size)
        else:  # param - (step_size * exp_avg) / denom, as addcdiv rounds it
            param.sub_(exp_avg.mul(step_size).div_(denom))


def unfuse(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Give a fused model (and its proxy optimizer's state) storage of its own again: every
    parameter, buffer and state tensor, now a view of slice k of the stacked ones, becomes a
    copy of its current value. The model then trains alone with its own ``optimizer.step()``
    as it would have had it never been fused; the fused model and :class:`FusedOptimizer` it
    was part of must not be used any more (fuse the others again: ``fuse_models`` stacks their
    current values).

    Example::

        unfuse(models[k], opts[k])                                  # model k leaves
        rest = [m for i, m in enumerate(models) if i != k]
        fused = fuse_models(rest)                                   # the others, restacked
        fopt = FusedOptimizer(fused, [o for i, o in enumerate(opts) if i != k])
    """
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            t.data = t.data.clone()
    if optimizer is not None:
        for p, state in list(optimizer.state.items()):
            optimizer.state[p] = _clone(state)


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj
