"""Sliced operators: one module of the largest size serves every width and kernel size.

A ValueChoice on a Conv2d's channels or kernel size, a Linear's features or a BatchNorm's
features keeps ONE pooled module of the largest candidate (FBNetV2 / once-for-all weight
sharing); a model's operator is a small wrapper that calls the functional op on the leading
slice of the big tensors (output channels first, then input channels; a smaller kernel is the
centre crop of the big one). Slices are views, so the gradient lands in the big weight's
slice and nowhere else, and BatchNorm's running statistics are updated in the slice in place.

The wrappers hold the big module as their ``big`` child (so ``parameters()`` of a path yields
the shared tensors), but their ``state_dict`` is that of the standalone model's layer: the
sliced tensors under ``weight``, ``bias``, ``running_mean``, ... (what
:meth:`SuperGraph.export_state` hands out).

Example::

    >>> big = build_big({"slice": "Linear", "in": 8, "out": 16, "bias": True})
    >>> lin = SlicedLinear(big, nn.Linear(4, 6, device="meta"))    # uses big.weight[:6, :4]
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SlicedBatchNorm", "SlicedConv2d", "SlicedLinear", "build_big", "sliced"]


def build_big(recipe: dict) -> nn.Module:
    """The pooled module of a slice family (a recipe made by ``weight_keys``)."""
    cls = recipe["slice"]
    if cls == "Conv2d":
        groups = recipe["out"] if recipe["groups"] == "depthwise" else recipe["groups"]
        return nn.Conv2d(recipe["in"], recipe["out"], tuple(recipe["kernel"]), groups=groups,
                         bias=recipe["bias"])
    if cls == "Linear":
        return nn.Linear(recipe["in"], recipe["out"], bias=recipe["bias"])
    layer = {"BatchNorm1d": nn.BatchNorm1d, "BatchNorm2d": nn.BatchNorm2d}[cls]
    return layer(recipe["num"], affine=recipe["affine"], track_running_stats=recipe["track"])


class _Sliced(nn.Module):
    """Base: ``tensors()`` gives the slices the standalone layer would hold."""

    def __init__(self, big: nn.Module):
        super().__init__()
        self.big = big

    def tensors(self) -> dict[str, torch.Tensor]:
        raise TypeError(f"{type(self).__name__} must define tensors()")

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        if destination is None:
            destination = OrderedDict()
        for name, value in self.tensors().items():
            destination[prefix + name] = value if keep_vars else value.detach()
        return destination


class SlicedConv2d(_Sliced):
    """``F.conv2d`` on ``big.weight[:out, :in/groups]`` (kernel centre-cropped): the model's
    own stride, padding, dilation and groups, read from ``layer`` (its Conv2d)."""

    def __init__(self, big: nn.Conv2d, layer: nn.Conv2d):
        super().__init__(big)
        self.out, self.per_group = layer.out_channels, layer.in_channels // layer.groups
        k, big_k = layer.kernel_size, big.kernel_size
        self.rows = slice((big_k[0] - k[0]) // 2, (big_k[0] - k[0]) // 2 + k[0])
        self.cols = slice((big_k[1] - k[1]) // 2, (big_k[1] - k[1]) // 2 + k[1])
        self.stride, self.padding = layer.stride, layer.padding
        self.dilation, self.groups = layer.dilation, layer.groups
        self.has_bias = layer.bias is not None

    def tensors(self):
        # (O, I/g, K, K) -> (out, in/groups, k, k)
        out = {"weight": self.big.weight[:self.out, :self.per_group, self.rows, self.cols]}
        if self.has_bias:
            out["bias"] = self.big.bias[:self.out]
        return out

    def forward(self, x):
        w = self.big.weight[:self.out, :self.per_group, self.rows, self.cols]
        b = self.big.bias[:self.out] if self.has_bias else None
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation, self.groups)


class SlicedLinear(_Sliced):
    """``F.linear`` on ``big.weight[:out, :in]``."""

    def __init__(self, big: nn.Linear, layer: nn.Linear):
        super().__init__(big)
        self.out, self.inp = layer.out_features, layer.in_features
        self.has_bias = layer.bias is not None

    def tensors(self):
        out = {"weight": self.big.weight[:self.out, :self.inp]}
        if self.has_bias:
            out["bias"] = self.big.bias[:self.out]
        return out

    def forward(self, x):
        b = self.big.bias[:self.out] if self.has_bias else None
        return F.linear(x, self.big.weight[:self.out, :self.inp], b)


class SlicedBatchNorm(_Sliced):
    """``F.batch_norm`` on the first ``num_features`` channels of the big BatchNorm (weights
    and running statistics), with the model's own eps and momentum; as torch's BatchNorm."""

    def __init__(self, big: nn.modules.batchnorm._BatchNorm,
                 layer: nn.modules.batchnorm._BatchNorm):
        super().__init__(big)
        self.num, self.eps, self.momentum = layer.num_features, layer.eps, layer.momentum

    def tensors(self):
        big, n, out = self.big, self.num, {}
        if big.affine:
            out["weight"], out["bias"] = big.weight[:n], big.bias[:n]
        if big.track_running_stats:
            out["running_mean"], out["running_var"] = big.running_mean[:n], big.running_var[:n]
            out["num_batches_tracked"] = big.num_batches_tracked
        return out

    def forward(self, x):
        big, n = self.big, self.num
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and big.track_running_stats:
            big.num_batches_tracked.add_(1)
            factor = 1.0 / float(big.num_batches_tracked) if self.momentum is None \
                else self.momentum
        use_batch = self.training or big.running_mean is None
        track = not self.training or big.track_running_stats
        return F.batch_norm(
            x, big.running_mean[:n] if track and big.running_mean is not None else None,
            big.running_var[:n] if track and big.running_var is not None else None,
            big.weight[:n] if big.affine else None, big.bias[:n] if big.affine else None,
            use_batch, factor, self.eps)


def sliced(big: nn.Module, layer: nn.Module) -> _Sliced:
    """The wrapper that runs ``layer`` (a candidate, e.g. built on the meta device) on a slice
    of ``big``."""
    if isinstance(layer, nn.Conv2d):
        return SlicedConv2d(big, layer)
    if isinstance(layer, nn.Linear):
        return SlicedLinear(big, layer)
    return SlicedBatchNorm(big, layer)
