"""Each fused operator of retiarii/optim/fused_ops.py against its K unfused layers (outputs,
gradients, torch.autograd.gradcheck in float64), functions and methods on stacked values, and
a fuzz test over random same-shape architectures (fused vs each model alone). Training,
optimizers and checkpoints: tests/test_optim_fusion.py."""
import copy

import pytest
import torch
from torch import nn
from torch.autograd import gradcheck
from torch.nn import functional as F

from retiarii.optim import fused_ops as ops
from retiarii.optim.fusion import fuse_models

RTOL, ATOL = 1e-5, 1e-6


class Functional(nn.Module):
    """Functions and methods on stacked values: a parameter read directly, view/size, mean,
    softmax, layer norm, torch.cat, indexing."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 16)
        self.scale = nn.Parameter(torch.rand(16) + 0.5)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(24, 5)

    def forward(self, x):
        h = torch.relu(self.fc(x)) * self.scale
        h = self.norm(h - h.mean(dim=-1, keepdim=True))
        h = h.view(h.size(0), 4, -1).transpose(1, 2).reshape(h.size(0), -1)
        h = torch.cat([h, F.softmax(h[:, :8], dim=1)], 1)
        return self.out(h) + 1.0


def test_functions_on_stacked_values_and_their_gradients():
    torch.manual_seed(0)
    models = [Functional() for _ in range(3)]
    alone = copy.deepcopy(models)
    fused = fuse_models(models)
    x = torch.randn(64, 12, generator=torch.Generator().manual_seed(1))
    out = fused(x)
    refs = [m(x) for m in alone]
    torch.testing.assert_close(out, torch.stack(refs), rtol=RTOL, atol=ATOL)
    out.square().sum().backward()
    sum(r.square().sum() for r in refs).backward()
    for stacked, slices in fused.slices:
        names = {id(p): n for n, p in models[0].named_parameters()}
        name = names[id(slices[0])]
        grads = torch.stack([dict(m.named_parameters())[name].grad for m in alone])
        torch.testing.assert_close(stacked.grad, grads, rtol=1e-4, atol=1e-5)


# ---- each fused operator against its unfused form -------------------------------------------


FUSED_OPS = {
    "linear_shared": (lambda: nn.Linear(3, 4), lambda ls: ops.FusedLinear(ls, True),
                      (5, 3), "S", "K"),
    "linear_stacked": (lambda: nn.Linear(3, 4), lambda ls: ops.FusedLinear(ls, False),
                       (5, 2, 3), "K", "K"),
    "conv_shared": (lambda: nn.Conv2d(2, 4, 3, padding=1), lambda ls: ops.FusedConv(ls, True),
                    (2, 2, 4, 4), "S", "C"),
    "conv_grouped": (lambda: nn.Conv2d(4, 4, 3, stride=2, groups=2),
                     lambda ls: ops.FusedConv(ls, False), (2, 4, 5, 5), "C", "C"),
    "batchnorm": (lambda: nn.BatchNorm2d(3), ops.FusedBatchNorm, (4, 3, 2, 2), "C", "C"),
    "batchnorm1d": (lambda: nn.BatchNorm1d(3), ops.FusedBatchNorm, (4, 3), "C", "C"),
    "layernorm": (lambda: nn.LayerNorm(4), ops.FusedLayerNorm, (3, 4), "K", "K"),
}


def _layout_in(xs, layout):
    """Per-model inputs (K, *shape) in ``layout`` (S: model 0's, shared)."""
    if layout == "S":
        return xs[0]
    return xs if layout == "K" else ops.k_to_c(xs)


@pytest.mark.parametrize("name", sorted(FUSED_OPS))
def test_fused_operator_matches_unfused_and_gradcheck(name):
    make, fuse, shape, lin, lout = FUSED_OPS[name]
    torch.manual_seed(0)
    layers = [make().double() for _ in range(3)]
    for m in layers:  # non-trivial affine weights
        for p in m.parameters():
            p.data.uniform_(-1, 1)
    copies = copy.deepcopy(layers)
    fused = fuse(layers).double().train()
    xs = torch.randn(3, *shape, dtype=torch.float64)
    if lin == "S":
        xs = xs[:1].expand(3, *shape).clone()
    x = _layout_in(xs, lin).detach().requires_grad_(True)
    out = fused(x)
    out_k = ops.c_to_k(out, 3) if lout == "C" else out
    refs = [copies[k](xs[k]) for k in range(3)]
    torch.testing.assert_close(out_k, torch.stack(refs))
    # Gradients of the weights and of the input against the unfused layers.
    weights = torch.randn_like(out_k)
    (out_k * weights).sum().backward()
    sum((r * weights[k]).sum() for k, r in enumerate(refs)).backward()
    for pname, param in fused.named_parameters():
        torch.testing.assert_close(param.grad, torch.stack([getattr(m, pname).grad
                                                            for m in copies]))
    # torch.autograd.gradcheck of the fused operator in float64 (input and weights).
    params = tuple(p for _, p in fused.named_parameters())

    names = [n for n, _ in fused.named_parameters()]

    def fn(inp, *ps):  # the fused operator with the checked tensors as its weights
        return torch.func.functional_call(fused, dict(zip(names, ps)), (inp,))

    assert gradcheck(fn, (x.detach().requires_grad_(True),
                          *(p.detach().clone().requires_grad_(True) for p in params)),
                     eps=1e-6, atol=1e-5)


def test_layout_conversions_round_trip():
    x = torch.randn(3, 2, 4, 5, 5)  # (K, B, C, H, W)
    c = ops.k_to_c(x)
    assert c.shape == (2, 12, 5, 5)
    assert torch.equal(c[:, 4:8], x[1])  # model 1's channels
    assert torch.equal(ops.c_to_k(c, 3), x)
    s = torch.randn(2, 4, 5, 5)
    assert torch.equal(ops.s_to_c(s, 3)[:, 8:12], s)
    assert torch.equal(ops.s_to_k(s, 3)[2], s)


# ---- a fuzz test over random same-shape architectures ------------------------------------------

_ACTS = [nn.ReLU, nn.GELU, nn.Tanh, nn.SiLU, nn.LeakyReLU, nn.Identity]


def _random_net(rng):
    """A random CNN or MLP of the operators fusion supports (one draw of ``rng``)."""
    pick = lambda seq: seq[int(torch.randint(len(seq), (1,), generator=rng))]  # noqa: E731
    layers, width = [], 3
    if pick([True, False]):  # convolutional trunk on (B, 3, 8, 8)
        for _ in range(pick([1, 2])):
            out = pick([4, 6])
            groups = pick([1, 2]) if width % 2 == 0 else 1
            layers += [nn.Conv2d(width, out, 3, padding=1, groups=groups, bias=False)]
            layers += [nn.BatchNorm2d(out)] if pick([True, False]) else []
            layers += [pick(_ACTS)(), pick([nn.MaxPool2d(2), nn.AvgPool2d(2), nn.Identity()])]
            width = out
        layers += [nn.AdaptiveAvgPool2d(2), nn.Flatten()]
        width *= 4
    else:
        layers += [nn.Flatten()]
        width = 3 * 8 * 8
    for _ in range(pick([1, 2])):
        hidden = pick([8, 12])
        layers += [nn.Linear(width, hidden), pick([nn.BatchNorm1d(hidden), nn.LayerNorm(hidden),
                                                   nn.Identity()]), pick(_ACTS)()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, 3))


