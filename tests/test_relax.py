"""The continuous relaxation of a space (retiarii/optim/relax.py): fixed mode equals the built
model, the mixtures equal their hand-computed sums, the binary gates' gradient equals the
ProxylessNAS estimator, and choices it cannot relax are refused by name."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import retiarii as rt
from retiarii.optim.relax import Relaxation, RelaxError


class Net(nn.Module):
    """An operator choice, then an input choice whose candidates use it (or not): the op's
    label is conditional (a sample keeping input 2 has no "op")."""

    def __init__(self):
        super().__init__()
        self.fc0 = nn.Linear(4, 8)
        self.op = rt.LayerChoice({"lin": nn.Linear(8, 8), "relu": nn.ReLU(),
                                  "id": nn.Identity()}, label="op")
        self.a = nn.Linear(8, 8)
        self.skip = rt.InputChoice(3, 1, label="skip")
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        x = self.fc0(x)
        y = self.op(x)
        return self.out(self.skip([y, self.a(y), torch.tanh(x)]))


def _space(net=None, **kw):
    torch.manual_seed(0)
    return rt.ModelSpace(net or Net(), example_input=torch.randn(2, 4), **kw)


def _all_samples(space):
    return [m.sample for m in space.enumerate()]


def test_fixed_mode_equals_the_built_model_with_the_same_weights():
    space = _space()
    relax = Relaxation(space)
    x = torch.randn(5, 4)
    samples = _all_samples(space)
    assert len(samples) == 7  # 3 ops x 2 inputs that use it, + the tanh input
    for sample in samples:
        built = relax.export(sample)
        assert set(dict(built.named_parameters())) == set(
            dict(space.build(sample).named_parameters()))
        torch.testing.assert_close(relax.fix(sample)(x), built(x), rtol=0, atol=1e-6)


def test_softmax_mixed_op_equals_the_weighted_sum_of_candidates():
    space = _space()
    relax = Relaxation(space)
    with torch.no_grad():
        relax.alpha("op").copy_(torch.tensor([0.3, -1.0, 2.0]))
        relax.alpha("skip").copy_(torch.tensor([5.0, -3.0, 1.0]))
    x = torch.randn(6, 4)
    p_op, p_skip = (F.softmax(relax.alpha(k).detach(), -1) for k in ("op", "skip"))
    # by hand: z = sum_j p_skip[j] * input_j, with y = sum_c p_op[c] * op_c(fc0(x))
    h = relax.export({"op": "id", "skip": 0}).fc0(x)
    ys = [relax.export({"op": k, "skip": 0}).op(h) if k != "id" else h
          for k in ("lin", "relu", "id")]
    y = sum(p * v for p, v in zip(p_op, ys))
    ref = relax.export({"op": "lin", "skip": 1})
    z = p_skip[0] * y + p_skip[1] * ref.a(y) + p_skip[2] * torch.tanh(h)
    relax.set_mode("softmax")
    torch.testing.assert_close(relax(x), ref.out(z), rtol=1e-5, atol=1e-6)


def test_weights_and_alphas_are_separate_and_both_get_gradients():
    relax = Relaxation(_space())
    weights, alphas = list(relax.weight_parameters()), list(relax.arch_parameters())
    assert {id(p) for p in weights}.isdisjoint({id(p) for p in alphas})
    assert [tuple(a.shape) for a in alphas] == [(3,), (3,)]
    relax(torch.randn(4, 4)).square().sum().backward()
    assert all(a.grad is not None and a.grad.abs().sum() > 0 for a in alphas)


def test_derive_takes_the_argmax_and_leaves_out_labels_not_asked():
    relax = Relaxation(_space())
    with torch.no_grad():
        relax.alpha("op").copy_(torch.tensor([0.0, 1.0, 0.0]))
        relax.alpha("skip").copy_(torch.tensor([0.0, 2.0, 0.0]))
    assert relax.derive() == {"skip": 1, "op": "relu"}
    with torch.no_grad():
        relax.alpha("skip").copy_(torch.tensor([0.0, 0.0, 3.0]))
    assert relax.derive() == {"skip": 2}  # the tanh input: "op" is not in that model


def test_binary_gate_gradient_is_the_proxylessnas_estimator():
    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.op = rt.LayerChoice({"a": nn.Linear(3, 3), "b": nn.Tanh(),
                                      "c": nn.Linear(3, 3, bias=False)}, label="op")

        def forward(self, x):
            return self.op(x)

    torch.manual_seed(0)
    space = rt.ModelSpace(One(), example_input=torch.randn(1, 3))
    relax = Relaxation(space, mode="binary", paths=3, seed=3)
    with torch.no_grad():
        relax.alpha("op").copy_(torch.tensor([0.2, -0.4, 0.7]))
    x, r = torch.randn(4, 3), torch.randn(4, 3)
    (relax(x) * r).sum().backward()
    outs = [relax.export({"op": k})(x) for k in ("a", "b", "c")]
    dg = torch.stack([(r * o).sum() for o in outs])  # dL/dg_j = <dL/dy, y_j>
    p = F.softmax(relax.alpha("op").detach(), -1)
    expected = torch.stack([(dg * p * ((torch.arange(3) == i).float() - p[i])).sum()
                            for i in range(3)])
    torch.testing.assert_close(relax.alpha("op").grad, expected, rtol=1e-5, atol=1e-6)
    # one path active: the output is exactly one candidate's
    active = relax.sampled["op"]
    assert sorted(active) == [0, 1, 2]
    with torch.no_grad():
        y = relax(x)
    assert any(torch.equal(y, o) for o in outs)


def test_gumbel_hard_forward_is_one_candidate_and_reproducible():
    space = _space()
    a = Relaxation(space, mode="gumbel", hard=True, temperature=0.5, seed=7)
    b = Relaxation(space, mode="gumbel", hard=True, temperature=0.5, seed=7)
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 4)
    ya = a(x)
    torch.testing.assert_close(ya, b(x), rtol=0, atol=0)
    outs = [a.export(s)(x) for s in _all_samples(space)]
    assert any((ya - o).abs().max() < 1e-5 for o in outs)


def test_input_choice_keeping_two_is_a_choice_of_pairs():
    class Pairs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
            self.pick = rt.InputChoice(3, 2, reduction="sum", label="pick")

        def forward(self, x):
            return self.pick([self.a(x), self.b(x), self.c(x)])

    space = _space(Pairs())
    relax = Relaxation(space)
    assert relax.keys["pick"] == ["0,1", "0,2", "1,2"]
    x = torch.randn(2, 4)
    with torch.no_grad():
        relax.alpha("pick").copy_(torch.tensor([0.5, 1.5, -1.0]))
    p = F.softmax(relax.alpha("pick").detach(), -1)
    outs = [relax.export({"pick": k})(x) for k in relax.keys["pick"]]
    relax.set_mode("softmax")
    torch.testing.assert_close(relax(x), sum(w * o for w, o in zip(p, outs)),
                               rtol=1e-5, atol=1e-6)
    assert relax.derive() == {"pick": "0,2"}


# ---- what cannot be relaxed ----------------------------------------------------------------


def test_a_width_choice_is_refused_naming_its_label():
    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            width = rt.ValueChoice([8, 16], label="width")
            self.fc1 = rt.nn.Linear(4, width)
            self.fc2 = rt.nn.Linear(width, 2)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    with pytest.raises(RelaxError, match=r"'width'.*shape.*spos/enas"):
        Relaxation(_space(Wide()))


def test_a_hyper_parameter_choice_is_refused_naming_it():
    space = _space().with_hparams({"lr": rt.ValueChoice([0.1, 0.01], label="lr")})
    with pytest.raises(RelaxError, match=r"\['lr'\].*hyper-parameters"):
        Relaxation(space)


class _Joint(rt.Mutator):
    """Replaces the activation only when both choices say so: a structure the single moves
    of a label cannot see."""

    def mutate(self, targets):
        a = self.choose([0, 1], label="a")
        b = self.choose([0, 1], label="b")
        if a and b:
            self.replace("act", nn.Tanh())


class Act(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x))


def test_interacting_choices_are_refused_naming_the_node():
    space = rt.ModelSpace(Act(), [_Joint()], example_input=torch.randn(1, 4))
    with pytest.raises(RelaxError, match=r"node 'act'.*interact.*multi-trial"):
        Relaxation(space)


def test_several_base_models_are_refused():
    space = rt.ModelSpace([Act(), Act()], example_input=torch.randn(1, 4))
    with pytest.raises(RelaxError, match="base models"):
        Relaxation(space)


def test_a_sample_with_an_unknown_label_is_refused():
    relax = Relaxation(_space())
    with pytest.raises(RelaxError, match="'nope'"):
        relax.fix({"nope": 1})
    with pytest.raises(RelaxError, match="not among its candidates"):
        relax.fix({"op": "conv"})


# ---- spaces written with mutators, Repeat, composite candidates --------------------------------


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0, self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.l2(self.act(self.l1(self.l0(x)))))


def _check_fixed_equals_build(space, x):
    relax = Relaxation(space)
    samples = [m.sample for m in space.enumerate()]
    for sample in samples:
        torch.testing.assert_close(relax.fix(sample)(x), relax.export(sample)(x),
                                   rtol=0, atol=1e-6)
    return relax, samples


def test_mutator_space_operator_and_input_choices():
    torch.manual_seed(0)
    space = rt.ModelSpace(Chain(), [
        rt.apply_mutator("act", rt.mutators.OperatorMutator([nn.ReLU(), nn.Tanh(),
                                                             nn.Linear(4, 4)])),
        rt.apply_mutator("l2", rt.mutators.InputMutator(["l0", "x"]))],
        example_input=torch.randn(1, 4))
    relax, samples = _check_fixed_equals_build(space, torch.randn(3, 4))
    assert len(samples) == 9 and sorted(map(len, relax.keys.values())) == [3, 3]


def test_repeat_depth_is_a_mixed_input_over_the_block_outputs():
    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = rt.Repeat(lambda i: nn.Sequential(nn.Linear(4, 4), nn.Tanh()),
                                    depth=(1, 3), label="depth")
            self.out = nn.Linear(4, 2)

        def forward(self, x):
            return self.out(self.blocks(x))

    space = _space(Deep())
    x = torch.randn(3, 4)
    relax, samples = _check_fixed_equals_build(space, x)
    with torch.no_grad():
        relax.alpha("depth").copy_(torch.tensor([0.1, 0.9, -0.5]))
    p = F.softmax(relax.alpha("depth").detach(), -1)
    outs = [relax.export(s)(x) for s in samples]  # out is affine: the mixture passes through
    relax.set_mode("softmax")
    torch.testing.assert_close(relax(x), sum(w * o for w, o in zip(p, outs)),
                               rtol=1e-5, atol=1e-6)


def test_composite_candidates_are_spliced_and_mixed_where_they_meet():
    class Block(nn.Module):
        def __init__(self, act):
            super().__init__()
            self.fc, self.act = nn.Linear(4, 4), act

        def forward(self, x):
            return self.act(self.fc(x)) + x

    class Net2(nn.Module):
        def __init__(self):
            super().__init__()
            self.choice = rt.LayerChoice({"relu": Block(nn.ReLU()), "tanh": Block(nn.Tanh()),
                                          "id": nn.Identity()}, label="block")
            self.out = nn.Linear(4, 2)

        def forward(self, x):
            return self.out(torch.sigmoid(self.choice(x)))

    space = _space(Net2())
    x = torch.randn(3, 4)
    relax, samples = _check_fixed_equals_build(space, x)
    with torch.no_grad():
        relax.alpha("block").copy_(torch.tensor([0.4, -0.2, 0.3]))
    p = F.softmax(relax.alpha("block").detach(), -1)
    # the candidates' outputs are mixed at the sigmoid's input, as DARTS mixes an op's output
    inner = [relax.export(s) for s in samples]
    z = sum(w * _before_sigmoid(m, x) for w, m in zip(p, inner))
    relax.set_mode("softmax")
    torch.testing.assert_close(relax(x), inner[0].out(torch.sigmoid(z)), rtol=1e-5, atol=1e-6)


def _before_sigmoid(model, x):
    """The value entering the sigmoid in a built model of Net2, by hand from its layers."""
    names = dict(model.named_modules())
    for key, act in (("relu", torch.relu), ("tanh", torch.tanh)):
        if f"choice.{key}.fc" in names:
            return act(names[f"choice.{key}.fc"](x)) + x
    return x


def test_frozen_layers_keep_the_base_values_and_do_not_train():
    net = Net()
    net.fc0.requires_grad_(False)
    space = _space(net)
    relax = Relaxation(space)
    trained = [p for p in relax.weight_parameters() if p.requires_grad]
    frozen = [p for p in relax.weight_parameters() if not p.requires_grad]
    assert len(frozen) == 2 and trained
    built = space.build({"op": "lin", "skip": 0})
    torch.testing.assert_close(relax.export({"op": "lin", "skip": 0}).fc0.weight,
                               built.fc0.weight, rtol=0, atol=0)
    assert torch.equal(built.fc0.weight, net.fc0.weight)


def test_a_tensor_read_from_a_module_stays_tied_to_it():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.op = rt.LayerChoice({"relu": nn.ReLU(), "tanh": nn.Tanh()}, label="op")

        def forward(self, x):
            return F.linear(self.op(self.fc(x)), self.fc.weight)  # the same weight, twice

    space = _space(Tied())
    relax = Relaxation(space)
    x = torch.randn(3, 4)
    for key in ("relu", "tanh"):
        torch.testing.assert_close(relax.fix({"op": key})(x), relax.export({"op": key})(x),
                                   rtol=0, atol=1e-6)
    assert sum(p.numel() for p in relax.weight_parameters()) == 20  # one 4x4 weight + bias


def test_binary_estimator_on_a_node_with_an_op_and_an_input_choice():
    """Gate gradients of both choices of one node: each candidate is run on the other
    choice's active candidate (the inactive ops see the active input)."""
    class Last(nn.Module):
        def __init__(self):
            super().__init__()
            self.l0, self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.l2(torch.relu(self.l1(self.l0(x))))

    torch.manual_seed(0)
    space = rt.ModelSpace(Last(), [
        rt.apply_mutator("l2", rt.mutators.OperatorMutator([nn.Linear(4, 4), nn.Tanh(),
                                                            nn.Sigmoid()])),
        rt.apply_mutator("l2", rt.mutators.InputMutator(["l0", "x"]))],
        example_input=torch.randn(1, 4))
    relax = Relaxation(space, mode="binary", paths=3, seed=1)
    op_label, in_label = relax.labels
    with torch.no_grad():
        relax.alpha(op_label).copy_(torch.tensor([0.3, -0.2, 0.5]))
        relax.alpha(in_label).copy_(torch.tensor([-0.1, 0.4, 0.2]))
    x, r = torch.randn(5, 4), torch.randn(5, 4)
    (relax(x) * r).sum().backward()
    p = {lab: F.softmax(relax.alpha(lab).detach(), -1) for lab in relax.labels}
    keys = relax.keys
    assert keys[in_label] == ["relu", "x", "l0"]
    m = relax.export({op_label: "Linear", in_label: "relu"})
    with torch.no_grad():
        sources = [torch.relu(m.l1(m.l0(x))), x, m.l0(x)]
    ops = [relax.export({op_label: k, in_label: "relu"}).l2 for k in keys[op_label]]

    def estimator(dg, q):
        return torch.stack([(dg * q * ((torch.arange(3) == i).float() - q[i])).sum()
                            for i in range(3)])

    found = []
    for a in range(3):  # the active op and input are not known: one pair must fit
        for b in range(3):
            # the op's gate multiplies its output; the input's gate its port (mixed input)
            d_op = torch.stack([(r * op(sources[b])).sum() for op in ops]).detach()
            z = sources[b].clone().requires_grad_(True)
            (g_port,) = torch.autograd.grad((r * ops[a](z)).sum(), z)
            d_in = torch.stack([(g_port * s).sum() for s in sources])
            if torch.allclose(relax.alpha(op_label).grad, estimator(d_op, p[op_label]),
                              rtol=1e-4, atol=1e-6) and torch.allclose(
                    relax.alpha(in_label).grad, estimator(d_in, p[in_label]),
                    rtol=1e-4, atol=1e-6):
                found.append((a, b))
    assert len(found) == 1, found


