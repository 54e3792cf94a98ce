"""Model spaces: the paper's Inception example, replay, shared nodes, inline choices, errors."""
import math

import pytest
import torch
from torch import nn

import retiarii as rt

X = torch.randn(2, 1, 8, 8)


class Base(nn.Module):
    """The paper's base chain: conv -> relu -> maxpool -> dense."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(3, 1, 1)
        self.flat = nn.Flatten()
        self.dense = nn.Linear(8 * 64, 10)

    def forward(self, x):
        return self.dense(self.flat(self.pool(self.relu(self.conv(x)))))


OPS = {"conv": nn.Conv2d(8, 8, 3, padding=1), "dconv": nn.Conv2d(8, 8, 3, padding=1, groups=8),
       "pool": nn.MaxPool2d(3, 1, 1)}


class InceptionMutator(rt.Mutator):
    """Deletes the maxpool; creates n in {2..5} parallel paths merged by a sum."""

    def mutate(self, targets):
        relu, pool, flat = targets
        n = self.choose([2, 3, 4, 5], label="paths")
        self.delete_node(pool)
        merge = self.create_node("merge", rt.ops.Sum())
        for i in range(n):
            path = self.create_node(f"path{i}", self.choose(OPS, label=f"op{i}"))
            self.connect(relu, path)
            self.connect(path, merge)
        self.connect(merge, flat)


def inception_space():
    return rt.ModelSpace(Base(), [rt.apply_mutator(["relu", "pool", "flat"], InceptionMutator())],
                         example_input=X)


def test_inception_space_has_exactly_360_models_each_linted_and_run():
    space = inception_space()
    assert space.size() == 360 == 3 ** 2 + 3 ** 3 + 3 ** 4 + 3 ** 5
    assert space.size(exact=True) == 360
    hashes = set()
    for model in space.enumerate():
        model.graph.lint()
        out = model.to_module()(X)
        assert out.shape == (2, 10)
        hashes.add(model.structural_hash())
        n = model.sample["paths"]
        assert [k for k in model.sample if k.startswith("op")] == [f"op{i}" for i in range(n)]
    assert len(hashes) == 360


def test_replay_rebuilds_the_identical_graph():
    space = inception_space()
    for seed in range(10):
        model = space.random_sample(seed)
        again = space.replay(model.sample)
        assert again.structural_hash() == model.structural_hash()
        assert again.graph.to_json() == model.graph.to_json()  # uids and names too
        assert space.random_sample(seed).sample == model.sample


def test_shared_node_report_names_the_untouched_base_nodes():
    space = inception_space()
    a = space.replay({"paths": 2, "op0": "conv", "op1": "pool"})
    b = space.replay({"paths": 3, "op0": "pool", "op1": "pool", "op2": "dconv"})
    shared = {a.graph.node_by_uid(u).name for u in a.shared_nodes(b)}
    # the mutator deleted pool, rewired flat's input and created the paths and the merge
    assert shared == {"x", "conv", "relu", "dense", "output"}
    differing = a.differing_nodes(b)
    assert {a.graph.node_by_uid(u).name for u in differing if u in a.graph._nodes} >= {
        "flat", "merge", "path0", "path1"}
    base_uids = {n.uid for n in space.bases[0][0].nodes}
    assert a.shared_nodes(b) <= base_uids


def test_replay_rejects_samples_that_do_not_fit():
    space = inception_space()
    with pytest.raises(rt.SampleError, match="'op1'.*not among the candidates"):
        space.replay({"paths": 2, "op0": "conv", "op1": "bogus"})
    with pytest.raises(rt.SampleError, match="no value for choice 'op1'"):
        space.replay({"paths": 2, "op0": "conv"})
    with pytest.raises(rt.SampleError, match="never asks for.*'extra'"):
        space.replay({"paths": 2, "op0": "conv", "op1": "conv", "extra": 1})


class _Bad(rt.Mutator):
    def __init__(self, what):
        super().__init__()
        self.what = what

    def mutate(self, targets):
        if self.what == "delete-in-use":
            self.delete_node("pool")
        elif self.what == "cycle":
            self.connect("dense", "conv")
        elif self.what == "empty":
            self.choose([])


@pytest.mark.parametrize("what,pattern", [
    ("delete-in-use", r"_bad0.*'flat'.*delete_node\('pool'\)"),
    ("cycle", r"_bad0\.connect\('dense' -> 'conv'\).*cycle"),
    ("empty", r"_bad0\.choose: the list of candidates .*is empty"),
])
def test_bad_mutators_name_mutator_primitive_and_node(what, pattern):
    space = rt.ModelSpace(Base(), [_Bad(what)])
    with pytest.raises(rt.MutationError, match=pattern):
        space.random_sample(0)


def test_targets_that_match_nothing_name_the_closest_nodes():
    with pytest.raises(rt.TargetError, match=r"'relu9'.*closest node names: relu"):
        rt.ModelSpace(Base(), [rt.apply_mutator("relu9", InceptionMutator())]).random_sample(0)


def test_chain_pattern_matches_by_subgraph_isomorphism():
    seen = []

    class Spy(rt.Mutator):
        def mutate(self, targets):
            seen.append([[n.name for n in match] for match in targets])

    space = rt.ModelSpace(Base(), [rt.apply_mutator(rt.Chain(nn.ReLU, nn.MaxPool2d, "fl*"),
                                                    Spy())])
    space.random_sample(0)
    assert seen == [[["relu", "pool", "flat"]]]


class WidthMutator(rt.Mutator):
    """Replaces the conv by one of another width: the next layer no longer fits."""

    def mutate(self, targets):
        (conv,) = targets
        self.replace(conv, nn.Conv2d(1, self.choose([8, 16], label="width"), 3, padding=1))


def test_shape_mismatch_names_node_shapes_and_choices():
    space = rt.ModelSpace(Base(), [rt.apply_mutator("conv", WidthMutator())], example_input=X)
    space.instantiate({"width": 8})
    with pytest.raises(rt.ShapeMismatchError) as err:
        space.instantiate({"width": 16})
    e = err.value
    assert e.node == "dense" and e.choices == {} or e.node == "dense"
    assert "512 features" in str(e) and "[2, 1024]" in str(e)


def test_shape_mismatch_reports_the_choices_that_touched_the_node():
    class Pool(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)

        def forward(self, x):
            return self.bn(self.conv(x))

    space = rt.ModelSpace(Pool(), [rt.apply_mutator("conv", WidthMutator())], example_input=X)
    with pytest.raises(rt.ShapeMismatchError) as err:
        space.instantiate({"width": 16})
    assert err.value.node == "bn"
    assert err.value.choices == {"width": 16}
    assert "8 channels in dim 1" in str(err.value)


class LazyWidthMutator(rt.Mutator):
    """The documented way to change widths: lazy modules downstream adapt on their own."""

    def mutate(self, targets):
        conv, dense = targets
        self.replace(conv, nn.Conv2d(1, self.choose([8, 16], label="width"), 3, padding=1))
        self.replace(dense, nn.LazyLinear(10))


def test_lazy_modules_adapt_and_become_concrete():
    space = rt.ModelSpace(Base(), [rt.apply_mutator(["conv", "dense"], LazyWidthMutator())],
                          example_input=X)
    model = space.instantiate({"width": 16})
    assert model.graph["dense"].op.spec["cls"].endswith(":Linear")
    assert model.graph["dense"].op.spec["args"] == [1024, 10]
    assert model.to_module()(X).shape == (2, 10)


# ---- inline choices ------------------------------------------------------------------------


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.op = rt.LayerChoice({"a": nn.Conv2d(8, 8, 3, padding=1),
                                  "b": nn.Conv2d(8, 8, 5, padding=2)})

    def forward(self, x):
        return self.op(x) + x


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.op = rt.LayerChoice({"plain": nn.Identity(), "inner": Inner(),
                                  "pool": nn.MaxPool2d(3, 1, 1)})

    def forward(self, x):
        return torch.relu(self.op(x))


class InlineNet(nn.Module):
    def __init__(self):
        super().__init__()
        width = rt.ValueChoice([16, 32], label="width")
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.stage = rt.Repeat(lambda i: Block(), depth=(1, 3))
        self.skip = rt.InputChoice(2, 1)
        self.flat = nn.Flatten()
        self.fc1 = rt.nn.Linear(8 * 64, width)
        self.fc2 = rt.nn.Linear(width, 10)

    def forward(self, x):
        x = self.stem(x)
        z = self.skip([x, self.stage(x)])
        return self.fc2(torch.relu(self.fc1(self.flat(z))))


def test_inline_choices_nest_and_count_exactly():
    space = rt.ModelSpace(InlineNet(), example_input=X)
    # a block: plain, pool, or inner with 2 convs = 4 options; depth 1..3 -> 4 + 16 + 64;
    # skipping the stage (skip = 0) leaves only the width: the stage's choices are not made
    expected = (1 + 4 + 4 ** 2 + 4 ** 3) * 2
    assert space.size() == expected == space.size(exact=True)
    models = list(space.enumerate())
    assert len(models) == expected == len({m.structural_hash() for m in models})
    for model in models[::17]:
        inst = space.instantiate(model.sample)
        inst.graph.lint()
        assert inst.to_module()(X).shape == (2, 10)
        fc1, fc2 = inst.graph["fc1"].op.spec, inst.graph["fc2"].op.spec
        assert fc1["args"][1] == fc2["args"][0] == model.sample["width"]  # tied by object
        depth = model.sample.get("stage.depth", 0)
        assert (depth == 0) == (model.sample["skip"] == 0)
        assert not any(n.name.startswith("stage.") for n in inst.graph.nodes) or depth
        blocks = {k.split(".")[2] for k in model.sample if k.startswith("stage.blocks.")}
        assert blocks == {str(i) for i in range(depth)}  # conditional choices


def test_inline_model_runs_eagerly_as_its_first_options():
    net = InlineNet()
    assert net(X).shape == (2, 10)
    space = rt.ModelSpace(net)
    assert space.default_sample() == {"skip": 0, "width": 16}  # the stage is not used
    default = space.replay(space.default_sample())
    assert default.to_module()(X).shape == (2, 10)
    module = default.to_module()
    module.load_state_dict({k: v for k, v in net.state_dict().items() if k in
                            module.state_dict()})
    assert torch.equal(module(X), net(X))


class ThreeChoices(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = rt.LayerChoice([nn.ReLU(), nn.Tanh(), nn.Sigmoid()], label="a")
        self.b = rt.LayerChoice([nn.ReLU(), nn.Tanh(), nn.Sigmoid()], label="b")
        self.fc = rt.nn.Linear(4, rt.ValueChoice([2, 3], label="out"))

    def forward(self, x):
        return self.fc(self.b(self.a(x)))


class PlainThree(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.fc = nn.ReLU(), nn.ReLU(), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.b(self.a(x)))


class SameSpaceMutator(rt.Mutator):
    def mutate(self, targets):
        a, b, fc = targets
        acts = [nn.ReLU(), nn.Tanh(), nn.Sigmoid()]
        self.replace(a, self.choose(acts, label="a"))
        self.replace(b, self.choose(acts, label="b"))
        self.replace(fc, nn.Linear(4, self.choose([2, 3], label="out")))


def test_inline_and_mutator_apis_describe_the_same_space():
    inline = rt.ModelSpace(ThreeChoices())
    mutated = rt.ModelSpace(PlainThree(), [rt.apply_mutator(["a", "b", "fc"],
                                                            SameSpaceMutator())])
    assert inline.size() == mutated.size() == 18
    assert {m.structural_hash() for m in inline.enumerate()} == \
        {m.structural_hash() for m in mutated.enumerate()}
    for model in inline.enumerate():
        twin = mutated.replay(model.sample)
        x = torch.randn(3, 4)
        a, b = model.to_module(), twin.to_module()
        b.load_state_dict(a.state_dict())
        assert torch.equal(a(x), b(x))


def test_same_label_ties_choices_and_different_values_are_rejected():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = rt.LayerChoice([nn.ReLU(), nn.Tanh()], label="act")
            self.b = rt.LayerChoice([nn.ReLU(), nn.Tanh()], label="act")

        def forward(self, x):
            return self.b(self.a(x))

    space = rt.ModelSpace(Tied())
    assert space.size() == 2
    for model in space.enumerate():
        assert model.graph["a"].op.spec == model.graph["b"].op.spec


def test_several_bases_are_a_choice():
    space = rt.ModelSpace([Base(), PlainThree()])
    assert space.size() == 2
    assert {m.sample["base"] for m in space.enumerate()} == {"Base", "PlainThree"}


def test_hyperparameters_are_choices_of_the_space():
    space = rt.ModelSpace(Base()).with_hparams({"lr": rt.ValueChoice([0.1, 0.01]),
                                                "batch_size": 32})
    assert space.size() == 2
    models = list(space.enumerate())
    assert [m.hparams for m in models] == [{"lr": 0.1}, {"lr": 0.01}]
    assert space.replay({"lr": 0.01}).hparams == {"lr": 0.01}


def test_open_ended_space_is_unbounded():
    class Grow(rt.Mutator):
        open_ended = True

        def mutate(self, targets):
            self.choose([1, 2])

    space = rt.ModelSpace(Base(), [Grow()])
    assert space.size() == math.inf
    with pytest.raises(rt.SpaceError, match="unbounded"):
        next(space.enumerate())


def test_value_choice_refuses_python_control_flow():
    with pytest.raises(TypeError, match="truth value"):
        bool(rt.ValueChoice([1, 2]) > 1 if False else rt.ValueChoice([1, 2]))
    with pytest.raises(TypeError, match="not an int"):
        range(rt.ValueChoice([1, 2]))
    with pytest.raises(TypeError, match="cannot be compared"):
        rt.ValueChoice([1, 2]) * 2 >= 3


def test_a_choice_given_to_a_plain_torch_layer_names_its_retiarii_twin():
    # torch.nn.Dropout checks `p < 0` in Python: the error says to use rt.nn.Dropout
    with pytest.raises(TypeError, match=r"retiarii\.nn twin"):
        nn.Dropout(rt.ValueChoice([0.1, 0.3]))
    with pytest.raises(TypeError, match=r"retiarii\.nn twin"):
        nn.Dropout(rt.ValueChoice([0.1, 0.3]) * 2)  # arithmetic on it too
    assert rt.nn.Dropout(rt.ValueChoice([0.1, 0.3])).p == 0.1  # the twin: its first value


def test_build_gives_a_module_for_workers():
    space = inception_space()
    net = space.build({"paths": 2, "op0": "conv", "op1": "dconv"})
    assert isinstance(net, nn.Module) and net(X).shape == (2, 10)


# Three candidates Python calls equal (1 == True == 1.0) and a sample tells apart.
LOOKALIKE_OPS = {int: nn.Identity(), bool: nn.Tanh(), float: nn.Sigmoid()}


class LookalikeMutator(rt.Mutator):
    """Replaces the relu by an op that depends on the *type* of the chosen candidate."""

    def mutate(self, targets):
        relu, = targets
        value = self.choose([1, True, 1.0], label="x")
        self.replace(relu, LOOKALIKE_OPS[type(value)])


def test_replay_and_build_tell_look_alike_candidates_apart():
    """Issue #11.1: replay compares keys as JSON, so {"x": True} is True and {"x": 1.0} is 1.0,
    in ``replay`` and in ``build`` (what workers call) alike."""
    space = rt.ModelSpace(Base(), [rt.apply_mutator(["relu"], LookalikeMutator())],
                          example_input=X)
    assert space.size() == 3
    for key, op in ((1, nn.Identity), (True, nn.Tanh), (1.0, nn.Sigmoid)):
        model = space.replay({"x": key})
        assert model.sample == {"x": key} and type(model.sample["x"]) is type(key)
        assert rt.strategies.base.sample_key(model.sample) == \
            rt.strategies.base.sample_key({"x": key})
        for check in (True, False):
            net = space.build({"x": key}, check=check)
            assert type(net.relu) is op, (key, check)
    drawn = {rt.strategies.base.sample_key(m.sample): type(m.to_module().relu)
             for m in space.enumerate()}
    assert len(drawn) == 3 and len(set(drawn.values())) == 3


def test_sampler_docstring_examples_run():
    import doctest

    import retiarii.sampler

    result = doctest.testmod(retiarii.sampler)
    assert result.attempted > 0 and result.failed == 0
