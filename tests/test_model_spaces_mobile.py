"""The mobile-network family of model_spaces/ (issue #15): SPOS, EfficientNet, FBNet,
ProxylessNAS, FairNAS, SCARLET-NAS, Single-Path NAS, Once-for-All, ChamNet.

tests/test_model_spaces.py runs every row's small preset (its size walked, random samples
shape-checked, a training step on digits, the export round trip). Here: the size formulas
against the published counts, what the choices do to the networks, the all-defaults
networks against the reference networks' parameter counts, every paper preset's random
samples on a small input and its all-defaults network on a (1, 3, 224, 224) input.
"""
from __future__ import annotations

import functools
import math
import re

import pytest
import torch
from torch import nn

from model_spaces import chamnet, efficientnet, fbnet, once_for_all, proxylessnas, spos
from model_spaces._mobile import MBConv, scale_width, searched_layers
from retiarii import nas

MOBILE = ("spos", "efficientnet", "fbnet", "proxylessnas", "fairnas", "scarlet_nas",
          "single_path_nas", "once_for_all", "chamnet")
VARIANTS = ("proxylessnas", "fairnas", "scarlet_nas", "single_path_nas")


def params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def depthwise(net: nn.Module) -> list[nn.Conv2d]:
    return [m for m in net.modules() if isinstance(m, nn.Conv2d) and m.groups > 1
            and m.groups == m.in_channels]


def choices(space) -> dict[str, list]:
    """label -> candidate keys of the all-defaults model's choices, in order."""
    seen: dict[str, list] = {}

    def first(label, candidates, context):
        seen[label] = list(candidates)
        return 0

    space.sample(first)
    return seen


@functools.lru_cache(maxsize=None)
def paper_space(name: str, image_size: int = 32):
    return nas.build_space(name, "paper", in_channels=3, num_classes=1000,
                           image_size=image_size)


def test_the_rows_are_registered_and_implemented():
    for name in MOBILE:
        row = nas.get(name)
        assert row.module and row.status != "not yet" and row.runs_with and row.note
        assert {p for p, _, _ in row.presets} == set(nas.PRESETS)
    # the rows whose published search shares weights run a one-shot strategy
    # (tests/test_nas_one_shot.py runs each)
    for name in ("spos", "fbnet", "proxylessnas", "fairnas", "scarlet_nas", "single_path_nas",
                 "once_for_all"):
        assert nas.get(name).one_shot


@pytest.mark.parametrize("build", [
    lambda leaf: fbnet.small(leaf_blocks=leaf),
    lambda leaf: proxylessnas.small("proxylessnas", leaf_blocks=leaf),
    lambda leaf: proxylessnas.small("single_path_nas", leaf_blocks=leaf),
], ids=["fbnet", "proxylessnas", "single_path_nas"])
def test_leaf_blocks_are_the_same_models_as_spliced_ones(build):
    spliced, leaf = build(False), build(True)
    assert leaf.size() == spliced.size()
    # a searched layer of leaf blocks is one node; spliced, its block's layers are nodes
    leaf_graph = leaf.replay(leaf.default_sample()).graph
    spliced_graph = spliced.replay(spliced.default_sample()).graph
    assert any(n.name == "layers.1" for n in leaf_graph.nodes)
    assert not any(n.name == "layers.1" for n in spliced_graph.nodes)
    x = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    for seed in (0,):  # (one random model: building them is what takes the time)
        sample = spliced.random_sample(seed).sample
        a, b = spliced.build(sample), leaf.build(sample)
        # the same tensors, named without the candidate ("layers.3.k5_e3.body..." spliced,
        # "layers.3.body..." as a leaf): all of them load (strict), the outputs agree
        b.load_state_dict({re.sub(r"^(layers\.\d+)\.(k\d_e\d(_g2)?|skip)\.", r"\1.", k): v
                           for k, v in a.state_dict().items()})
        a.eval(), b.eval()
        torch.testing.assert_close(b(x), a(x), rtol=0, atol=1e-6)


