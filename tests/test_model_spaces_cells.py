"""The cell-based, recurrent, text and evolving spaces of model_spaces/ and the strategies they
need (Predictor, Progressive).

tests/test_model_spaces.py already puts every implemented row's small preset through size,
random samples, one training step and the export round trip, and builds every paper preset.
Here: what each space's docstring promises (its rules, its published sizes), the recurrent
and text models on sequence data, the evolving spaces over many random mutation chains, and
the rows' strategies on their spaces.
"""
from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

import retiarii as rt
from retiarii import nas
from retiarii.strategies import Progressive, RegularizedEvolution


def names(model, prefix: str) -> set[str]:
    return {n.name[len(prefix):] for n in model.graph.nodes if n.name.startswith(prefix)}


def runs(space, model) -> torch.Tensor:
    model.graph.lint()
    x = torch.zeros((2,) + tuple(space.example_input.shape[1:]), dtype=space.example_input.dtype)
    return model.to_module().eval()(x)


def train(net, x, y, steps: int, lr: float = 1e-2) -> float:
    """``steps`` full-batch Adam steps; the final training accuracy."""
    torch.manual_seed(0)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    for _ in range(steps):
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return (net(x).argmax(1) == y).float().mean().item()


# ---- Genetic CNN -------------------------------------------------------------------------------


def genetic_sample(bits: dict[tuple[int, int], int]) -> dict:
    sample = {f"s{s}/{i}-{j}": 0 for s, k in enumerate((3, 4, 5), 1)
              for j in range(2, k + 1) for i in range(1, j)}
    sample.update({f"s1/{i}-{j}": b for (i, j), b in bits.items()})
    return sample


def test_genetic_cnn_stage_rules():
    from model_spaces import genetic_cnn as g

    space = g.small()
    assert space.size() == g.paper().size() == g.PUBLISHED_SIZE == 2 ** 19
    # stage 1: 1 -> 2 only; node 3 isolated and dropped; node 2 feeds the output
    model = space.instantiate(genetic_sample({(1, 2): 1}))
    stage = "stages.0."
    assert names(model, stage) >= {"inp", "n1", "n2", "sum1", "sum2", "out_sum", "out"}
    assert not names(model, stage) & {"n3", "sum3"}
    graph = model.graph
    assert [n.name for n in graph[stage + "sum1"].inputs] == [stage + "inp"]
    assert [n.name for n in graph[stage + "sum2"].inputs] == [stage + "n1"]
    assert [n.name for n in graph[stage + "out_sum"].inputs] == [stage + "n2"]
    # all bits 0: input -> output (every numbered node dropped)
    empty = space.instantiate(genetic_sample({}))
    assert [n.name for n in empty.graph[stage + "out_sum"].inputs] == [stage + "inp"]
    assert not any(n.startswith("n") for n in names(empty, stage))
    # all bits 1: the base model itself
    full = space.instantiate(genetic_sample({(1, 2): 1, (1, 3): 1, (2, 3): 1}))
    assert [n.name for n in full.graph[stage + "out_sum"].inputs] == [stage + "n3"]
    for model in (model, empty, full):
        assert runs(space, model).shape == (2, 10)


# ---- ENAS ----------------------------------------------------------------------------------------


def test_enas_macro_size_is_the_published_one_and_skips_follow_the_bits():
    from model_spaces import enas

    assert enas.macro_paper().size() == enas.PUBLISHED_MACRO_SIZE == 6 ** 12 * 2 ** 66
    space = enas.macro_small()
    assert space.size() == 6 ** 6 * 2 ** 15
    sample = {}
    for layer in range(1, 7):
        sample[f"layer{layer}/op"] = "sep_conv_5x5" if layer == 3 else "conv_3x3"
        for j in range(layer - 1):
            sample[f"layer{layer}/skip{j}"] = int(j == 0)  # only skips from the stem
    model = space.instantiate(sample)
    # skips from the stem into layers 3..6, pooled to layers past a reduction (after 2, 4)
    assert names(model, "skip") == {"0_3", "0_4", "0_5", "0_6"}
    assert [n.name for n in model.graph["sum3"].inputs] == ["op3", "skip0_3"]
    assert [n.name for n in model.graph["sum2"].inputs] == ["op2", "stem"]
    assert "SepConv" in model.graph["op3"].op.spec["cls"]
    assert runs(space, model).shape == (2, 10)


