"""The operators of fused training (:mod:`retiarii.optim.fusion`): K same-shape layers, each
with its own weights, run as one kernel; and the layouts their values travel in.

A value of the fused model stands for K per-model values, in one of three layouts:

* ``S`` (shared): one value that is the same for every model (the batch, a size, a constant):
  per-model ``(B, ...)`` is stored once as ``(B, ...)``.
* ``K`` (stacked): model-major, per-model ``(B, ...)`` stored as ``(K, B, ...)``; linear
  layers (one batched matmul) and layer norms work here.
* ``C`` (channels): per-model ``(B, C, *spatial)`` stored as ``(B, K*C, *spatial)``, model k's
  channels at ``[k*C, (k+1)*C)``; convolutions (one grouped convolution), batch norms (one
  norm over K*C channels) and pooling work here, as in HFTA.

Going from C to K is a view (``(B, K*C, ...) -> (K, B, C, ...)``); from K to C is a copy.
Every fused layer *adopts* its K layers' tensors (:func:`stack_tensors`): the stacked
``(K, ...)`` tensor is the fused layer's, and each model's own parameter or buffer keeps its
object but its ``.data`` becomes a view of slice k. So the models' ``state_dict()`` reads the
fused values live, and their ``load_state_dict`` writes into the fused ones.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["FusedBatchNorm", "FusedConv", "FusedDropout", "FusedLayerNorm", "FusedLinear",
           "PerModelPointwise",
           "FusionError", "stack_tensors"]


class FusionError(ValueError):
    """Models that cannot train fused (other architectures, an operator fusion does not
    support); train them separately instead."""


def stack_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One ``(K, *shape)`` tensor holding ``tensors``; each given tensor (a parameter or a
    buffer of one model) then *is* its slice: ``tensors[k].data`` becomes a view of it.

    Example::

        w = stack_tensors([a.weight, b.weight])     # (2, out, in)
        assert a.weight.data_ptr() == w[0].data_ptr()
    """
    data = torch.stack([t.detach() for t in tensors])  # K x (*shape) -> (K, *shape)
    for k, t in enumerate(tensors):
        t.data = data[k]
    return data


def _param(tensors: Sequence[torch.Tensor]) -> nn.Parameter:
    return nn.Parameter(stack_tensors(tensors), requires_grad=tensors[0].requires_grad)


# ---- layout changes (shape comments are per-model (B, C, *s) stacked K times) --------------


def c_to_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """``(B, K*C, *s) -> (K, B, C, *s)``, a view."""
    return x.unflatten(1, (k, -1)).movedim(1, 0)


def k_to_c(x: torch.Tensor) -> torch.Tensor:
    """``(K, B, C, *s) -> (B, K*C, *s)``, a copy."""
    return x.movedim(0, 1).flatten(1, 2)


def s_to_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """``(B, ...) -> (K, B, ...)``, a view (every model reads the same values)."""
    return x.expand(k, *x.shape)


def s_to_c(x: torch.Tensor, k: int) -> torch.Tensor:
    """``(B, C, *s) -> (B, K*C, *s)``, a copy."""
    return x.unsqueeze(1).expand(x.shape[0], k, *x.shape[1:]).flatten(1, 2)


# ---- per-model semantics of dim-taking operations on K-layout tensors (emitted by fusion) ----


def shift_dim(dim: Any) -> Any:
    """A per-model dim in the K layout: non-negative dims move one right (K comes first)."""
    if isinstance(dim, (tuple, list)):
        return type(dim)(shift_dim(d) for d in dim)
    return dim + 1 if isinstance(dim, int) and dim >= 0 else dim


# Per-model semantics of dim-taking operations on a K-layout tensor (emitted in the graph).
def k_flatten(x, start_dim=0, end_dim=-1):
    return x.flatten(shift_dim(start_dim), shift_dim(end_dim))


def k_reshape(x, *shape):
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    return x.reshape(x.shape[0], *shape)  # reshape: a K view of C values is not contiguous


def k_size(x, dim=None):
    return x.shape[1:] if dim is None else x.shape[shift_dim(dim)]


def k_dim(x):
    return x.dim() - 1


def k_shape(x):
    return x.shape[1:]


def k_reduce(name, x, *args, **kwargs):
    """``x.mean(dim)``-like reductions; no dim: over all of a model's dims."""
    if not args and "dim" not in kwargs:
        return getattr(x.flatten(1), name)(1, **kwargs)
    if args:
        args = (shift_dim(args[0]), *args[1:])
    else:
        kwargs = {**kwargs, "dim": shift_dim(kwargs["dim"])}
    return getattr(x, name)(*args, **kwargs)