def test_published_sizes_and_the_formulas():
    assert spos.PUBLISHED_SIZE == 4 ** 20
    assert fbnet.PUBLISHED_SIZE == 9 ** 22
    assert proxylessnas.size("fairnas") == 6 ** 19  # FairNAS: 6 choices x 19 layers
    assert proxylessnas.size("proxylessnas") == 6 ** 6 * 7 ** 15
    assert proxylessnas.size("scarlet_nas") == 6 ** 6 * 7 ** 13
    assert proxylessnas.size("single_path_nas") == 4 ** 6 * 5 ** 15
    assert once_for_all.size(5) == 7371 ** 5 and 1.5e19 < 7371 ** 5 < 2.5e19  # "~2x10^19"
    assert once_for_all.size(2) == 7371 ** 2
    # kernel x expansion x SE x layers per stage (stage 1: kernel x SE x layers 1-2; stage
    # 7: 1-2 layers), times the 27 scaling points
    assert efficientnet.size() == 8 * 24 ** 5 * 16 * 3 ** 3 == 27_518_828_544
    assert chamnet.size() == 6 * 27 ** 5 * 18 * 3 == 4_649_045_868


def test_once_for_all_walk_counts_one_unit_as_the_formula():
    space = once_for_all.ofa_space(once_for_all.SMALL_UNITS[:1], 8, 16, 1, 1, 10, 8)
    assert space.size() == once_for_all.size(1) == 81 + 729 + 6561


@pytest.mark.parametrize("variant", VARIANTS)
def test_proxyless_family_candidates_per_layer(variant):
    stages, kernels, expansions, identity = proxylessnas.VARIANTS[variant]
    found = choices(paper_space(variant))
    layers = sum(n for _, n, _ in stages)
    assert list(found) == [f"layer{i}" for i in range(1, layers + 1)]
    ops = {f"k{k}_e{e}" for k in kernels for e in expansions}
    firsts = {sum(n for _, n, _ in stages[:s]) + 1 for s in range(len(stages))}
    for i, label in enumerate(found, 1):
        # the identity (zero / skip) only where the layer keeps its shape
        extra = {identity} if identity and i not in firsts else set()
        assert set(found[label]) == ops | extra, label


def test_proxyless_family_layer_counts():
    assert sum(n for _, n, _ in proxylessnas.PROXYLESS_STAGES) == 21
    assert sum(n for _, n, _ in proxylessnas.FAIRNAS_STAGES) == 19