def test_enas_micro_inputs_may_repeat_and_reductions_stride_on_cell_inputs():
    from model_spaces import enas

    space = enas.small()
    assert space.size() == enas.MICRO_SIZE
    sample = dict(space.random_sample(seed=0).sample)
    sample.update({"reduce/n0/input_a": 1, "reduce/n0/input_b": 1,
                   "reduce/n0/op_a": "identity", "reduce/n0/op_b": "max_pool_3x3",
                   "reduce/n1/input_a": 2, "reduce/n1/op_a": "identity"})
    model = space.instantiate(sample)
    spec = {n.name: n.op.spec for n in model.graph.nodes if n.op.spec}
    assert "FactorizedReduce" in spec["cells.1.n0_a"]["cls"]  # identity on s1, stride 2
    assert [n.name for n in model.graph["cells.1.n0_b"].inputs] == ["cells.1.pre1.2"]
    # loose ends only: node 0 is read by node 1, node 4 by no one
    ends = [n.name for n in model.graph["cells.1.out"].inputs]
    assert "cells.1.n0" not in ends and "cells.1.n4" in ends
    assert "Identity" in spec["cells.1.n1_a"]["cls"]  # on node 0, already halved
    assert runs(space, model).shape == (2, 10)


# ---- recurrent cells -------------------------------------------------------------------------------


def test_recurrent_sizes_and_cell_outputs():
    from model_spaces import recurrent as r

    assert r.enas_small().size() == r.ENAS_SIZE == 4 ** 12 * math.factorial(11)
    assert r.darts_small().size() == r.DARTS_SIZE == 4 ** 8 * math.factorial(8)
    # ENAS: the mean of the loose ends; nodes 2 and 3 read node 1, node 4 reads node 3
    genotype = [("tanh", -1), ("relu", 1), ("identity", 1), ("sigmoid", 3)]
    net = r.RecurrentNet(5, 6, genotype, "enas")
    assert net.outputs == [2, 4]
    # DARTS: the mean of every node; one step computed by hand agrees
    net = r.RecurrentNet(5, 6, [("relu", 0), ("sigmoid", 1)], "darts")
    x, h = torch.randn(3, 5), torch.randn(3, 6)
    gate, value = net.entry(torch.cat([x, h], 1)).chunk(2, 1)
    c = torch.sigmoid(gate)
    states = [c * torch.tanh(value) + (1 - c) * h]
    for (act, src), layer in zip([(torch.relu, 0), (torch.sigmoid, 1)], net.nodes):
        gate, value = layer(states[src]).chunk(2, 1)
        c = torch.sigmoid(gate)
        states.append(c * act(value) + (1 - c) * states[src])
    assert torch.allclose(net.step(x, h), (states[1] + states[2]) / 2)


@pytest.mark.parametrize("preset", ["enas_small", "darts_small"])
def test_recurrent_cells_learn_a_synthetic_sequence_task(preset):
    from model_spaces import recurrent as r

    # which of the two halves of a sequence of 8 steps has the larger sum (2 classes)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1, 8, 4, generator=generator)
    y = (x[:, 0, :4].sum((1, 2)) > x[:, 0, 4:].sum((1, 2))).long()
    space = r.recurrent_space(preset[:-6], 16, 1, 2, image_size=4)
    space.example_input = torch.zeros(1, 1, 8, 4)
    net = space.build(space.random_sample(seed=3).sample)
    assert train(net, x, y, steps=80) > 0.75


# ---- TextNAS ---------------------------------------------------------------------------------------


def test_textnas_every_op_builds_and_skips_follow_the_bits():
    from model_spaces import textnas as t

    space = t.textnas_space(vocab=8, dim=8, num_layers=3, num_classes=2, from_pixels=False,
                            seq_len=12)
    assert space.size() == t.count(3) == 8 ** 3 * 2 ** 3
    for op in t.OP_NAMES:
        sample = {"layer1/op": op, "layer2/op": "attention", "layer2/skip0": 0,
                  "layer3/op": "gru", "layer3/skip0": 1, "layer3/skip1": 0}
        model = space.instantiate(sample)
        assert [n.name for n in model.graph["sum2"].inputs] == ["op2"]
        assert [n.name for n in model.graph["sum3"].inputs] == ["op3", "embed"]
        assert runs(space, model).shape == (2, 2)


def test_textnas_learns_a_synthetic_token_task():
    from model_spaces import textnas as t

    # is token 1 more frequent than token 2 in a sequence of 12 tokens of 6?
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, 6, (256, 12), generator=generator)
    y = ((x == 1).sum(1) > (x == 2).sum(1)).long()
    space = t.textnas_space(vocab=6, dim=16, num_layers=2, num_classes=2, from_pixels=False,
                            seq_len=12)
    net = space.build({"layer1/op": "conv_1", "layer2/op": "avg_pool", "layer2/skip0": 1})
    assert train(net, x, y, steps=80) > 0.8


# ---- one-shot, hierarchical, PNAS ------------------------------------------------------------------


