"""rt.freeze and FrozenBatchNorm: the frozen BatchNorm equals the eval-mode BatchNorm it
replaces, trains nothing, is traced as a frozen, batch-independent node, and survives a space
round trip and an export that imports only torch (its class copied into the file)."""
from __future__ import annotations

import ast
import doctest

import pytest
import torch
from torch import nn

import retiarii as rt
from retiarii import frozen as frozen_module
from retiarii.optim.batching import batch_independent
from retiarii.optim.plan import PlanModel, Role, build_plan

TOL = {"rtol": 1e-6, "atol": 1e-6}  # x * scale + shift vs (x - mean) / std * w + b


def _bn(cls=nn.BatchNorm2d, c=6, seed=0, **kwargs) -> nn.Module:
    """A BatchNorm with non-trivial statistics and affine weights, in train mode."""
    torch.manual_seed(seed)
    bn = cls(c, **kwargs)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(c))
        bn.running_var.copy_(torch.rand(c) * 3 + 0.1)
        if bn.affine:
            bn.weight.copy_(torch.randn(c))
            bn.bias.copy_(torch.randn(c))
    return bn


@pytest.mark.parametrize("cls,shape", [(nn.BatchNorm1d, (5, 6)), (nn.BatchNorm1d, (5, 6, 7)),
                                       (nn.BatchNorm2d, (5, 6, 4, 3)),
                                       (nn.BatchNorm3d, (5, 6, 2, 3, 4))])
@pytest.mark.parametrize("affine", [True, False])
def test_frozen_batchnorm_equals_the_eval_mode_batchnorm(cls, shape, affine):
    bn = _bn(cls, affine=affine, eps=1e-3)
    frozen = rt.FrozenBatchNorm.from_batchnorm(bn)
    x = torch.randn(*shape) * 4 + 1
    expected = bn.eval()(x)
    frozen.train()  # train mode too: the statistics are constants
    assert torch.allclose(frozen(x), expected, **TOL)
    assert frozen.eps == 1e-3 and frozen.affine is affine
    assert not any(p.requires_grad for p in frozen.parameters())
    assert not list(frozen.buffers())  # nothing that changes while a model trains


def test_gradient_through_the_frozen_batchnorm_is_the_eval_mode_one():
    bn = _bn().eval()
    frozen = rt.FrozenBatchNorm.from_batchnorm(bn)
    x = torch.randn(3, 6, 4, 4, requires_grad=True)
    (g_bn,) = torch.autograd.grad(bn(x).square().sum(), x)
    (g_fr,) = torch.autograd.grad(frozen(x).square().sum(), x)
    assert torch.allclose(g_fr, g_bn, rtol=1e-5, atol=1e-5)
    assert all(p.grad is None for p in frozen.parameters())


def test_new_values_are_read_after_an_in_place_write_and_a_load():
    frozen = rt.FrozenBatchNorm(6)
    x = torch.randn(2, 6, 3, 3)
    assert torch.allclose(frozen(x), x / (1 + 1e-5) ** 0.5, **TOL)  # cached scale and shift
    bn = _bn()
    frozen.load_state_dict(bn.state_dict())  # a BatchNorm checkpoint: num_batches_tracked
    assert torch.allclose(frozen(x), bn.eval()(x), **TOL)
    with torch.no_grad():
        frozen.bias.add_(1.0)
    assert torch.allclose(frozen(x), bn(x) + 1.0, **TOL)


def test_trainable_affine_weights_train_and_the_statistics_stay():
    frozen = rt.FrozenBatchNorm.from_batchnorm(_bn())
    frozen.requires_grad_(True)
    frozen(torch.randn(2, 6, 3, 3)).sum().backward()
    assert frozen.weight.grad is not None and frozen.bias.grad is not None
    assert frozen.running_mean.grad is None and frozen.running_var.grad is None


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(6)
        self.body = nn.Sequential(nn.Conv2d(6, 6, 1), nn.BatchNorm2d(6), nn.ReLU())
        self.again = self.bn  # one BatchNorm at two places
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        x = self.again(self.body(self.bn(self.conv(x))))
        return self.head(x.mean((2, 3)))


def _trained_backbone() -> Backbone:
    torch.manual_seed(0)
    net = Backbone()
    net.train()
    with torch.no_grad():  # running statistics that are not 0 and 1
        for _ in range(3):
            net(torch.randn(8, 3, 6, 6) * 2 + 1)
    return net


def test_freeze_replaces_every_batchnorm_and_freezes_every_parameter():
    net = _trained_backbone()
    expected = net.eval()(x := torch.randn(4, 3, 6, 6))
    out = rt.freeze(net)
    assert out is net
    assert not any(p.requires_grad for p in net.parameters())
    assert isinstance(net.bn, rt.FrozenBatchNorm) and isinstance(net.body[1], rt.FrozenBatchNorm)
    assert net.again is net.bn  # one BatchNorm -> one FrozenBatchNorm
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())
    net.train()
    assert torch.allclose(net(x), expected, **TOL)
    lone = rt.freeze(_bn())  # a BatchNorm itself: its replacement is returned
    assert isinstance(lone, rt.FrozenBatchNorm)