class _OpFollowsInput(rt.Mutator):
    """The activation depends on both choices, as a DARTS reduction cell's stride depends on
    the input: a node whose op and sources move with one label together."""

    def mutate(self, targets):
        src = self.choose(["l0", "l1"], label="src")
        op = self.choose(["tanh", "relu"], label="act")
        module = {("l1", "tanh"): nn.Tanh(), ("l1", "relu"): nn.ReLU(),
                  ("l0", "tanh"): nn.Hardtanh(), ("l0", "relu"): nn.LeakyReLU()}[src, op]
        self.replace("act", module)
        self.connect(src, "act", port=0)


def test_a_joint_node_is_exact_when_fixed_and_finite_when_weights_underflow():
    space = rt.ModelSpace(Chain(), [_OpFollowsInput()], example_input=torch.randn(1, 4))
    x = torch.randn(3, 4)
    relax, samples = _check_fixed_equals_build(space, x)
    assert len(samples) == 4
    act = next(p for p in relax.reading.nodes if p.name == "act")
    assert set(act.labels) == {"src", "act"} and len(act.variants) == 4
    # saturated choices: exp(-120) is 0 in float32, exp(-90) a denormal
    for mode, a in itertools.product(("softmax", "gumbel"), (60.0, 45.0, 23.0, 11.0)):
        relax.set_mode(mode, temperature=0.05)
        with torch.no_grad():
            relax.alpha("src").copy_(torch.tensor([a, -a]))
            relax.alpha("act").copy_(torch.tensor([-a, a]))
        relax.zero_grad()
        y = relax(x)
        y.square().sum().backward()
        assert torch.isfinite(y).all()
        assert all(torch.isfinite(p.grad).all() for p in relax.parameters() if p.grad is not None)
    relax.set_mode("softmax")
    with torch.no_grad():
        expected = relax.export({"src": "l0", "act": "relu"})(x)
    torch.testing.assert_close(relax(x), expected, rtol=1e-5, atol=1e-6)


def test_rescale_keeps_the_drawn_candidates_total_probability():
    from retiarii.optim.relax import rescale_drawn

    relax = Relaxation(_space(), mode="binary", paths=2, seed=0)
    before = {"op": torch.tensor([0.5, -0.3, 1.0]), "skip": torch.tensor([0.0, 0.2, -0.1])}
    with torch.no_grad():
        relax.alpha("op").copy_(torch.tensor([0.9, -0.3, 0.4]))  # a step moved 0 and 2
        relax.alpha("skip").copy_(before["skip"])
    relax.sampled = {"op": [0, 2], "skip": [0, 1, 2]}  # all of "skip": nothing to rescale
    rescale_drawn(relax, before)
    p_old, p_new = F.softmax(before["op"], -1), F.softmax(relax.alpha("op").detach(), -1)
    torch.testing.assert_close(p_new[1], p_old[1])  # the candidate not drawn keeps its share
    torch.testing.assert_close(p_new[0] + p_new[2], p_old[0] + p_old[2])
    a = relax.alpha("op").detach()
    assert float(a[0] - a[2]) == pytest.approx(0.5)
    torch.testing.assert_close(relax.alpha("skip").detach(), before["skip"])
