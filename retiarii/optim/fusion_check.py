"""What must be equal for models to fuse, checked on the modules: each traces (torch.fx) to
the same code with the same layers and tensors (:func:`signature`), up to its weightless
activations, or differs at places that fit one fused model (:func:`segments_fit`).

Example::

    signature(trace_model(m, 0), m) == signature(trace_model(n, 1), n)   # one architecture
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import fx, nn

from . import fused_segments
from .fused_ops import FusionError

__all__ = ["POINTWISE_MODULES", "generated_signature", "is_pointwise_layer", "segments_fit",
           "signature", "trace_model"]

_FALLBACK = "train these models separately (unfused)"

POINTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.ELU, nn.Tanh,
                      nn.Sigmoid, nn.Hardswish, nn.Hardsigmoid, nn.Mish, nn.Softplus, nn.Identity)


def trace_model(model: nn.Module, index: int) -> fx.GraphModule:
    if isinstance(model, fx.GraphModule):
        try:
            return fx.symbolic_trace(model)
        except Exception:  # noqa: BLE001 (a generated module traces as it is)
            return model
    try:
        return fx.symbolic_trace(model)
    except Exception as err:
        raise FusionError(f"model {index} ({type(model).__name__}) cannot be traced by "
                          f"torch.fx ({err}); {_FALLBACK}") from err


def generated_signature(model: nn.Module) -> tuple | None:
    """For a model whose behaviour is all in code it shows (a generated ``fx.GraphModule``
    whose every submodule is one too, a torch.nn layer or a container): its code, every module's type,
    configuration and mode, and every tensor's name, shape, dtype, device and requires_grad.
    Models with equal signatures trace to the same graph, so :func:`fuse_models` traces one
    of them (5 ms per small model) and reads the others' tensors by the same paths. None for
    any other model (a user's ``forward`` may branch on plain attributes): it is traced."""
    if not isinstance(model, fx.GraphModule):
        return None
    layers = []
    for name, m in model.named_modules():
        if isinstance(m, fx.GraphModule):
            layers.append((name, type(m).__name__, m.code, m.training))
        elif type(m).__module__.startswith("torch.nn."):  # a layer, or a container
            layers.append((name, type(m).__name__, m.extra_repr(), m.training))
        else:
            return None
    tensors = tuple((name, tuple(t.shape), t.dtype, t.device, t.requires_grad)
                    for name, t in model.state_dict(keep_vars=True).items())
    return tuple(layers), tensors  # (fx makes a class per GraphModule: not compared)


def signature(gm: fx.GraphModule, model: nn.Module, family: bool = False) -> tuple:
    """What must be equal for models to fuse: the traced code, every layer's type and
    configuration, every tensor's name, shape, dtype, device and requires_grad; with
    ``family``, a weightless activation layer counts as any other (:func:`fusion_family`)."""
    layers = tuple((name, "pointwise", m.training) if family and is_pointwise_layer(m) else
                   (name, type(m).__name__, m.extra_repr(), m.training)
                   for name, m in gm.named_modules() if name)
    tensors = tuple((name, tuple(t.shape), t.dtype, t.device.type, t.requires_grad)
                    for name, t in model.state_dict(keep_vars=True).items())
    return gm.code, layers, tensors


def is_pointwise_layer(m: nn.Module) -> bool:
    return isinstance(m, POINTWISE_MODULES) and not any(True for _ in m.parameters()) \
        and not any(True for _ in m.buffers())


def segments_fit(models: Sequence[nn.Module], inputs: Sequence[Any] | None) -> bool:
    """Whether ``models`` (generated or traceable) that may differ at places fit one fused
    model on inputs shaped like ``inputs`` (every value their common layers read of one
    shape: :func:`~.fused_segments.segments_fit`), checked on meta tensors."""
    try:
        traced = [trace_model(m, i) for i, m in enumerate(models)]
    except FusionError:
        return False
    return fused_segments.segments_fit(traced, inputs, is_pointwise_layer)