def k_cat(tensors, dim=0):
    return torch.cat(tensors, shift_dim(dim))


def k_getitem(x, index):
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, torch.Tensor) for i in index):
        raise FusionError("indexing a fused tensor with a tensor is not supported; train "
                          "these models separately (unfused)")
    return x[index if index and index[0] is Ellipsis else (slice(None), *index)]


# ---- layers with weights ---------------------------------------------------------------------


class FusedLinear(nn.Module):
    """K ``nn.Linear`` of one shape as one batched matmul (``torch.baddbmm``).

    Input K ``(K, B, *, in)``, or S ``(B, *, in)`` when ``shared_input`` (then one matmul
    against the K weights side by side); output K ``(K, B, *, out)``.
    """

    def __init__(self, layers: Sequence[nn.Linear], shared_input: bool):
        super().__init__()
        self.k, self.shared_input = len(layers), shared_input
        self.weight = _param([m.weight for m in layers])  # (K, out, in)
        self.bias = _param([m.bias for m in layers]) if layers[0].bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, out = self.k, self.weight.shape[1]
        if self.shared_input:  # (B, *, in) -> (B, *, K*out) -> (K, B, *, out)
            bias = None if self.bias is None else self.bias.flatten()
            y = F.linear(x, self.weight.flatten(0, 1), bias)
            # contiguous: the next layers read (K, B, ...) rows; one copy here, not in each
            return y.unflatten(-1, (k, out)).movedim(-2, 0).contiguous()
        flat = x.reshape(k, -1, x.shape[-1])  # (K, B, *, in) -> (K, B*, in)
        wt = self.weight.transpose(1, 2)  # (K, in, out)
        y = torch.bmm(flat, wt) if self.bias is None else torch.baddbmm(
            self.bias.unsqueeze(1), flat, wt)
        return y.view(*x.shape[:-1], out)


class FusedConv(nn.Module):
    """K ``nn.Conv1d/2d/3d`` of one shape as one grouped convolution.

    Input C ``(B, K*in, *s)``: ``groups = K * groups``; or S ``(B, in, *s)`` when
    ``shared_input`` (groups == 1 only): one convolution with ``K*out`` filters. Output C.
    """

    def __init__(self, layers: Sequence[nn.modules.conv._ConvNd], shared_input: bool):
        super().__init__()
        first = layers[0]
        self.k, self.shared_input = len(layers), shared_input
        self.dims = first.weight.dim() - 2
        self.stride, self.padding, self.dilation = first.stride, first.padding, first.dilation
        self.groups = first.groups
        self.weight = _param([m.weight for m in layers])  # (K, out, in/g, *kernel)
        self.bias = _param([m.bias for m in layers]) if first.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = (F.conv1d, F.conv2d, F.conv3d)[self.dims - 1]
        groups = self.groups if self.shared_input else self.k * self.groups
        bias = None if self.bias is None else self.bias.flatten()
        # (B, K*in, *s) -> (B, K*out, *s'): group j of model k meets only its own filters
        return conv(x, self.weight.flatten(0, 1), bias, self.stride, self.padding,
                    self.dilation, groups)


class FusedBatchNorm(nn.Module):
    """K ``nn.BatchNorm1d/2d/3d`` as one batch norm over K*C channels: each channel's
    statistics are its model's alone (a channel is normalized over the batch and space, never
    across channels). Input and output C ``(B, K*C, *s)``.
    """

    def __init__(self, layers: Sequence[nn.modules.batchnorm._BatchNorm]):
        super().__init__()
        first = layers[0]
        self.k, self.eps, self.momentum = len(layers), first.eps, first.momentum
        self.track = first.track_running_stats
        self.weight = _param([m.weight for m in layers]) if first.affine else None  # (K, C)
        self.bias = _param([m.bias for m in layers]) if first.affine else None
        if self.track:
            self.register_buffer("running_mean", stack_tensors([m.running_mean for m in layers]))
            self.register_buffer("running_var", stack_tensors([m.running_var for m in layers]))
            self.register_buffer("num_batches_tracked",
                                 stack_tensors([m.num_batches_tracked for m in layers]))
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # What nn.BatchNorm.forward does, with momentum set (momentum=None is refused when
        # fusing: its factor 1/num_batches_tracked could differ between models).
        if self.training and self.track:
            self.num_batches_tracked.add_(1)  # (K,): every model saw this batch
        use_stats = not self.training or self.track
        mean = self.running_mean.view(-1) if use_stats and self.track else None  # views: F
        var = self.running_var.view(-1) if use_stats and self.track else None  # updates them
        weight = None if self.weight is None else self.weight.flatten()
        bias = None if self.bias is None else self.bias.flatten()
        return F.batch_norm(x, mean, var, weight, bias, self.training or mean is None,
                            self.momentum, self.eps)


