"""Inline choices: InputChoice with or without repeated inputs, choices made unreachable by an
input choice, Cell, the base model of a space, evolution that starts from it."""
import itertools

import pytest
import torch
from torch import nn

import retiarii as rt
from retiarii.mutators import AddEdgeMutator, AddNodeMutator, ChangeActivationMutator
from retiarii.strategies import RegularizedEvolution

V = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))


def distinct_models(space: rt.ModelSpace) -> list[rt.Model]:
    """Every model of the space, checked to be different from each other."""
    models = list(space.enumerate())
    assert len({m.structural_hash() for m in models}) == len(models)
    return models


# ---- InputChoice(n_chosen=k): distinct inputs, or repeats ----------------------------------


class Pick(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 5), nn.Linear(4, 6)
        self.pick = rt.InputChoice(3, 2, reduction="concat", label="pick", **kwargs)

    def forward(self, x):
        return self.pick([self.a(x), self.b(x), self.c(x)])


def test_input_choice_keeps_distinct_inputs_by_default():
    space = rt.ModelSpace(Pick())
    models = distinct_models(space)
    assert space.size() == len(models) == 3  # {a,b}, {a,c}, {b,c}
    assert [m.sample["pick"] for m in models] == ["0,1", "0,2", "1,2"]
    net = Pick()
    assert torch.equal(net(V), torch.cat([net.a(V), net.b(V)], 1))
    with pytest.raises(ValueError, match="n_chosen=4"):
        rt.InputChoice(3, 4)


def test_input_choice_with_repeats_counts_multisets_and_computes_them():
    space = rt.ModelSpace(Pick(distinct=False))
    models = distinct_models(space)
    assert space.size() == space.size(exact=True) == len(models) == 6  # C(3 + 2 - 1, 2)
    assert [m.sample["pick"] for m in models] == ["0,0", "0,1", "0,2", "1,1", "1,2", "2,2"]
    net = Pick(distinct=False)
    assert torch.equal(net(V), torch.cat([net.a(V), net.a(V)], 1))  # eagerly: the first
    for model in models:
        model.graph.lint()
        module = model.to_module()
        kept = [int(i) for i in model.sample["pick"].split(",")]
        weights = {k: v for k, v in net.state_dict().items() if k in module.state_dict()}
        module.load_state_dict(weights)
        layers = [net.a, net.b, net.c]
        assert torch.equal(module(V), torch.cat([layers[i](V) for i in kept], 1))
        # the input that is not kept is not computed
        assert {n.name for n in model.graph.nodes} >= {"abc"[i] for i in kept}
        assert not {n.name for n in model.graph.nodes} & {"abc"[i] for i in range(3)
                                                          if i not in kept}
    assert rt.InputChoice(2, 3, distinct=False).subsets()[:2] == [(0, 0, 0), (0, 0, 1)]


# ---- choices made unreachable by an input choice ----------------------------------------------


class Act(nn.Module):
    def __init__(self, label):
        super().__init__()
        self.op = rt.LayerChoice([nn.ReLU(), nn.Tanh()], label=label)

    def forward(self, x):
        return self.op(x)


class Branches(nn.Module):
    """outer picks a(x) or inner; inner picks the Repeat b(x) or c(x); p is used only in c."""

    def __init__(self):
        super().__init__()
        self.a = rt.LayerChoice([nn.ReLU(), nn.Tanh(), nn.Sigmoid()], label="a")
        self.b = rt.Repeat(lambda i: Act(f"b{i}"), depth=(1, 2), label="depth")
        self.c = rt.LayerChoice({"lin": nn.Linear(4, 4), "neg": nn.Hardtanh()}, label="c")
        self.drop = rt.nn.Dropout(rt.ValueChoice([0.1, 0.5], label="p"))
        self.inner = rt.InputChoice(2, 1, label="inner")
        self.outer = rt.InputChoice(2, 1, label="outer")
        self.fc = rt.nn.Linear(4, rt.ValueChoice([2, 3], label="out"))

    def forward(self, x):
        inner = self.inner([self.b(x), self.drop(self.c(x))])
        return self.fc(self.outer([self.a(x), inner]))


