"""Once-for-All's elastic super-network (Cai et al., ICLR 2020): one MBConv per layer slot whose
kernel, width and (per unit) depth shrink, every sub-network a slice of the largest.

- **elastic kernel**: the 7x7 depthwise kernel is the only one stored; the 5x5 is a learnt
  linear map (25 x 25, shared by the channels of a layer) of the 7x7's centre, the 3x3 a
  learnt map (9 x 9) of the 5x5's centre: the kernel transformation matrices, initialised to
  the identity;
- **elastic width**: expansion e uses the first ``e * c_in`` hidden channels;
  :meth:`ElasticMBConv.sort_channels` reorders them by importance (the L1 norm of each
  channel's projection weights) so the first ones are the most important;
- **elastic depth**: a unit of depth d runs its first d layer slots.

A sub-network is a config: per unit ``(depth, [(kernel, expansion) per layer])``; None is the
largest. Example::

    >>> import torch
    >>> layer = ElasticMBConv(8, 8, 1)
    >>> layer(torch.zeros(2, 8, 4, 4), kernel=3, expansion=4).shape
    torch.Size([2, 8, 4, 4])
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ElasticBody", "ElasticMBConv", "centre"]


def centre(w: torch.Tensor, k: int) -> torch.Tensor:
    """The central k x k of a (C, 1, K, K) kernel."""
    pad = (w.shape[-1] - k) // 2
    return w[..., pad:pad + k, pad:pad + k]


def _bn(x: torch.Tensor, bn: nn.BatchNorm2d, n: int) -> torch.Tensor:
    """``bn`` on its first ``n`` channels (the running statistics' slices update in place)."""
    momentum = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.momentum is None:  # cumulative average (BN recalibration)
        bn.num_batches_tracked.add_(1)
        momentum = 1.0 / float(bn.num_batches_tracked)
    return F.batch_norm(x, bn.running_mean[:n], bn.running_var[:n], bn.weight[:n],
                        bn.bias[:n], bn.training, momentum, bn.eps)


class ElasticMBConv(nn.Module):
    """One layer slot: (B, C_in, H, W) -> (B, C_out, H/s, W/s) at any (kernel, expansion).

    Args:
        c_in, c_out, stride: the slot's shape (a residual when stride 1 and equal widths).
        se: squeeze-and-excite to ``c_in // 4`` channels (of the active hidden ones).
        act: the activation class.
        kernels, expansions: the elastic values; the largest are stored.
    """

    def __init__(self, c_in: int, c_out: int, stride: int, se: bool = False,
                 act: type = nn.ReLU, kernels=(3, 5, 7), expansions=(3, 4, 6)):
        super().__init__()
        self.kernels, self.expansions = tuple(sorted(kernels)), tuple(sorted(expansions))
        self.c_in, self.stride = c_in, stride
        mid, k = c_in * self.expansions[-1], self.kernels[-1]
        self.expand = nn.Conv2d(c_in, mid, 1, bias=False)
        self.expand_bn = nn.BatchNorm2d(mid)
        self.depthwise = nn.Parameter(torch.empty(mid, 1, k, k))
        nn.init.kaiming_normal_(self.depthwise, mode="fan_out")
        self.dw_bn = nn.BatchNorm2d(mid)
        # kernel transformation matrices, larger -> smaller, keyed by the smaller kernel
        self.transforms = nn.ParameterDict({
            str(small): nn.Parameter(torch.eye(small * small)) for small in self.kernels[:-1]})
        self.se = se
        if se:
            squeeze = max(1, c_in // 4)
            self.se_reduce = nn.Conv2d(mid, squeeze, 1)
            self.se_expand = nn.Conv2d(squeeze, mid, 1)
        self.project = nn.Conv2d(mid, c_out, 1, bias=False)
        self.project_bn = nn.BatchNorm2d(c_out)
        self.act = act()
        self.residual = stride == 1 and c_in == c_out

    def kernel(self, k: int, n: int) -> torch.Tensor:
        """The (n, 1, k, k) depthwise kernel of the first ``n`` channels: the stored largest
        one, or each smaller one the transform of the next larger one's centre."""
        if k not in self.kernels:
            raise ValueError(f"kernel {k} is not one of {self.kernels}")
        w = self.depthwise[:n]
        for small in reversed(self.kernels[:-1]):
            if small < k:
                break
            m = self.transforms[str(small)]
            # (n, 1, s, s) -> (n, s*s) @ M^T -> (n, 1, s, s)
            w = (centre(w, small).reshape(n, small * small) @ m.T).reshape(n, 1, small, small)
        return w

    def forward(self, x, kernel: int | None = None, expansion: int | None = None):
        k = self.kernels[-1] if kernel is None else kernel
        e = self.expansions[-1] if expansion is None else expansion
        if e not in self.expansions:
            raise ValueError(f"expansion {e} is not one of {self.expansions}")
        n = self.c_in * e
        h = self.act(_bn(F.conv2d(x, self.expand.weight[:n]), self.expand_bn, n))
        h = F.conv2d(h, self.kernel(k, n), None, self.stride, k // 2, 1, n)  # depthwise
        h = self.act(_bn(h, self.dw_bn, n))  # (B, n, H/s, W/s)
        if self.se:
            s = self.act(F.conv2d(h.mean((2, 3), keepdim=True), self.se_reduce.weight[:, :n],
                                  self.se_reduce.bias))
            h = h * torch.sigmoid(F.conv2d(s, self.se_expand.weight[:n],
                                           self.se_expand.bias[:n]))
        out = self.project_bn(F.conv2d(h, self.project.weight[:, :n]))
        return out + x if self.residual else out

    @torch.no_grad()
    def sort_channels(self) -> torch.Tensor:
        """Reorders the hidden channels by importance, most important first (the L1 norm of
        each one's projection weights); returns the order. The function of the largest
        sub-network is unchanged (a permutation of its hidden channels)."""
        order = torch.argsort(self.project.weight.abs().sum((0, 2, 3)), descending=True,
                              stable=True)
        self.expand.weight.copy_(self.expand.weight[order])
        self.depthwise.copy_(self.depthwise[order])
        for bn in (self.expand_bn, self.dw_bn):
            for t in (bn.weight, bn.bias, bn.running_mean, bn.running_var):
                t.copy_(t[order])
        if self.se:
            self.se_reduce.weight.copy_(self.se_reduce.weight[:, order])
            self.se_expand.weight.copy_(self.se_expand.weight[order])
            self.se_expand.bias.copy_(self.se_expand.bias[order])
        self.project.weight.copy_(self.project.weight[:, order])
        return order


class ElasticBody(nn.Module):
    """The searched units: ``units`` as (c_in, c_out, first stride, se, act) each, with up to
    ``max(depths)`` layer slots; ``forward(x, config)``, config per unit
    ``(depth, [(kernel, expansion), ...])`` or None (the largest)."""

    def __init__(self, units, depths=(2, 3, 4), kernels=(3, 5, 7), expansions=(3, 4, 6)):
        super().__init__()
        self.depths, self.kernels, self.expansions = tuple(depths), tuple(kernels), \
            tuple(expansions)
        self.units = nn.ModuleList(
            nn.ModuleList(ElasticMBConv(c_in if i == 0 else c_out, c_out,
                                        stride if i == 0 else 1, se, act, kernels, expansions)
                          for i in range(max(depths)))
            for c_in, c_out, stride, se, act in units)

    def forward(self, x, config=None):
        for u, slots in enumerate(self.units):
            depth, layers = (len(slots), [(None, None)] * len(slots)) if config is None \
                else config[u]
            for slot, (k, e) in zip(slots[:depth], layers):
                x = slot(x, k, e)
        return x

    def sort_channels(self) -> None:
        """:meth:`ElasticMBConv.sort_channels` of every slot."""
        for slots in self.units:
            for slot in slots:
                slot.sort_channels()
