"""Freezing a backbone for fine-tuning: :func:`freeze` and :class:`FrozenBatchNorm`.

A frozen parameter (``requires_grad=False``) keeps the base model's value in every model of a
space, which is what lets the engine compute a frozen layer once for several models (CSE) or
once on their concatenated inputs (operator batching; docs/optimization.md). A BatchNorm whose
affine weights are frozen is still not frozen: in train mode it normalizes each batch with the
batch's own statistics (so one example's output depends on the others) and it updates its
running statistics (state that changes while a model trains). Freezing a backbone therefore
also means freezing its BatchNorms the way fine-tuning does (torchvision's
``FrozenBatchNorm2d``): normalize with the running statistics as constants, in train mode too.

:func:`freeze` does both in one call::

    backbone = rt.freeze(mobilenet)     # no parameter trains; every BatchNorm -> FrozenBatchNorm

    before:  conv ─▶ BatchNorm2d(16)        (weight, bias train; running stats change)
    after:   conv ─▶ FrozenBatchNorm(16)    (weight, bias, running stats: constants)

A :class:`FrozenBatchNorm` is one traced node, frozen (its four tensors are parameters that do
not train, and it keeps no buffer) and batch-independent (each example is normalized alone),
so the plan treats it like a frozen convolution. Exported code copies its class in, so the
exported file still needs only torch.
"""
from __future__ import annotations

import torch
from torch import nn

from .choices import Expr  # a ValueChoice, or arithmetic on one
from .modspec import leaf

__all__ = ["FrozenBatchNorm", "freeze"]