def test_oneshot_blocks_keep_their_chosen_inputs_and_ops():
    from model_spaces import oneshot as o

    space = o.small()
    assert space.size() == o.SIZE
    sample = {"block0/inputs": "0+1", "block0/ops": "identity",
              "block1/inputs": "2", "block1/ops": "conv_1x1+max_pool_3x3",
              "block2/inputs": "1+3", "block2/ops": "sep_conv_7x7",
              "block3/inputs": "4", "block3/ops": "sep_conv_3x3+avg_pool_3x3"}
    model = space.instantiate(sample)
    cell = "cells.2."
    assert [n.name for n in model.graph[cell + "in1"].inputs] == [cell + "b0"]
    assert [n.name for n in model.graph[cell + "in2"].inputs] == [cell + "pre1", cell + "b1"]
    assert {n for n in names(model, cell + "b1_")} == {"conv_1x1", "max_pool_3x3"}
    assert runs(space, model).shape == (2, 10)


def test_hierarchical_trivial_genotype_is_the_base_and_an_empty_cell_is_identity():
    from model_spaces import hierarchical as h

    space = h.small()
    assert space.size() == h.SIZE == 7 ** 46
    assert all(record["primitive"] == "choose" for record in space.base_model().history)
    motifs, _ = h.trivial_genotype()
    cell = h.HierarchicalCell(4, motifs, [h.NONE] * 10).eval()
    x = torch.randn(2, 4, 5, 5)
    assert torch.equal(cell(x), x)
    # a cell of one motif edge 0 -> 4, the motif a max pool 0 -> 3
    motifs[1] = [h.NONE] * 3 + ["max_pool_3x3"] + [h.NONE] * 2  # edges: 01 02 12 03 13 23
    cell = h.HierarchicalCell(4, motifs, [h.NONE] * 6 + ["motif2"] + [h.NONE] * 3).eval()
    assert torch.equal(cell(x), F.max_pool2d(x, 3, 1, 1))


def test_pnas_blocks_choice_opens_the_blocks():
    from model_spaces import pnas

    space = pnas.small()
    assert space.size() == pnas.count() == 556_869_504_614_656
    sample = {"blocks": 2, "b0/input_a": 0, "b0/op_a": "identity", "b0/input_b": 1,
              "b0/op_b": "conv_1x7_7x1", "b1/input_a": 2, "b1/op_a": "dil_conv_3x3",
              "b1/input_b": 2, "b1/op_b": "sep_conv_7x7"}
    model = space.instantiate(sample)
    assert {n for n in names(model, "cells.0.") if n[:2] == "b2"} == set()
    assert len(model.graph["cells.0.out"].inputs) == 2
    assert runs(space, model).shape == (2, 10)
    with pytest.raises(rt.SampleError):
        space.replay({**sample, "b2/op_a": "identity"})  # block 2 does not exist


# ---- evolving spaces -----------------------------------------------------------------------------


class Chain:
    """A random mutation chain: each grow choice continues with probability ``p``."""

    def __init__(self, seed: int, p: float):
        self.rng, self.p = random.Random(seed), p

    def choose(self, label, candidates, context):
        if "/grow" in label:
            return int(self.rng.random() < self.p)
        return self.rng.randrange(len(candidates))


EVOLVING = {"wann": "wann", "path_level": "path", "large_scale_evolution": "lse"}  # label prefix


@pytest.mark.parametrize("name", EVOLVING)
def test_evolving_spaces_start_minimal_and_every_mutation_chain_builds(name):
    space = nas.build_space(name, "small")
    assert space.open_ended and space.size() == math.inf
    base = space.base_model()  # the minimal model: growth stops at once
    assert [k for k in base.sample if "/grow" in k] == [f"{EVOLVING[name]}/grow0"]
    assert all(record["primitive"] == "choose" for record in base.history)
    lengths = []
    for seed in range(25):
        model = space.sample(Chain(seed, 0.9))
        space.check_shapes(model)
        assert runs(space, model).shape == (2, 10)
        again = space.instantiate(json.loads(json.dumps(model.sample)))
        assert again.structural_hash() == model.structural_hash()
        lengths.append(sum(1 for k in model.sample if "/grow" in k) - 1)
    assert max(lengths) >= 10  # long chains too


@pytest.mark.parametrize("name", EVOLVING)
def test_a_grown_model_trains_a_step(name):
    space = nas.build_space(name, "small")
    model = space.sample(Chain(1, 0.8))
    net = space.build(model.sample)
    from retiarii.engine.trainers.trainer import load_dataset

    x, y = load_dataset("digits")
    before = [p.detach().clone() for p in net.parameters()]
    loss = F.cross_entropy(net(x[:32]), y[:32])
    loss.backward()
    torch.optim.Adam(net.parameters(), lr=1e-2).step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(b, p) for b, p in zip(before, net.parameters()))


