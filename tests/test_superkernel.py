"""Single-Path NAS's super-kernel: the 3x3 candidate is the 5x5's centre, the expansion-3
channels the first of the expansion-6 ones, hand-set thresholds give the expected choice
(and the function of that candidate), and the thresholds receive gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from retiarii.optim.superkernel import SuperKernelMBConv, indicator

BIG = 1e9  # a threshold no norm passes


def _layer(thresholds, skip=True):
    torch.manual_seed(0)
    layer = SuperKernelMBConv(4, 4, 1, skip=skip, thresholds=thresholds)
    return layer.eval()


def test_the_3x3_is_the_5x5s_centre():
    layer = _layer((0.0, 0.0, 0.0))
    assert torch.equal(layer.small_kernel(), layer.depthwise[..., 1:4, 1:4])
    # a view: a step on the centre is a step on the 5x5
    with torch.no_grad():
        layer.small_kernel().add_(1.0)
    assert torch.equal(layer.depthwise[..., 1:4, 1:4], layer.small_kernel())


@pytest.mark.parametrize("thresholds,expected", [
    ((0.0, 0.0, 0.0), "k5_e6"),      # every test passes: the largest candidate
    ((BIG, 0.0, 0.0), "k3_e6"),      # the ring fails its test: 3x3
    ((0.0, 0.0, BIG), "k5_e3"),      # the extra channels fail: expansion 3
    ((BIG, 0.0, BIG), "k3_e3"),
    ((0.0, BIG, 0.0), "skip"),       # the first channels fail: the layer is dropped
])
def test_hand_set_thresholds_give_the_expected_choice(thresholds, expected):
    assert _layer(thresholds).derive() == expected


def test_the_selected_candidate_computes_what_that_candidate_computes():
    layer = _layer((BIG, 0.0, BIG))  # k3_e3
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        h = layer.expand(x)
        w3 = torch.zeros_like(layer.depthwise)
        w3[:, :, 1:4, 1:4] = layer.small_kernel()
        ref = F.conv2d(h, layer.small_kernel(), None, 1, 1, 1, h.shape[1])  # a plain 3x3
        assert torch.allclose(ref, F.conv2d(h, w3, None, 1, 2, 1, h.shape[1]), atol=1e-6)
        ref = F.relu6(layer.bn(ref))
        ref[:, 12:] = 0  # expansion 3 of 6: the first 12 of 24 channels
        ref = layer.project(ref) + x
        assert torch.allclose(layer(x), ref, atol=1e-5)
        # dropped: the residual alone
        assert torch.equal(_layer((0.0, BIG, 0.0))(x), x)


def test_thresholds_learn_by_gradient_through_the_relaxed_indicator():
    layer = _layer((0.0, 0.0, 0.0)).train()
    layer(torch.randn(2, 4, 6, 6)).pow(2).mean().backward()
    assert layer.thresholds.grad is not None and bool((layer.thresholds.grad != 0).all())
    v = torch.tensor([0.3, -0.2], requires_grad=True)
    g = indicator(v)
    assert g.tolist() == [1.0, 0.0]  # hard forward
    g.sum().backward()
    s = torch.sigmoid(torch.tensor([0.3, -0.2]))
    assert torch.allclose(v.grad, s * (1 - s))  # sigmoid backward


def test_a_layer_without_residual_cannot_be_skipped():
    with pytest.raises(ValueError, match="cannot be skipped"):
        SuperKernelMBConv(4, 8, 2, skip=True)