class FusedLayerNorm(nn.Module):
    """K ``nn.LayerNorm`` of one shape: one normalization, then each model's affine.
    Input and output K ``(K, B, *, *normalized_shape)``."""

    def __init__(self, layers: Sequence[nn.LayerNorm]):
        super().__init__()
        first = layers[0]
        self.shape, self.eps = tuple(first.normalized_shape), first.eps
        affine = first.weight is not None
        self.weight = _param([m.weight for m in layers]) if affine else None  # (K, *shape)
        self.bias = _param([m.bias for m in layers]) if getattr(first, "bias", None) is not None \
            else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x, self.shape, None, None, self.eps)
        lead = x.dim() - 1 - len(self.shape)  # the dims between K and the normalized ones
        if self.weight is not None:
            y = y * self.weight.view(self.weight.shape[0], *([1] * lead), *self.shape)
        if self.bias is not None:
            y = y + self.bias.view(self.bias.shape[0], *([1] * lead), *self.shape)
        return y


class FusedDropout(nn.Module):
    """K dropout layers of one configuration.

    With per-model RNG streams (``streams``: K functions returning context managers, set by
    :class:`~retiarii.optim.fusion.FusedModel` for a call), model k's slice is dropped in
    model k's stream, so each model draws exactly what it draws alone (K small calls). Without
    them, one call over the fused tensor: the same distribution, other random numbers.
    Input S, K or C (``layout``); output K for S input, else the input's layout.
    """

    def __init__(self, layer: nn.Module, k: int, layout: str):
        super().__init__()
        self.layer, self.k, self.layout = layer, k, layout
        self.streams: Sequence[Callable[[], ContextManager]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        streams = self.streams
        if streams is None:
            return self.layer(s_to_k(x, self.k) if self.layout == "S" else x)
        if self.layout == "C":
            parts = x.chunk(self.k, dim=1)  # (B, K*C, *s) -> K x (B, C, *s)
        elif self.layout == "K":
            parts = x.unbind(0)  # (K, B, ...) -> K x (B, ...)
        else:
            parts = [x] * self.k
        out = []
        for part, stream in zip(parts, streams):
            with stream() if stream is not None else contextlib.nullcontext():
                out.append(self.layer(part.contiguous()))  # the mask of a (B, ...) tensor
        return torch.cat(out, 1) if self.layout == "C" else torch.stack(out)


class PerModelPointwise(nn.Module):
    """Weightless element-wise layers that differ between the K fused models (one model's
    ReLU where another has a GELU: models of a space that chose other activations). Each
    distinct layer runs once, on the slices of the models that hold it; input and output K
    ``(K, B, ...)``.

    Example::

        act = PerModelPointwise([nn.ReLU(), nn.GELU(), nn.ReLU()])
        y = act(x)          # y[0] = relu(x[0]), y[1] = gelu(x[1]), y[2] = relu(x[2])
    """

    def __init__(self, layers: Sequence[nn.Module]):
        super().__init__()
        keys = [f"{type(m).__name__}({m.extra_repr()})" for m in layers]
        distinct = list(dict.fromkeys(keys))
        # copies: model k set to eval mode alone (its validation) must not switch ours
        self.fns = nn.ModuleList(copy.deepcopy(layers[keys.index(d)]) for d in distinct)
        self.members = [[i for i, k in enumerate(keys) if k == d] for d in distinct]
        order = [i for group in self.members for i in group]
        self.inverse = [order.index(i) for i in range(len(layers))]
        self._index: dict[torch.device, tuple[list[torch.Tensor], torch.Tensor]] = {}

    def _indices(self, device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor]:
        if device not in self._index:
            self._index[device] = ([torch.tensor(g, device=device) for g in self.members],
                                   torch.tensor(self.inverse, device=device))
        return self._index[device]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups, inverse = self._indices(x.device)
        parts = [fn(x.index_select(0, idx)) for fn, idx in zip(self.fns, groups)]
        return torch.cat(parts).index_select(0, inverse)
