"""Single-Path NAS's super-kernel (Stamoulis et al., ECML-PKDD 2019): one MBConv whose depthwise
5x5 kernel holds the 3x3 candidate as its centre and whose expansion-6 channels hold the
expansion-3 ones as their first half; the choice is made by thresholds on weight norms.

For a layer with kernels {3, 5}, expansions {3, 6} (and the skip when it keeps its shape)::

    w_k   = w_3x3 + 1(||w_5x5 \\ 3x3||^2 > t_k) * w_5x5\\3x3          (kernel: ring on or off)
    use   = 1(||w_k[e3 channels]||^2 > t_50)   (1 when the layer cannot be skipped)
    wide  = 1(||w_k[e6 \\ e3 channels]||^2 > t_100)
    y     = use * body(x; w_k, channels e3 + wide * (e6 \\ e3)) [+ x]

The indicators are hard (0 or 1) in the forward pass and the sigmoid of the same difference in
the backward pass (a straight-through sigmoid relaxation, as the paper's differentiable
threshold test), so the thresholds ``t_k``, ``t_50``, ``t_100`` learn by gradient together
with the weights. :meth:`SuperKernelMBConv.derive` reads the choice off the learnt
thresholds: ``"skip"`` or ``"k{3|5}_e{3|6}"``, the candidate names of
``model_spaces.proxylessnas``.

Example::

    >>> layer = SuperKernelMBConv(8, 8, stride=1, skip=True)
    >>> layer(torch.zeros(2, 8, 4, 4)).shape
    torch.Size([2, 8, 4, 4])
    >>> layer.derive() in ("skip", "k3_e3", "k3_e6", "k5_e3", "k5_e6")
    True
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SuperKernelMBConv", "indicator"]


def indicator(value: torch.Tensor) -> torch.Tensor:
    """1(value > 0) forward, d sigmoid(value) backward (straight-through)."""
    soft = torch.sigmoid(value)
    return (value > 0).to(value.dtype) + soft - soft.detach()


class SuperKernelMBConv(nn.Module):
    """One super-kernel MBConv layer: (B, C_in, H, W) -> (B, C_out, H/s, W/s).

    Args:
        c_in, c_out, stride: the layer's shape (the residual when stride 1 and equal widths).
        kernels: (small, large) depthwise kernels; the small is the large one's centre.
        expansions: (small, large) ratios; the small's channels are the large's first ones.
        skip: whether the layer may be dropped (the ``t_50`` test); only with a residual.
        thresholds: initial ``(t_k, t_50, t_100)`` (0: every test passes at the start, as
            the largest candidate, so all weights train first).
    """

    def __init__(self, c_in: int, c_out: int, stride: int = 1, kernels=(3, 5),
                 expansions=(3, 6), skip: bool = False, thresholds=(0.0, 0.0, 0.0)):
        super().__init__()
        (k_small, k_large), (e_small, e_large) = kernels, expansions
        self.k_small, self.k_large, self.e_small, self.e_large = k_small, k_large, e_small, e_large
        self.residual = stride == 1 and c_in == c_out
        if skip and not self.residual:
            raise ValueError(f"a layer of stride {stride} from {c_in} to {c_out} channels has "
                             f"no residual: it cannot be skipped (skip=False)")
        self.skip = skip
        mid, self.small_mid = c_in * e_large, c_in * e_small
        self.expand = nn.Sequential(nn.Conv2d(c_in, mid, 1, bias=False), nn.BatchNorm2d(mid),
                                    nn.ReLU6())
        self.depthwise = nn.Parameter(torch.empty(mid, 1, k_large, k_large))
        nn.init.kaiming_normal_(self.depthwise, mode="fan_out")
        self.bn = nn.BatchNorm2d(mid)
        self.project = nn.Sequential(nn.Conv2d(mid, c_out, 1, bias=False),
                                     nn.BatchNorm2d(c_out))
        self.stride = stride
        self.thresholds = nn.Parameter(torch.tensor([float(t) for t in thresholds]))
        pad = (k_large - k_small) // 2
        centre = torch.zeros(1, 1, k_large, k_large)
        centre[..., pad:pad + k_small, pad:pad + k_small] = 1.0
        self.register_buffer("centre", centre, persistent=False)

    def small_kernel(self) -> torch.Tensor:
        """The small candidate's kernel: the large one's centre, (mid, 1, k, k)."""
        pad = (self.k_large - self.k_small) // 2
        return self.depthwise[..., pad:pad + self.k_small, pad:pad + self.k_small]

    def gates(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(kernel, use, wide, w_k)``: the three indicators and the selected kernel."""
        w = self.depthwise
        ring = w * (1 - self.centre)
        t_k, t_50, t_100 = self.thresholds
        kernel = indicator(ring.pow(2).sum() - t_k)
        w_k = w * self.centre + kernel * ring
        use = indicator(w_k[:self.small_mid].pow(2).sum() - t_50) if self.skip \
            else torch.ones((), device=w.device)
        wide = indicator(w_k[self.small_mid:].pow(2).sum() - t_100)
        return kernel, use, wide, w_k

    def derive(self) -> str:
        """The candidate the thresholds select: ``"skip"`` or ``"k{k}_e{e}"``."""
        with torch.no_grad():
            kernel, use, wide, _ = self.gates()
        if float(use) < 0.5:
            return "skip"
        k = self.k_large if float(kernel) > 0.5 else self.k_small
        e = self.e_large if float(wide) > 0.5 else self.e_small
        return f"k{k}_e{e}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel, use, wide, w_k = self.gates()
        h = self.expand(x)  # (B, C_in, H, W) -> (B, mid, H, W)
        h = F.conv2d(h, w_k, None, self.stride, self.k_large // 2, 1, h.shape[1])
        h = F.relu6(self.bn(h))
        # channels e_small.. e_large count only when the wide test passes: (1, mid, 1, 1)
        mask = torch.cat([torch.ones(self.small_mid, device=h.device),
                          wide.expand(h.shape[1] - self.small_mid)]).view(1, -1, 1, 1)
        out = use * self.project(h * mask)
        return out + x if self.residual else out