def exported_equals(space, model) -> None:
    """The model's exported source, run in a fresh namespace with the model's weights,
    computes what the model does."""
    torch.manual_seed(0)
    net = model.to_module().eval()
    namespace: dict = {"__name__": "exported"}
    exec(compile(model.graph.to_source("Exported"), "<exported>", "exec"), namespace)
    exported = namespace["Exported"]().eval()
    exported.load_state_dict(net.state_dict())
    x = torch.rand((3,) + tuple(space.example_input.shape[1:]))
    with torch.no_grad():
        assert torch.equal(exported(x), net(x))


@pytest.mark.parametrize("name", EVOLVING)
def test_a_long_grown_model_exports(name):
    space = nas.build_space(name, "small")
    model = space.sample(Chain(7, 0.9))
    space.check_shapes(model)
    assert sum(1 for k in model.sample if "/grow" in k) > 5
    exported_equals(space, model)


def test_the_enas_macro_space_exports():
    from model_spaces import enas

    space = enas.macro_small()
    exported_equals(space, space.instantiate(space.random_sample(seed=2).sample))


def test_wann_has_one_shared_weight_read_by_every_connection():
    space = nas.build_space("wann", "small")
    model = space.sample(Chain(4, 0.9))
    net = space.build(model.sample)
    assert [name for name, _ in net.named_parameters()] == ["weight"]
    connections = [n for n in model.graph.nodes if n.kind == "module" and
                   n.op.spec["cls"].endswith(":Connection")]
    assert len(connections) > 1
    assert all(c.inputs[1].name == "weight" for c in connections)


@pytest.mark.parametrize("name", ["wann", "large_scale_evolution", "hierarchical"])
def test_evolution_rows_start_from_the_base_model(name):
    strategy = nas.strategy(name, seed=0)
    assert isinstance(strategy, RegularizedEvolution) and strategy.initial == "base"
    good, bad = 0.5, 0.1
    if name == "wann":  # WANN ranks by its three objectives (mean, connections, max)
        strategy.use_objectives(("max", "min", "max"), ("val_acc", "connections", "val_acc_max"))
        good, bad = (0.5, 3, 0.6), (0.1, 5, 0.2)
    space = nas.build_space(name, "small")
    first = strategy.ask(space)
    if name == "hierarchical":  # the paper's: the trivial genotype diversified by mutations
        trivial = space.default_sample()
        assert first.keys() == trivial.keys() and first != trivial
    else:
        assert first == space.default_sample()
    strategy.tell(first, good)
    for _ in range(3):  # children of the base: one choice away (hierarchical: diversified)
        child = strategy.ask(space)
        space.instantiate(child)
        strategy.tell(child, bad)


# ---- the predictor rows --------------------------------------------------------------------------


def test_progressive_grows_the_pnas_cell_block_by_block():
    space = nas.build_space("pnas", "small")
    strategy = nas.strategy("pnas", seed=0)
    assert isinstance(strategy, Progressive) and strategy.beam == 4
    depths = []
    for _ in range(12):
        sample = strategy.ask(space)
        depths.append(sample["blocks"])
        # a toy objective: more blocks and more convolutions are better
        strategy.tell(sample, sample["blocks"] + sum("conv" in str(v) for v in sample.values()))
    assert depths == [1] * 4 + [2] * 4 + [3] * 4
    restored = Progressive(depth_label="blocks", beam=4, n_candidates=64, seed=5,
                           surrogate="ensemble")
    restored.load_state_dict(json.loads(json.dumps(strategy.state_dict())))
    assert restored.ask(space) == strategy.ask(space)


def test_neural_predictor_row_proposes_nasbench101_cells_from_its_gcn():
    from retiarii.strategies import NeuralPredictor

    space = nas.build_space("neural_predictor", "small")
    strategy = nas.strategy("neural_predictor", seed=0)
    assert isinstance(strategy, NeuralPredictor) and strategy.n_train == 5
    for _ in range(8):
        sample = strategy.ask(space)
        space.instantiate(sample)
        strategy.tell(sample, sum(v == "conv3x3-bn-relu" for v in sample.values()))
    assert strategy.state_dict()["algorithm"]["rounds"] == 1


@pytest.mark.parametrize("module", ["genetic_cnn", "enas", "recurrent", "textnas", "oneshot",
                                    "hierarchical", "pnas", "wann", "path_level",
                                    "large_scale_evolution"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"model_spaces.{module}"))
    assert result.attempted > 0 and result.failed == 0