@leaf
class FrozenBatchNorm(nn.Module):
    """Batch normalization with constant statistics: what an eval-mode BatchNorm computes, in
    train mode too; (B, C, ...) -> (B, C, ...), any number of spatial dims.

    ``y = (x - running_mean) / sqrt(running_var + eps) * weight + bias``, per channel,
    computed as ``x * scale + shift`` (equal to the eval-mode BatchNorm within float rounding,
    about 1e-7 relative; its backward is one multiply). The
    four tensors are parameters with ``requires_grad=False`` (not buffers), so a model's
    frozen values are all parameters and a traced FrozenBatchNorm is a frozen node. The
    statistics are read detached: making the module trainable (``requires_grad_(True)``)
    trains ``weight`` and ``bias`` only. A BatchNorm checkpoint loads into it
    (``num_batches_tracked`` is ignored).

    Example::

        >>> bn = nn.BatchNorm2d(8).eval()
        >>> frozen = FrozenBatchNorm.from_batchnorm(bn)
        >>> x = torch.randn(2, 8, 4, 4)
        >>> torch.allclose(frozen(x), bn(x), rtol=1e-6, atol=1e-6)
        True

    Args:
        num_features: channels C.
        eps: added to the variance, as in ``nn.BatchNorm2d``.
        affine: whether ``weight`` and ``bias`` exist (``nn.BatchNorm2d(affine=False)``).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, affine: bool = True):
        super().__init__()
        if not isinstance(num_features, int) or isinstance(num_features, bool) \
                or num_features < 1:
            raise ValueError(f"FrozenBatchNorm: num_features must be a positive int, not "
                             f"{num_features!r}")
        self.num_features, self.eps, self.affine = num_features, eps, affine
        if affine:
            self.weight = nn.Parameter(torch.ones(num_features), requires_grad=False)
            self.bias = nn.Parameter(torch.zeros(num_features), requires_grad=False)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.running_mean = nn.Parameter(torch.zeros(num_features), requires_grad=False)
        self.running_var = nn.Parameter(torch.ones(num_features), requires_grad=False)
        self._cache: tuple | None = None  # (the four tensors' identity, scale, shift)

    @classmethod
    def from_batchnorm(cls, bn: nn.Module) -> "FrozenBatchNorm":  # quoted: exports copy it
        """A FrozenBatchNorm holding ``bn``'s running statistics and affine weights (copies,
        on their device and dtype).

        Raises:
            ValueError: ``bn`` keeps no running statistics (``track_running_stats=False``).
        """
        if bn.running_mean is None or bn.running_var is None:
            raise ValueError(
                f"{type(bn).__name__}({bn.num_features}) keeps no running statistics "
                f"(track_running_stats=False): it normalizes every batch with that batch's own "
                f"statistics, so it has no constants to freeze; build it with "
                f"track_running_stats=True (and load or estimate its statistics), or replace "
                f"it by nn.GroupNorm / nn.LayerNorm")
        options = {"eps": float(bn.eps), "affine": bool(bn.affine)}  # recorded for exports:
        defaults = {"eps": 1e-5, "affine": True}  # only what differs, for readable code
        frozen = cls(bn.num_features, **{k: v for k, v in options.items() if v != defaults[k]})
        frozen.to(device=bn.running_mean.device, dtype=bn.running_mean.dtype)
        with torch.no_grad():
            frozen.running_mean.copy_(bn.running_mean)
            frozen.running_var.copy_(bn.running_var)
            if bn.affine:
                frozen.weight.copy_(bn.weight)
                frozen.bias.copy_(bn.bias)
        return frozen

    def _scale_shift(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, shift), each (C,): ``y = x * scale + shift``."""
        scale = (self.running_var.detach() + self.eps).rsqrt()
        shift = -self.running_mean.detach() * scale
        if self.weight is not None:
            scale = scale * self.weight
            shift = shift * self.weight + self.bias
        return scale, shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused multiply-add per element (torchvision's FrozenBatchNorm2d computes the
        # same): its backward is one multiply, where eval-mode F.batch_norm's costs as much as
        # a train-mode one. scale and shift are constants: made once per value of the four
        # tensors (a tensor's version counts its in-place writes: load_state_dict, copy_).
        shape = (1, -1) + (1,) * (x.dim() - 2)  # (C,) -> (1, C, 1, ...)
        tensors = [t for t in (self.weight, self.bias, self.running_mean, self.running_var)
                   if t is not None]
        if any(t.requires_grad for t in tensors):  # weight and bias made trainable
            scale, shift = self._scale_shift()
            return torch.addcmul(shift.reshape(shape), x, scale.reshape(shape))
        key = tuple((t.data_ptr(), t._version, t.dtype) for t in tensors)
        if self._cache is None or self._cache[0] != key:
            with torch.no_grad():
                self._cache = (key, *self._scale_shift())
        _, scale, shift = self._cache
        return torch.addcmul(shift.reshape(shape), x, scale.reshape(shape))  # (B, C, ...)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.pop(prefix + "num_batches_tracked", None)  # a BatchNorm's checkpoint
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, affine={self.affine}"


def _check_choice_free(bn: nn.Module, path: str) -> None:
    recorded = bn.__dict__.get("_retiarii_init")
    if recorded is None:
        return

    def has_choice(value) -> bool:
        if isinstance(value, Expr):
            return True
        if isinstance(value, (list, tuple)):
            return any(has_choice(v) for v in value)
        if isinstance(value, dict):
            return any(has_choice(v) for v in value.values())
        return False

    if has_choice(list(recorded[0]) + list(recorded[1].values())):
        raise ValueError(f"freeze: BatchNorm {path or '(the module)'!r} takes a ValueChoice: a "
                         f"frozen layer keeps the base model's values and sizes in every model, "
                         f"so its width cannot be searched; freeze a backbone with fixed widths")


def freeze(module: nn.Module) -> nn.Module:
    """Freeze ``module`` for fine-tuning, in place: no parameter trains, and every BatchNorm
    (``nn.BatchNorm1d/2d/3d``, ``SyncBatchNorm``, ``rt.nn.BatchNorm2d``, ...) is replaced by a
    :class:`FrozenBatchNorm` with its running statistics and affine weights.

    Call it on the part that stays fixed (a pretrained backbone, or one initialised under a
    fixed seed), before making the space; the adapters and heads you add after it train. A
    BatchNorm held at several places is replaced by one FrozenBatchNorm held at all of them.

    Example::

        torch.manual_seed(0)                        # frozen values: deterministic
        backbone = rt.freeze(model_spaces._mobile.mobilenetv2(width=25))
        assert not any(p.requires_grad for p in backbone.parameters())

    Returns:
        ``module`` itself (a BatchNorm given directly: its FrozenBatchNorm).

    Raises:
        ValueError: a BatchNorm keeps no running statistics (``track_running_stats=False``),
            is lazy and not yet initialised, or takes a ValueChoice (a searched width).
    """
    made: dict[int, FrozenBatchNorm] = {}

    def frozen_of(bn: nn.Module, path: str) -> FrozenBatchNorm:
        if id(bn) not in made:
            if isinstance(bn, nn.modules.lazy.LazyModuleMixin) and bn.has_uninitialized_params():
                raise ValueError(f"freeze: BatchNorm {path or '(the module)'!r} is lazy and not "
                                 f"initialised yet; run the model once on an example first")
            _check_choice_free(bn, path)
            try:
                made[id(bn)] = FrozenBatchNorm.from_batchnorm(bn)
            except ValueError as e:
                raise ValueError(f"freeze: BatchNorm {path or '(the module)'!r}: {e}") from None
        return made[id(bn)]

    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            path = f"{prefix}{name}"
            if isinstance(child, nn.modules.batchnorm._BatchNorm):
                parent._modules[name] = frozen_of(child, path)
            else:
                visit(child, path + ".")

    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        module = frozen_of(module, "")
    else:
        visit(module, "")
    module.requires_grad_(False)
    return module