@pytest.mark.parametrize("seed", range(12))
def test_fuzz_random_architectures_fused_equal_alone(seed):
    """Outputs in train and eval mode within RTOL/ATOL of each model alone; gradients as close
    to the float64 truth as each model's alone in float32 (BatchNorm's backward subtracts
    means, so a gradient element can be a small difference of large terms: elementwise, both
    float32 runs are off by more than 1e-4 of it)."""
    rng = torch.Generator().manual_seed(seed)
    state = rng.get_state()
    models = []
    for k in range(3):
        rng.set_state(state)  # the same architecture ...
        torch.manual_seed(seed * 10 + k)  # ... with its own weights
        models.append(_random_net(rng))
    alone = copy.deepcopy(models)
    truth = [copy.deepcopy(m).double() for m in models]
    fused = fuse_models(models)
    x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
    for mode in (True, False):
        fused.train(mode)
        out = fused(x)
        refs = [m.train(mode)(x) for m in alone]
        exact = [m.train(mode)(x.double()) for m in truth]
        torch.testing.assert_close(out, torch.stack(refs), rtol=RTOL, atol=ATOL)
        for outs in (out, refs, exact):
            sum(o.sum() for o in outs).backward()
    for stacked, slices in fused.slices:
        index = next(i for i, p in enumerate(models[0].parameters()) if p is slices[0])
        grad32, grad64 = (torch.stack([list(m.parameters())[index].grad.double() for m in ms])
                          for ms in (alone, truth))
        scale = grad64.abs().max().clamp_min(1e-12)
        fused_err = (stacked.grad.double() - grad64).abs().max() / scale
        alone_err = (grad32 - grad64).abs().max() / scale
        assert fused_err <= 2 * alone_err + 1e-6, (tuple(stacked.shape), fused_err, alone_err)