def test_unreachable_choices_leave_the_sample_and_the_size():
    space = rt.ModelSpace(Branches(), example_input=V)
    models = distinct_models(space)
    # outer=a: a * out = 6; outer=inner: (b: depth 1 or 2 -> 2 + 4, c: c * p = 4) * out = 20
    assert space.size() == space.size(exact=True) == len(models) == 26
    for model in models:
        sample = model.sample
        if sample["outer"] == 0:
            assert set(sample) == {"outer", "a", "out"}
        elif sample["inner"] == 0:
            assert set(sample) == {"outer", "inner", "depth", "out"} | {
                f"b{i}" for i in range(sample["depth"])}
        else:
            assert set(sample) == {"outer", "inner", "c", "p", "out"}
        names = {n.name for n in model.graph.nodes}
        assert ("a" in names) == (sample["outer"] == 0)  # what is not used is not there
        assert ("drop" in names) == ("p" in sample)
        inst = space.instantiate(sample)
        inst.graph.lint()
        assert inst.to_module()(V).shape == (3, sample["out"])
    with pytest.raises(rt.SampleError, match="never asks for.*'c'"):
        space.replay({"outer": 0, "a": "ReLU", "out": 2, "c": "lin"})


def test_unreachable_choices_leave_random_samples_too():
    space = rt.ModelSpace(Branches(), example_input=V)
    for seed in range(8):
        model = space.random_sample(seed)
        assert space.replay(model.sample).structural_hash() == model.structural_hash()


# ---- Cell ----------------------------------------------------------------------------------


class CellNet(nn.Module):
    def __init__(self, label=None):
        super().__init__()
        self.stem0 = nn.Conv2d(3, 4, 1)
        self.stem1 = nn.Conv2d(3, 4, 3, padding=1)
        self.cell = rt.Cell({"conv": lambda: nn.Conv2d(4, 4, 3, padding=1),
                             "pool": lambda: nn.MaxPool2d(3, 1, 1)},
                            num_nodes=2, num_predecessors=2, label=label)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.cell(self.stem0(x), self.stem1(x)).mean((2, 3)))


def test_cell_counts_and_runs_its_choices():
    x = torch.randn(2, 3, 6, 6)
    space = rt.ModelSpace(CellNet(label="normal"), example_input=x)
    models = distinct_models(space)
    # node 0: 2 inputs x 2 ops; node 1: 3 inputs x 2 ops
    assert space.size() == len(models) == (2 * 2) * (3 * 2)
    assert set(models[0].sample) == {"normal/op0_0", "normal/input0_0", "normal/op1_0",
                                     "normal/input1_0"}
    net = CellNet()
    default = rt.ModelSpace(net, example_input=x).base_model().to_module()
    # every node reads the cell's first input by default: the second one is not computed
    assert "stem1.weight" not in default.state_dict()
    # a LayerChoice's first option runs eagerly; its weights are the chosen node's
    weights = {k.replace(".options.0.", "."): v for k, v in net.state_dict().items()}
    default.load_state_dict({k: v for k, v in weights.items() if k in default.state_dict()})
    assert torch.equal(default(x), net(x))  # eagerly: the first options
    for model in models[::5]:
        assert space.build(model.sample)(x).shape == (2, 10)
    with pytest.raises(ValueError, match="merge"):
        rt.Cell([nn.Identity], 2, merge="loose_end")


# ---- the base model of a space; evolution that starts from it ----------------------------------


def wann_space() -> rt.ModelSpace:
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    return rt.ModelSpace(mlp, [AddNodeMutator([nn.Tanh(), torch.sin], steps=None),
                               AddEdgeMutator(steps=None),
                               ChangeActivationMutator([nn.ReLU(), nn.Sigmoid()], steps=None)],
                         example_input=torch.randn(2, 4))


def test_base_model_of_an_evolving_space_is_the_traced_base():
    space = wann_space()
    base = space.base_model()
    assert base.structural_hash() == rt.trace(nn.Sequential(
        nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))).structural_hash()
    assert space.default_sample() == base.sample == {
        "addnodemutator0/grow0": False, "addedgemutator1/grow0": False,
        "changeactivationmutator2/grow0": False}
    assert space.replay(space.default_sample()).structural_hash() == base.structural_hash()


