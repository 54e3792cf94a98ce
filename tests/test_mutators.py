"""The built-in mutators on small real models.

Every test checks what changed against the base graph, lints, runs the emitted module, and
where it can compares the output with a hand-written reference that uses the same weights;
space sizes are compared with counts done by hand.
"""
from __future__ import annotations

import copy
import doctest
import math
import os
import re
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import retiarii as rt
from retiarii import ops
from retiarii.modspec import module_spec
from retiarii.mutators import (AddEdgeMutator, AddNodeMutator, ChangeActivationMutator,
                               InputMutator, InsertingMutator, OperatorMutator)

from model_spaces.nasnet import NASNet, genotype_of, nasnet_space

X = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
V = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


class ConvNet(nn.Module):
    """conv1 -> relu1 -> conv2 -> relu2 -> conv3 -> pool -> flatten -> fc; modules replaceable
    by keyword so the same class is the hand-written reference of a mutated model."""

    def __init__(self, conv2: nn.Module | None = None, conv3: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = conv2 or nn.Conv2d(8, 8, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.conv3 = conv3 or nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = self.relu2(self.conv2(self.relu1(self.conv1(x))))
        return self.fc(torch.flatten(self.pool(self.conv3(x)), 1))


def mlp() -> nn.Sequential:
    """input -> 0 -> 1 -> 2 -> 3 -> 4: Linear/ReLU of width 4, then Linear(4, 2)."""
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def run(model: rt.Model, x: torch.Tensor) -> tuple[nn.Module, torch.Tensor]:
    """Lint the model's graph, emit it, run it in eval mode."""
    model.graph.lint()
    module = model.to_module().eval()
    with torch.no_grad():
        return module, module(x)


def base_graph(space: rt.ModelSpace) -> rt.Graph:
    return space.bases[0][0]


def ops_by_uid(graph: rt.Graph) -> dict[int, tuple]:
    """uid -> (op data, input uids): what a node computes and from what."""
    return {n.uid: (n.op.to_data(), [i.uid for i in n.inputs]) for n in graph.nodes}


def changed(base: rt.Graph, graph: rt.Graph) -> set[str]:
    """Names of base nodes whose op or inputs differ in ``graph`` (or that are gone)."""
    now = ops_by_uid(graph)
    return {n.name for n in base.nodes if now.get(n.uid) != ops_by_uid(base)[n.uid]}


# ---- OperatorMutator -------------------------------------------------------------------------

CONV5 = nn.Conv2d(8, 8, 5, padding=2)
POOL = nn.MaxPool2d(3, 1, 1)
OPERATORS = {"conv5": CONV5, "pool": POOL, "identity": nn.Identity()}


def test_operator_mutator_replaces_exactly_the_targets_and_matches_reference():
    space = rt.ModelSpace(ConvNet(), [rt.apply_mutator("conv[23]", OperatorMutator(OPERATORS))])
    models = list(space.enumerate())
    assert space.size() == len(models) == 3 * 3
    assert len({m.structural_hash() for m in models}) == 9
    base = base_graph(space)
    for model in models:
        assert changed(base, model.graph) == {"conv2", "conv3"}
        module, out = run(model, X)
        key2, key3 = model.sample["operatormutator0/conv2"], model.sample["operatormutator0/conv3"]
        assert model.graph["conv2"].op.spec == module_spec(OPERATORS[key2])
        # The same architecture written by hand, with the emitted module's weights.
        ref = ConvNet(conv2=copy.deepcopy(OPERATORS[key2]),
                      conv3=copy.deepcopy(OPERATORS[key3])).eval()
        ref.load_state_dict(module.state_dict())
        torch.testing.assert_close(out, ref(X), rtol=0, atol=0)


def test_operator_mutator_labels_history_and_shared_choice():
    space = rt.ModelSpace(ConvNet(), [rt.apply_mutator(["conv2", "conv3"],
                                                       OperatorMutator(OPERATORS, label="op"))])
    model = space.random_sample(seed=3)
    assert list(model.sample) == ["op/conv2", "op/conv3"]
    prims = [(r["mutator"], r["primitive"]) for r in model.history]
    assert prims == [("op", "choose"), ("op", "replace"), ("op", "choose"), ("op", "replace")]
    assert model.history[1]["node"] == model.graph["conv2"].uid
    shared = rt.ModelSpace(ConvNet(), [rt.apply_mutator(
        "conv[23]", OperatorMutator(OPERATORS, shared=True, label="op"))])
    assert shared.size() == 3
    for model in shared.enumerate():
        assert list(model.sample) == ["op"]
        assert model.graph["conv2"].op.spec == model.graph["conv3"].op.spec


def test_shared_nodes_are_exactly_the_untouched_base_nodes():
    same_conv = nn.Conv2d(8, 8, 3, padding=1)  # equal to the base conv2/conv3: leaves them alone
    space = rt.ModelSpace(ConvNet(), [rt.apply_mutator(
        "conv[23]", OperatorMutator({"same": same_conv, "pool": POOL}))])
    keep2 = space.replay({"operatormutator0/conv2": "same", "operatormutator0/conv3": "pool"})
    both = space.replay({"operatormutator0/conv2": "pool", "operatormutator0/conv3": "pool"})
    base = base_graph(space)
    uids = {n.name: n.uid for n in base.nodes}
    assert keep2.shared_nodes(both) == set(uids.values()) - {uids["conv2"], uids["conv3"]}
    untouched = space.replay({"operatormutator0/conv2": "same", "operatormutator0/conv3": "same"})
    assert untouched.shared_nodes(untouched) == set(uids.values())
    assert untouched.structural_hash() == base.structural_hash()


# ---- InputMutator ----------------------------------------------------------------------------


def linear(module: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    sd = module.state_dict()
    return F.linear(x, sd[f"{name}.weight"], sd[f"{name}.bias"])


def test_input_mutator_chooses_predecessors_and_matches_reference():
    space = rt.ModelSpace(mlp(), [rt.apply_mutator("4", InputMutator(["input", "0", "1", "2"]))])
    models = list(space.enumerate())
    # the current input "3" first, then the candidates in graph order
    assert [m.sample["inputmutator0/4"] for m in models] == ["3", "input", "0", "1", "2"]
    assert space.size() == 5
    base = base_graph(space)
    for model in models:
        chosen = model.sample["inputmutator0/4"]
        assert model.graph["4"].inputs[0].name == chosen
        assert changed(base, model.graph) == (set() if chosen == "3" else {"4"})
        module, out = run(model, V)
        h = {"input": V}
        h["0"] = linear(module, "0", V)
        h["1"] = torch.relu(h["0"])
        h["2"] = linear(module, "2", h["1"])
        h["3"] = torch.relu(h["2"])
        torch.testing.assert_close(out, linear(module, "4", h[chosen]), rtol=0, atol=0)


def test_input_mutator_n_chosen_merges_with_the_reduction():
    space = rt.ModelSpace(mlp(), [rt.apply_mutator(
        "4", InputMutator(["input", "1", "2"], n_chosen=2, reduction="mean"))])
    models = list(space.enumerate())
    assert space.size() == len(models) == math.comb(4, 2)
    for model in models:
        names = model.sample["inputmutator0/4"].split(",")
        merge = model.graph["4"].inputs[0]
        assert merge.name == "4_inputs" and [i.name for i in merge.inputs] == names
        module, out = run(model, V)
        h = {"input": V, "1": torch.relu(linear(module, "0", V))}
        h["2"] = linear(module, "2", h["1"])
        h["3"] = torch.relu(h["2"])
        ref = linear(module, "4", (h[names[0]] + h[names[1]]) / 2)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_input_mutator_same_shape_and_acyclic():
    space = rt.ModelSpace(ConvNet(), [rt.apply_mutator("conv3", InputMutator())],
                          example_input=X)
    # earlier nodes of the shape of relu2's output (2, 8, 8, 8): conv1, relu1, conv2 (not x)
    assert [m.sample["inputmutator0/conv3"] for m in space.enumerate()] == \
        ["relu2", "conv1", "relu1", "conv2"]
    for model in space.enumerate():
        run(model, X)
    # every node offered: those downstream of the target would close a cycle, never offered
    anywhere = rt.ModelSpace(mlp(), [rt.apply_mutator("2", InputMutator("*"))])
    assert [m.sample["inputmutator0/2"] for m in anywhere.enumerate()] == ["1", "input", "0"]


def test_input_mutator_same_shape_needs_an_example_input():
    space = rt.ModelSpace(ConvNet(), [rt.apply_mutator("conv3", InputMutator())])
    with pytest.raises(rt.MutationError, match="inputmutator0.*example_input"):
        space.random_sample(0)


# ---- InsertingMutator ------------------------------------------------------------------------


def test_inserting_mutator_inserts_after_targets_or_nothing():
    bn = nn.BatchNorm2d(8)
    space = rt.ModelSpace(ConvNet(), [rt.apply_mutator(
        ["conv1", "conv2"], InsertingMutator({"none": None, "bn": bn, "tanh": torch.tanh}))])
    assert space.size() == 9
    base = base_graph(space)
    for model in space.enumerate():
        inserted = {t for t in ("conv1", "conv2")
                    if model.sample[f"insertingmutator0/{t}"] != "none"}
        # the users of a target (relu1, relu2) now read the inserted node
        assert changed(base, model.graph) == {"relu1" if t == "conv1" else "relu2"
                                              for t in inserted}
        for t in inserted:
            new = model.graph[f"{t}_inserted"]
            assert new.inputs == [model.graph[t]] and model.graph[t].users == [new]
        module, out = run(model, X)
        if not inserted:
            assert model.structural_hash() == base.structural_hash()
        if model.sample == {"insertingmutator0/conv1": "bn", "insertingmutator0/conv2": "tanh"}:
            sd = module.state_dict()
            h = F.relu(F.batch_norm(F.conv2d(X, sd["conv1.weight"], sd["conv1.bias"], padding=1),
                                    sd["conv1_inserted.running_mean"],
                                    sd["conv1_inserted.running_var"],
                                    sd["conv1_inserted.weight"], sd["conv1_inserted.bias"]))
            h = F.relu(torch.tanh(F.conv2d(h, sd["conv2.weight"], sd["conv2.bias"], padding=1)))
            h = F.conv2d(h, sd["conv3.weight"], sd["conv3.bias"], padding=1)
            ref = F.linear(h.mean((2, 3)), sd["fc.weight"], sd["fc.bias"])
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_lazy_modules_adapt_channels_where_fixed_ones_mismatch():
    widen = InsertingMutator({"none": None, "wide": nn.Conv2d(8, 16, 1)})
    fixed = rt.ModelSpace(ConvNet(), [rt.apply_mutator("conv1", widen)], example_input=X)
    with pytest.raises(rt.ShapeMismatchError) as err:
        fixed.instantiate({"insertingmutator0/conv1": "wide"})
    assert err.value.node == "conv2"
    assert "16" in str(err.value.actual) and "8 channels" in str(err.value.expected)
    assert err.value.choices == {"insertingmutator0/conv1": "wide"}
    lazy = rt.ModelSpace(ConvNet(conv2=nn.LazyConv2d(8, 3, padding=1)),
                         [rt.apply_mutator("conv1", widen)], example_input=X)
    for key, channels in (("none", 8), ("wide", 16)):
        model = lazy.instantiate({"insertingmutator0/conv1": key})
        spec = model.graph["conv2"].op.spec
        assert spec["cls"].endswith(":Conv2d") and spec["args"][0] == channels
        assert model.graph["conv2"].meta["shape"] == [2, 8, 8, 8]
        run(model, X)


def test_operator_mutator_width_change_raises_shape_mismatch_naming_node():
    space = rt.ModelSpace(ConvNet(), [rt.apply_mutator(
        "conv2", OperatorMutator({"wide": nn.Conv2d(8, 16, 3, padding=1), "pool": POOL}))],
        example_input=X)
    space.instantiate({"operatormutator0/conv2": "pool"})
    with pytest.raises(rt.ShapeMismatchError, match="'conv3'.*operatormutator0/conv2"):
        space.instantiate({"operatormutator0/conv2": "wide"})


# ---- evolving mutators -----------------------------------------------------------------------


def test_add_node_mutator_splits_each_edge():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    space = rt.ModelSpace(net, [AddNodeMutator({"tanh": nn.Tanh(), "id": nn.Identity()})])
    edges = ["input->0", "0->1", "1->2", "2->output"]
    models = list(space.enumerate())
    assert space.size() == len(models) == len(edges) * 2
    assert [m.sample["addnodemutator0/edge0"] for m in models[::2]] == edges
    for model in models:
        src, dst = model.sample["addnodemutator0/edge0"].split("->")
        new = model.graph["addnodemutator0_0"]
        assert new.inputs == [model.graph[src]] and model.graph[dst].inputs == [new]
        module, out = run(model, V)
        if model.sample == {"addnodemutator0/edge0": "1->2", "addnodemutator0/op0": "tanh"}:
            ref = linear(module, "2", torch.tanh(torch.relu(linear(module, "0", V))))
            torch.testing.assert_close(out, ref, rtol=0, atol=0)
    two = rt.ModelSpace(net, [AddNodeMutator([nn.Tanh(), nn.Identity()], steps=2)])
    assert two.size() == two.size(exact=True) == (4 * 2) * (5 * 2)


def test_add_edge_mutator_adds_acyclic_skips_through_sum():
    space = rt.ModelSpace(mlp(), [AddEdgeMutator()], example_input=V)
    models = list(space.enumerate())
    # destinations in order; sources: earlier nodes of the same shape (3, 4) not feeding it
    pairs = [(m.sample["addedgemutator0/dst0"], m.sample["addedgemutator0/src0"])
             for m in models]
    assert pairs == [("1", "input"), ("2", "input"), ("2", "0"), ("3", "input"), ("3", "0"),
                     ("3", "1"), ("4", "input"), ("4", "0"), ("4", "1"), ("4", "2")]
    assert space.size() == len(pairs)
    for model, (dst, src) in zip(models, pairs):
        merge = model.graph[f"{dst}_merge"]
        assert model.graph[dst].inputs == [merge] and merge.inputs[1].name == src
        module, out = run(model, V)
        if (dst, src) == ("4", "0"):
            h0 = linear(module, "0", V)
            h3 = torch.relu(linear(module, "2", torch.relu(h0)))
            torch.testing.assert_close(out, linear(module, "4", h3 + h0), rtol=0, atol=0)


def test_add_edge_into_a_variadic_node_appends_an_input():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.s, self.fc = nn.Linear(4, 4), nn.Linear(4, 4), ops.Sum(), \
                nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(self.s(self.a(x), self.b(x)))

    space = rt.ModelSpace(Two(), [rt.apply_mutator("s", AddEdgeMutator())], example_input=V)
    assert [m.sample["addedgemutator0/src0"] for m in space.enumerate()] == ["x"]
    model = space.random_sample(0)
    assert [i.name for i in model.graph["s"].inputs] == ["a", "b", "x"]
    module, out = run(model, V)
    ref = linear(module, "fc", linear(module, "a", V) + linear(module, "b", V) + V)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert len(base_graph(space)["s"].inputs) == 2  # the base graph is not edited in place


def test_change_activation_mutator_changes_one_activation():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Sigmoid())
    space = rt.ModelSpace(net, [ChangeActivationMutator([nn.ReLU(), torch.tanh, torch.sin])])
    models = list(space.enumerate())
    # relu -> tanh or sin (not itself); sigmoid -> any of the three
    assert space.size() == len(models) == 2 + 3
    base = base_graph(space)
    for model in models:
        node = model.sample["changeactivationmutator0/node0"]
        assert changed(base, model.graph) == {node}
        module, out = run(model, V)
        acts = {"1": torch.relu, "3": torch.sigmoid}
        acts[node] = {"ReLU": torch.relu, "torch.tanh": torch.tanh,
                      "torch.sin": torch.sin}[model.sample["changeactivationmutator0/act0"]]
        ref = acts["3"](linear(module, "2", acts["1"](linear(module, "0", V))))
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_open_ended_mutators_grow_without_bound():
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    space = rt.ModelSpace(net, [AddNodeMutator([nn.Tanh(), torch.sin], steps=None),
                                ChangeActivationMutator([nn.ReLU(), torch.tanh], steps=None)])
    assert space.open_ended and space.size() == math.inf
    with pytest.raises(rt.SpaceError, match="unbounded"):
        next(space.enumerate())
    grow = {"addnodemutator0/grow0": True, "addnodemutator0/edge0": "0->1",
            "addnodemutator0/op0": "torch.sin", "addnodemutator0/grow1": True,
            "addnodemutator0/edge1": "addnodemutator0_0->1", "addnodemutator0/op1": "Tanh",
            "addnodemutator0/grow2": False,
            "changeactivationmutator1/grow0": True,
            "changeactivationmutator1/node0": "addnodemutator0_1",
            "changeactivationmutator1/act0": "ReLU", "changeactivationmutator1/grow1": False}
    model = space.replay(grow)
    assert [n.name for n in model.graph.nodes] == \
        ["input", "0", "addnodemutator0_0", "addnodemutator0_1", "1", "2", "output"]
    module, out = run(model, V)
    ref = linear(module, "2", torch.relu(torch.relu(torch.sin(linear(module, "0", V)))))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    ungrown = space.replay({"addnodemutator0/grow0": False,
                            "changeactivationmutator1/grow0": False})
    assert ungrown.structural_hash() == base_graph(space).structural_hash()


# ---- bad input -------------------------------------------------------------------------------


class DeleteInUse(rt.Mutator):
    def mutate(self, targets):
        self.delete_node(targets[0])


class Cycle(rt.Mutator):
    def mutate(self, targets):
        self.connect("conv3", targets[0])


@pytest.mark.parametrize("mutator, words", [
    (DeleteInUse(label="deleter"), ["deleter", "delete_node", "'relu1'", "'conv2'"]),
    (Cycle(label="cycler"), ["cycler", "connect", "'conv3'", "'relu1'", "cycle"]),
    (OperatorMutator([], label="empty"), ["empty", "choose", "relu1", "empty"]),
    (InputMutator(["nowhere"], label="inputs"), ["inputs", "relu1", "nowhere"]),
])
def test_bad_mutators_name_mutator_primitive_and_node(mutator, words):
    space = rt.ModelSpace(ConvNet(), [rt.apply_mutator("relu1", mutator)])
    with pytest.raises(rt.MutationError) as err:
        space.random_sample(0)
    for word in words:
        assert word in str(err.value)


def test_replay_of_a_foreign_sample_raises_sample_error():
    space = rt.ModelSpace(ConvNet(), [rt.apply_mutator("conv2", OperatorMutator(OPERATORS))])
    with pytest.raises(rt.SampleError, match="no value for choice 'operatormutator0/conv2'"):
        space.replay({"other/label": "pool"})
    with pytest.raises(rt.SampleError, match="'conv9' is not among the candidates"):
        space.replay({"operatormutator0/conv2": "conv9"})
    with pytest.raises(rt.SampleError, match="never asks for.*extra"):
        space.replay({"operatormutator0/conv2": "pool", "extra": 1})


# ---- the NASNet-like space -------------------------------------------------------------------


def test_nasnet_space_equals_the_hand_written_network():
    space = nasnet_space(channels=4, num_cells=2, in_channels=1, image_size=8)
    assert space.size() == (2 * 5 * 3 * 5 * 4 * 5 * 5 * 5 * 6 * 5) ** 2
    for seed in range(3):
        model = space.random_sample(seed)
        genotype = genotype_of(model.sample)
        ref = NASNet(genotype, channels=4, num_cells=2, in_channels=1)
        assert model.structural_hash() == rt.trace(ref).structural_hash()
        module, out = run(space.instantiate(model.sample), torch.randn(2, 1, 8, 8))
        ref.load_state_dict(module.state_dict())
        x = torch.randn(2, 1, 8, 8)
        torch.testing.assert_close(module(x), ref.eval()(x), rtol=0, atol=0)


def test_nasnet_space_one_block_enumerates_by_hand_count():
    # two cells: in the first, pre0 and pre1 both read the stem (equal structures)
    space = nasnet_space(channels=2, num_cells=2, num_blocks=1, in_channels=1, image_size=4)
    models = list(space.enumerate())
    assert space.size() == len(models) == (2 * 5) ** 2
    assert len({m.structural_hash() for m in models}) == 100


# ---- documentation -----------------------------------------------------------------------------


def test_docs_spaces_md_code_runs():
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "spaces.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) >= 5
    # run as a module of its own, as a user's file: classes defined there are importable
    page = types.ModuleType("docs_spaces_md")
    sys.modules[page.__name__] = page
    try:
        for block in blocks:
            exec(compile(block, "docs/spaces.md", "exec"), page.__dict__)
    finally:
        del sys.modules[page.__name__]


@pytest.mark.parametrize("module", ["retiarii.mutators.input", "retiarii.mutators.operator",
                                    "retiarii.mutators.inserting", "retiarii.mutators.evolving",
                                    "model_spaces.nasnet"])
def test_docstring_examples_run(module):
    import importlib

    import retiarii.mutators as mutators

    names = {"rt": rt, "nn": nn, "torch": torch,
             **{k: getattr(mutators, k) for k in mutators.__all__}}
    result = doctest.testmod(importlib.import_module(module), extraglobs=names,
                             optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