def test_a_dropped_layer_is_the_identity():
    space = nas.build_space("proxylessnas", "small")
    sample = space.default_sample()
    dropped = dict(sample, layer2="zero", layer3="zero", layer4="zero")
    full, lean = space.build(sample), space.build(dropped)
    assert params(full) - params(lean) == 3 * params(MBConv(8, 8, 1, 3, 3))
    assert lean(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


def test_fbnet_nine_blocks_per_layer_and_its_skip():
    found = choices(nas.build_space("fbnet", "small"))
    assert len(found) == 22 and all(len(c) == 9 for c in found.values())
    assert found["layer1"] == list(fbnet.BLOCKS) + ["skip"]
    # skip is a 1x1 projection where the shape changes (layer 2: 8 -> 8 channels, stride 1,
    # keeps it; layer 6: 8 -> 12, stride 2, does not), the identity elsewhere
    assert isinstance(fbnet.skip(8, 8, 1), nn.Identity)
    proj = fbnet.skip(8, 12, 2)
    assert proj(torch.zeros(1, 8, 8, 8)).shape == (1, 12, 4, 4)
    g2 = MBConv(8, 8, 1, 3, 1, act=nn.ReLU, groups=2, expand=True)
    convs = [m for m in g2.modules() if isinstance(m, nn.Conv2d)]
    assert [c.groups for c in convs] == [2, 8, 2]  # group 1x1, depthwise, group 1x1
    assert any(isinstance(m, nn.ChannelShuffle) for m in g2.modules())


def test_spos_units_keep_shapes_and_xception_has_three_depthwise_convs():
    for choice in spos.CHOICES:
        first = spos.ShuffleUnit(choice, 16, 24, 2)
        same = spos.ShuffleUnit(choice, 24, 24, 1)
        x = torch.zeros(2, 16, 8, 8)
        assert same(first(x)).shape == (2, 24, 4, 4)
    xception = spos.ShuffleUnit("choice_x", 24, 24, 1)
    depthwise = [m for m in xception.modules() if isinstance(m, nn.Conv2d) and m.groups > 1]
    assert len(depthwise) == 3
    found = choices(nas.build_space("spos", "small"))
    assert len(found) == 20 and all(c == list(spos.CHOICES) for c in found.values())


def test_efficientnet_default_is_b0_and_the_scaling_choices():
    space = paper_space("efficientnet")
    # EfficientNet-B0: 5,288,548 parameters (torchvision's efficientnet_b0, the paper's 5.3M)
    assert params(space.build(space.default_sample())) == 5_288_548
    deep = dict(space.default_sample(), **{"scaling/depth": "140", "scaling/width": 120})
    net = space.build(deep)
    # ceil(1.4 n) layers per stage: 2 + 3 + 3 + 5 + 5 + 6 + 2 instead of B0's 16, each with
    # one depthwise conv
    assert len(depthwise(net)) == 26
    assert net.get_submodule("stem.0").out_channels == 40  # 32 x 1.2 = 38.4, to 8s
    assert choices(space)["scaling/resolution"] == [32, 37, 42]


def per_stage(net: nn.Module) -> tuple[list[int], list[int]]:
    """(layers, SE modules) per stage of a built EfficientNet: a stage is the searched Repeat
    ``layers.{2s}`` and its depth-scaling extras ``layers.{2s+1}``, a layer one depthwise
    conv."""
    layers, se = [0] * 7, [0] * 7
    for name, m in net.named_modules():
        if name.startswith("layers."):
            s = int(name.split(".")[1]) // 2
            layers[s] += isinstance(m, nn.Conv2d) and m.groups > 1
            se[s] += name.endswith(".se.reduce")
    return layers, se


def test_efficientnet_searches_se_and_layers_per_stage_as_mnasnet():
    space = nas.build_space("efficientnet", "small")
    found = choices(space)
    for s, (e, k, _, n, _) in enumerate(efficientnet.B0_STAGES, 1):
        # MnasNet's per-block choices: kernel 3/5, expansion 6/3 (stage 1 stays B0's MBConv1),
        # SE or not, B0's layers -1/0/+1 (at least 1), B0's values first
        assert found[f"stage{s}/kernel"] == [k, 8 - k]
        assert found.get(f"stage{s}/expansion") == ([6, 3] if e != 1 else None)
        assert found[f"stage{s}/se"] == ["se", "none"]
        assert found[f"stage{s}/layers"] == ([n, n - 1, n + 1] if n > 1 else [1, 2])
    b0 = space.default_sample()
    assert per_stage(space.build(b0)) == ([1, 2, 2, 3, 3, 4, 1], [1, 2, 2, 3, 3, 4, 1])
    # by hand: stage 2 three layers without SE, stage 4 two with, stage 6 five without,
    # stage 7 two with
    sample = dict(b0, **{"stage2/layers": 3, "stage2/se": "none", "stage4/layers": 2,
                         "stage6/layers": 5, "stage6/se": "none", "stage7/layers": 2})
    net = space.build(sample)
    assert per_stage(net) == ([1, 3, 2, 2, 3, 5, 2], [1, 0, 2, 2, 3, 0, 2])
    assert net(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    # depth 1.2 scales the searched counts: ceil(1.2 m) = 2, 4, 3, 3, 4, 6, 3, the extra
    # layers with their stage's SE choice
    deep = space.build(dict(sample, **{"scaling/depth": "120"}))
    assert per_stage(deep) == ([2, 4, 3, 3, 4, 6, 3], [2, 0, 3, 3, 4, 0, 3])
    for s, (_, _, _, n, _) in enumerate(efficientnet.B0_STAGES, 1):  # every count, every d
        for m in ([n, n - 1, n + 1] if n > 1 else [1, 2]):
            for d in efficientnet.DEPTHS:
                net = space.build(dict(b0, **{f"stage{s}/layers": m, "scaling/depth": str(d)}))
                assert per_stage(net)[0][s - 1] == efficientnet.layers_at(m, d) \
                    == math.ceil(m * d / 100)


def test_searched_layers_refuses_depth_coefficients_it_cannot_build():
    with pytest.raises(ValueError, match=r"\[100, 200\] percent"):
        searched_layers(lambda i: nn.Identity(), 2, "b/layers", depth=("d", (100, 250)))


def test_efficientnet_resolution_resizes_inside_the_model():
    space = nas.build_space("efficientnet", "small")
    sample = dict(space.default_sample(), **{"scaling/resolution": 10})
    net = space.build(sample)
    seen = []
    net.get_submodule("stem.0").register_forward_hook(
        lambda m, i, o: seen.append(tuple(i[0].shape)))
    assert net(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert seen == [(2, 1, 10, 10)]


def test_once_for_all_depth_hides_the_deeper_layers_choices():
    space = nas.build_space("once_for_all", "small")
    shallow = space.default_sample()
    assert shallow["unit1/depth"] == 2 and "unit1/layer3/kernel" not in shallow
    deep = dict(shallow, **{"unit1/depth": 4})
    deep.update({f"unit1/layer{i}/{c}": v for i in (3, 4) for c, v in
                 (("kernel", 7), ("expansion", 6))})
    model = space.instantiate(deep)
    assert {"unit1/layer4/kernel", "unit1/layer4/expansion"} <= set(model.sample)
    net = model.to_module()
    kernels = [m.kernel_size[0] for m in depthwise(net)]
    assert len(kernels) == 1 + 4 + 2 and kernels.count(7) == 2  # first block, units 1 and 2
    assert net(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


def test_chamnet_holds_mobilenet_v2_and_distinct_widths():
    space = paper_space("chamnet")
    # MobileNetV2 1.0: 3,504,872 parameters (torchvision's mobilenet_v2, the paper's 3.4M)
    assert params(space.build(chamnet.mobilenet_v2(space))) == 3_504_872
    for divisor, stages in ((4, chamnet.MOBILENETV2_STAGES),
                            (1, [(e, max(4, c // 4), n, s)
                                 for e, c, n, s in chamnet.MOBILENETV2_STAGES])):
        for _, c, _, _ in stages:
            widths = {scale_width(c, w, divisor) for w in chamnet.WIDTHS}
            assert len(widths) == 3, (c, widths)
    assert choices(space)["stage4/depth"] == [3, 4, 5]


@pytest.mark.parametrize("name", MOBILE)
def test_paper_preset_random_samples_on_a_small_input(name):
    space = paper_space(name)
    model = space.instantiate(space.random_sample(seed=0).sample)
    out = model.to_module().eval()(torch.zeros(1, 3, 32, 32))
    assert out.shape == (1, 1000)


@pytest.mark.parametrize("name", MOBILE)
def test_paper_preset_at_224(name):
    # the all-defaults network on the published input: about a second each
    space = nas.build_space(name, "paper", in_channels=3, num_classes=1000, image_size=224)
    net = space.build(space.default_sample()).eval()
    with torch.no_grad():
        assert net(torch.zeros(1, 3, 224, 224)).shape == (1, 1000)


def test_the_mobile_blocks_examples_run():
    import doctest

    from model_spaces import _mobile

    result = doctest.testmod(_mobile)
    assert result.attempted >= 8 and result.failed == 0