def test_freeze_errors_name_the_culprit_and_the_fix():
    net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, track_running_stats=False))
    with pytest.raises(ValueError, match=r"'1'.*track_running_stats=False.*GroupNorm"):
        rt.freeze(net)
    width = rt.ValueChoice([4, 8], label="w")
    chosen = nn.Sequential(rt.nn.Conv2d(3, width, 1), rt.nn.BatchNorm2d(width))
    with pytest.raises(ValueError, match=r"'1' takes a ValueChoice"):
        rt.freeze(chosen)
    lazy = nn.Sequential(nn.LazyBatchNorm2d())
    with pytest.raises(ValueError, match=r"'0' is lazy.*run the model once"):
        rt.freeze(lazy)
    with pytest.raises(ValueError, match="positive int"):
        rt.FrozenBatchNorm(0)


def test_traced_as_one_frozen_batch_independent_node():
    net = rt.freeze(_trained_backbone())
    graph = rt.trace(net)
    bns = [n for n in graph.nodes if n.kind == "module" and n.op.spec["cls"].endswith(
        ":FrozenBatchNorm")]
    assert [n.name for n in bns] == ["bn", "body.1", "bn@1"]  # leaves: one node per call
    assert all(n.op.spec.get("frozen") for n in bns)
    assert batch_independent(net.bn) and not batch_independent(nn.BatchNorm2d(6))
    space = rt.ModelSpace(net, [], example_input=torch.randn(2, 3, 6, 6))
    plan = build_plan([PlanModel("a", space.replay({}), "d")])
    roles = {plan.nodes[plan.keys["a"][n.uid]].role for n in space.replay({}).graph.nodes
             if n.name in ("bn", "body.1")}
    assert roles == {Role.FROZEN}


def test_space_round_trip_keeps_the_frozen_values():
    torch.manual_seed(0)
    net = rt.freeze(_trained_backbone())
    space = rt.ModelSpace(net, [rt.apply_mutator("head", rt.mutators.OperatorMutator(
        {"small": nn.Linear(6, 3), "mlp": nn.Sequential(nn.Linear(6, 8), nn.ReLU(),
                                                        nn.Linear(8, 3))}, label="h"))],
        example_input=torch.randn(2, 3, 6, 6))
    x = torch.randn(4, 3, 6, 6)
    for choice in ("small", "mlp"):
        model = space.instantiate({"h/head": choice})
        again = rt.Graph.from_json(model.graph.to_json())  # the IR travels as JSON
        assert again.structural_hash() == model.graph.structural_hash()
        torch.manual_seed(1)
        built = space.build({"h/head": choice})
        for name in ("bn", "body.1"):
            mine, base = built.get_submodule(name), net.get_submodule(name)
            assert type(mine) is rt.FrozenBatchNorm
            for key, value in base.state_dict().items():
                assert torch.equal(mine.state_dict()[key], value)
        trainable = {n for n, p in built.named_parameters() if p.requires_grad}
        assert trainable and all(n.startswith("head") for n in trainable)
        if choice == "small":  # the unmutated model computes what the base does
            state = {k: v for k, v in net.state_dict().items() if not k.startswith("again.")}
            built.load_state_dict(state)  # ("again" is "bn" under a second name)
            assert torch.equal(built.train()(x), net.train()(x))


def test_export_copies_the_class_and_needs_only_torch():
    net = rt.freeze(_trained_backbone())
    source = rt.trace(net).to_source("Exported")
    assert "class FrozenBatchNorm(nn.Module)" in source and "FrozenBatchNorm(6)" in source
    assert "Needs only torch." in source.splitlines()[0] and "@leaf" not in source
    imported = {alias.name.split(".")[0] for node in ast.parse(source).body
                if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in (node.names if isinstance(node, ast.Import)
                              else [ast.alias(node.module)])}
    assert imported == {"torch"}, source
    namespace: dict = {"__name__": "exported"}  # a fresh module: only what the file defines
    exec(compile(source, "<exported>", "exec"), namespace)
    exported = namespace["Exported"]()
    assert type(exported.bn).__module__ == "exported"  # the copied class, not retiarii's
    exported.load_state_dict({k: v for k, v in net.state_dict().items()
                              if not k.startswith("again.")})
    x = torch.randn(4, 3, 6, 6)
    exported.train()  # frozen statistics: train mode is eval mode
    assert torch.equal(exported(x), net(x))


def test_docstring_examples_run():
    result = doctest.testmod(frozen_module, extraglobs={"torch": torch, "nn": nn, "rt": rt})
    assert result.attempted > 0 and result.failed == 0