def test_evolution_can_grow_its_first_population_from_the_base_model():
    space = wann_space()
    base = space.default_sample()
    s = RegularizedEvolution(population_size=6, sample_size=2, initial="base", seed=0)
    proposals = []
    for i in range(6):
        proposals.append(s.ask(space))
        s.tell(proposals[-1], float(i))
    assert proposals[0] == base
    for child in proposals[1:]:  # children of the base: one of its choices changed
        assert sum(child.get(label) != value for label, value in base.items()) == 1
    # the option is part of the saved configuration (and absent by default)
    assert s.state_dict()["config"]["initial"] == "base"
    assert "initial" not in RegularizedEvolution(6, 2).state_dict()["config"]
    again = RegularizedEvolution(population_size=6, sample_size=2, initial="base", seed=0)
    again.load_state_dict(s.state_dict())
    assert again.ask(space) == s.ask(space)
    with pytest.raises(ValueError, match="initial"):
        RegularizedEvolution(population_size=6, sample_size=2, seed=0).load_state_dict(
            s.state_dict())
    with pytest.raises(ValueError, match="'random' or 'base'"):
        RegularizedEvolution(initial="zeros")


def test_all_inline_choice_kinds_count_with_itertools():
    """size() against a count by hand of a space mixing every kind, arithmetic included."""
    width = rt.ValueChoice([2, 4], label="w")

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = rt.nn.Linear(4, width * 2)
            self.act = rt.LayerChoice([nn.ReLU(), nn.Tanh()], label="act")
            self.fc2 = rt.nn.Linear(width * 2, 4)
            self.skip = rt.InputChoice(2, 2, reduction="mean", label="skip", distinct=False)

        def forward(self, x):
            return self.skip([x, self.fc2(self.act(self.fc1(x)))])

    space = rt.ModelSpace(Mixed(), example_input=V)
    by_hand = len(list(itertools.product([2, 4], ["ReLU", "Tanh"]))) * 2 + 1
    # skip "0,0" uses x only: w and act are not chosen; "0,1" and "1,1" use the MLP
    assert space.size() == len(distinct_models(space)) == by_hand
    model = space.instantiate({"skip": "0,1", "w": 4, "act": "Tanh"})
    assert model.graph["fc1"].op.spec["args"] == [4, 8]


def test_a_layer_choice_candidate_that_is_a_repeat_keeps_its_depth_choice():
    # traced as a candidate's root, a Repeat ran its eager forward (its first depth) and its
    # choice was silently lost: every sample built one layer
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = rt.LayerChoice({
                "deep": rt.Repeat(lambda i: nn.Linear(4, 4), depth=[1, 2, 3], label="d"),
                "flat": nn.Identity()}, label="kind")

        def forward(self, x):
            return self.body(x)

    space = rt.ModelSpace(Net(), example_input=torch.randn(2, 4))
    samples = [m.sample for m in space.enumerate()]
    assert {s.get("d") for s in samples if s["kind"] == "deep"} == {1, 2, 3}
    x = torch.randn(2, 4)
    for depth in (1, 2, 3):
        model = space.instantiate({"kind": "deep", "d": depth}).to_module()
        params = dict(model.named_parameters())  # the emitter inlines the linears' calls
        weights = sorted(k for k in params if k.endswith("weight"))
        assert len(weights) == depth and len(params) == 2 * depth
        reference = x
        for name in weights:
            reference = nn.functional.linear(reference, params[name],
                                             params[name[:-len("weight")] + "bias"])
        assert torch.equal(model(x), reference)


def test_a_repeats_first_listed_depth_is_its_default_as_every_choices_first_candidate():
    # the eager module and the space's base model run the first depth listed (EfficientNet's
    # space lists B0's count first so that its default model is B0)
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.r = rt.Repeat(lambda i: nn.Linear(4, 4), depth=[3, 1, 2], label="d")

        def forward(self, x):
            return self.r(x)

    net = Net()
    space = rt.ModelSpace(net, example_input=torch.randn(2, 4))
    assert [m.sample for m in space.enumerate()] == [{"d": 3}, {"d": 1}, {"d": 2}]
    assert space.base_model().sample == {"d": 3}
    x = torch.randn(2, 4)
    reference = x
    for block in net.r.blocks:
        reference = block(reference)
    assert torch.equal(net(x), reference)  # all three blocks
