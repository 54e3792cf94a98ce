"""The paper-specific mechanics of the `nas` rows that issue #31 made faithful: each test checks
what its paper describes against a hand computation or an invariant the paper relies on."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from retiarii import nas

# ---- Neural Predictor (Wen et al., ECCV 2020): a GCN over the cell's graph ------------------


def test_gcn_forward_on_a_three_node_cell_equals_a_hand_computation():
    from retiarii.strategies.multi_trial.neural_predictor import GCN, batch_graphs

    # input -> conv -> output, and input -> output
    adjacency = [[0, 1, 1], [0, 0, 1], [0, 0, 0]]
    types = ["input", "conv", "output"]
    gcn = GCN(features=3, hidden=2, layers=1)
    with torch.no_grad():
        gcn.fwd[0].weight.copy_(torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, -1.0]]))
        gcn.fwd[0].bias.copy_(torch.tensor([0.5, 0.0]))
        gcn.bwd[0].weight.copy_(torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]))
        gcn.bwd[0].bias.copy_(torch.tensor([0.0, -0.5]))
        gcn.head[0].weight.copy_(torch.tensor([[1.0, 1.0], [1.0, -1.0]]))
        gcn.head[0].bias.copy_(torch.tensor([0.0, 0.0]))
        gcn.head[2].weight.copy_(torch.tensor([[2.0, 3.0]]))
        gcn.head[2].bias.copy_(torch.tensor([0.25]))
    got = gcn(*batch_graphs([(adjacency, types)], types)).item()

    # by hand: X = I (one type each); forward A+I rows normalized, backward (A^T + I) likewise
    x = np.eye(3)
    a = np.array(adjacency, float)
    f = (a + np.eye(3)) / (a + np.eye(3)).sum(1, keepdims=True)
    # f = [[1/3,1/3,1/3],[0,1/2,1/2],[0,0,1]]; b = [[1,0,0],[1/2,1/2,0],[1/3,1/3,1/3]]
    b = (a.T + np.eye(3)) / (a.T + np.eye(3)).sum(1, keepdims=True)
    hf = x @ np.array([[1, 0, 2], [0, 1, -1]]).T + [0.5, 0]   # rows: nodes
    hb = x @ np.array([[0, 1, 1], [1, 0, 0]]).T + [0, -0.5]
    h = np.maximum((f @ hf + b @ hb) / 2, 0)
    pooled = h.mean(0)
    hidden = np.maximum(np.array([[1, 1], [1, -1]]) @ pooled, 0)
    expected = float(np.array([2, 3]) @ hidden + 0.25)
    assert got == pytest.approx(expected, rel=1e-6)


def test_gcn_gives_isomorphic_cells_the_same_prediction_and_padding_changes_nothing():
    from retiarii.strategies.multi_trial.neural_predictor import GCN, batch_graphs

    types = ["input", "conv3x3-bn-relu", "maxpool3x3", "output"]
    adjacency = np.array([[0, 1, 1, 0], [0, 0, 0, 1], [0, 0, 0, 1], [0, 0, 0, 0]])
    nodes = ["input", "conv3x3-bn-relu", "maxpool3x3", "output"]
    perm = [3, 0, 2, 1]  # node i of the permuted cell is node perm[i] of the first
    permuted = adjacency[np.ix_(perm, perm)]
    torch.manual_seed(0)
    gcn = GCN(len(types), hidden=8, layers=3)
    small = (np.eye(2, dtype=int)[[1, 0]].tolist(), ["input", "output"])  # pads the batch
    out = gcn(*batch_graphs([(adjacency.tolist(), nodes),
                             (permuted.tolist(), [nodes[p] for p in perm]), small], types))
    assert out[0].item() == pytest.approx(out[1].item(), abs=1e-6)
    alone = gcn(*batch_graphs([(adjacency.tolist(), nodes)], types))
    assert alone[0].item() == pytest.approx(out[0].item(), abs=1e-6)
    # and the structure matters: the same nodes without the pool's edges predict otherwise
    cut = adjacency.copy()
    cut[0, 2] = cut[2, 3] = 0
    other = gcn(*batch_graphs([(cut.tolist(), nodes)], types))
    assert other[0].item() != pytest.approx(out[0].item(), abs=1e-6)


def test_cell_graph_prunes_to_the_vertices_on_an_input_output_path():
    from model_spaces.nasbench101 import cell_graph

    sample = {f"op{v}": "conv1x1-bn-relu" for v in range(1, 6)}
    sample.update({"op2": "maxpool3x3", "edge01": 1, "edge02": 1, "edge26": 1, "edge13": 1})
    adjacency, types = cell_graph(sample)  # vertex 1 -> 3 dead-ends: 1 and 3 pruned
    assert types == ["input", "maxpool3x3", "output"]
    assert adjacency == [[0, 1, 0], [0, 0, 1], [0, 0, 0]]


def test_neural_predictor_trains_on_n_random_cells_then_proposes_its_top_k_ranked():
    from retiarii.strategies import NeuralPredictor

    space = nas.build_space("neural_predictor", "small")

    def score(sample):  # a toy accuracy: convolutions on the pruned cell
        from model_spaces.nasbench101 import cell_graph
        return sum(t.startswith("conv3x3") for t in cell_graph(sample)[1])

    def make():
        return NeuralPredictor(graph="model_spaces.nasbench101:cell_graph",
                               types=["input", "conv3x3-bn-relu", "conv1x1-bn-relu",
                                      "maxpool3x3", "output"],
                               n_train=12, n_candidates=150, top_k=4, epochs=150, seed=1)

    strategy, asked = make(), []
    for i in range(16):
        sample = strategy.ask(space)
        asked.append(sample)
        strategy.tell(sample, score(sample))
        if i == 11:  # the next ask fits the GCN on these 12 and ranks 150 new cells
            copy = make()
            copy.load_state_dict(json.loads(json.dumps(strategy.state_dict())))
    assert strategy.state_dict()["algorithm"]["rounds"] == 1
    # the predicted best are better than the random cells the predictor learnt from
    first, ranked = [score(s) for s in asked[:12]], [score(s) for s in asked[12:]]
    assert np.mean(ranked) > np.mean(first) + 1
    # and a restored strategy makes the same round (the GCN's fit is seeded)
    assert [copy.ask(space) for _ in range(4)] == asked[12:]


# ---- PNAS (Liu et al., ECCV 2018): an MLP ensemble refitted at each block level -------------


def test_pnas_ensemble_predicts_the_mean_of_members_trained_on_different_folds():
    from retiarii.strategies.multi_trial.pnas_predictor import fit_ensemble

    samples = [{"blocks": 1, "b0/input_a": a, "b0/op_a": op} for a in range(2)
               for op in ("conv", "pool", "skip", "sep")] * 2
    y = [float(s["b0/op_a"] == "conv") + 0.1 * s["b0/input_a"] for s in samples]
    ensemble = fit_ensemble(samples, y, seed=0)
    assert len(ensemble.models) == 5
    # each member left out its own fifth: 5 different training sets covering all the data
    assert len({tuple(f) for f in ensemble.folds}) == 5
    assert all(len(f) == len(samples) - len(samples[i::5]) for i, f in
               enumerate(ensemble.folds))
    members = ensemble.member_predictions(samples)
    assert ensemble.predict(samples) == pytest.approx(members.mean(0).tolist(), abs=1e-6)
    assert not torch.allclose(members[0], members[1])  # the members differ
    # a cell of 2 blocks is scored too: the mean over blocks of the block embeddings
    two = {"blocks": 2, "b0/input_a": 0, "b0/op_a": "conv", "b1/input_a": 2, "b1/op_a": "conv"}
    assert len(ensemble.predict([two])) == 1


def test_pnas_row_grows_block_by_block_and_refits_its_ensemble_at_each_level(monkeypatch):
    from retiarii.strategies import Progressive
    from retiarii.strategies.multi_trial import pnas_predictor

    fits = []
    real = pnas_predictor.fit_ensemble

    def counting(samples, y, seed, candidates=()):
        fits.append((len(samples), sorted({c["blocks"] for c in candidates})))
        return real(samples, y, seed, candidates)

    monkeypatch.setattr(pnas_predictor, "fit_ensemble", counting)
    space = nas.build_space("pnas", "small")
    strategy = nas.strategy("pnas", seed=0)
    assert isinstance(strategy, Progressive) and strategy.surrogate == "ensemble"
    depths = []
    for _ in range(12):
        sample = strategy.ask(space)
        depths.append(sample["blocks"])
        strategy.tell(sample, sample["blocks"] + sum("conv" in str(v) for v in sample.values()))
    assert depths == [1] * 4 + [2] * 4 + [3] * 4
    # one fit per level, on every cell told so far, ranking that level's expansions
    assert fits == [(4, [2]), (8, [3])]


@pytest.mark.parametrize("module", ["retiarii.strategies.multi_trial.neural_predictor",
                                    "retiarii.strategies.multi_trial.pnas_predictor",
                                    "model_spaces.nasbench101", "model_spaces.nasnet_search",
                                    "retiarii.strategies.multi_trial.hierarchical_evolution"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


# ---- NASNet / AmoebaNet: normal and reduction cells over the 13 operations -----------------


def nasnet_genotype(sample: dict, kind: str) -> list[tuple]:
    return [tuple(sample[f"{kind}/b{i}/{f}"] for f in ("input_a", "op_a", "input_b", "op_b"))
            for i in range(5)]


def test_nasnet_space_offers_the_13_operations_in_both_cells_and_each_builds():
    from model_spaces import nasnet_search as ns
    from retiarii.strategies.base import draw
    from retiarii.sampler import RandomSampler
    import random

    assert len(set(ns.OP_NAMES)) == 13
    trace = dict(draw(nas.build_space("nasnet", "small"), RandomSampler(random.Random(0))).trace)
    for kind in ("normal", "reduce"):
        for i in range(5):
            assert trace[f"{kind}/b{i}/op_a"] == list(ns.OP_NAMES)
            assert trace[f"{kind}/b{i}/input_b"] == list(range(i + 2))  # pre0, pre1, blocks
    x = torch.randn(2, 4, 8, 8)
    for name in ns.OP_NAMES:
        for stride in (1, 2):
            assert ns.make_op(name, 4, stride)(x).shape == (2, 4, 8 // stride, 8 // stride)


def test_nasnet_reduction_cells_halve_the_resolution_double_the_channels_and_cells_concat_unused():
    space = nas.build_space("amoebanet", "small")
    assert nas.get("amoebanet").module == nas.get("nasnet").module
    for seed in range(3):
        sample = space.random_sample(seed=seed).sample
        net = space.instantiate(sample).to_module().eval()
        blocks, outs = {}, {}
        for i in range(5):
            net.get_submodule(f"cells.{i}.b4").register_forward_hook(
                lambda m, a, o, i=i: blocks.__setitem__(i, tuple(o.shape[1:])))
            net.get_submodule(f"cells.{i}.out").register_forward_hook(
                lambda m, a, o, i=i: outs.__setitem__(i, o.shape[1]))
        net(torch.zeros(2, 1, 8, 8))
        # normal, reduction, normal, reduction, normal: (C, H, W) of each cell's blocks
        assert [blocks[i] for i in range(5)] == [(8, 8, 8), (16, 4, 4), (16, 4, 4),
                                                 (32, 2, 2), (32, 2, 2)]
        from model_spaces.nasnet_search import unused
        for i, kind in enumerate(["normal", "reduce", "normal", "reduce", "normal"]):
            width = blocks[i][0]
            assert outs[i] == width * len(unused(nasnet_genotype(sample, kind)))


def test_a_sampled_nasnet_trains_on_digits():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images[:256], dtype=torch.float32)[:, None] / 16
    y = torch.tensor(digits.target[:256])
    space = nas.build_space("nasnet", "small")
    net = space.instantiate(space.random_sample(seed=1).sample).to_module().train()
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_amoebanet_mutates_one_hidden_state_or_one_op_of_one_cell_by_aging_evolution():
    from retiarii.strategies import RegularizedEvolution

    space = nas.build_space("amoebanet", "small")
    strategy = nas.strategy("amoebanet", seed=0)
    assert isinstance(strategy, RegularizedEvolution)
    kinds = set()
    for n in range(40):
        sample = strategy.ask(space)
        parent = strategy.parent_of(sample)
        if n >= strategy.population_size:  # past the initial population: a child
            changed = [k for k in sample if sample[k] != parent[k]]
            assert len(changed) == 1
            kind, _, what = changed[0].split("/")
            kinds.add((kind, "hidden state" if what.startswith("input") else "op"))
        strategy.tell(sample, float(sum(v == "sep_conv_3x3" for v in sample.values())))
    assert kinds == {(k, m) for k in ("normal", "reduce") for m in ("hidden state", "op")}


# ---- Hierarchical representations (Liu et al., ICLR 2018) -----------------------------------


def test_hierarchical_nodes_concatenate_their_inputs_then_a_1x1_conv():
    from model_spaces import hierarchical as h

    x = torch.randn(2, 4, 5, 5)
    # node 1 <- identity(0); node 2 <- max_pool(0), identity(1): concat, then 1x1 conv
    motif = h.Motif(3, {(0, 1): h.primitive("identity", 4), (0, 2): h.primitive(
        "max_pool_3x3", 4), (1, 2): h.primitive("identity", 4)}, 4).eval()
    assert list(motif.merge) == ["2"] and motif.merge["2"].in_channels == 8
    expected = torch.nn.functional.conv2d(
        torch.cat([torch.nn.functional.max_pool2d(x, 3, 1, 1), x], dim=1),
        motif.merge["2"].weight)
    torch.testing.assert_close(motif(x), expected)


def test_hierarchical_mutation_picks_a_level_then_a_motif_edge_and_changes_its_op():
    import collections
    import random

    from retiarii.strategies import HierarchicalEvolution
    from retiarii.strategies.multi_trial.hierarchical_evolution import pick_edge

    space = nas.build_space("hierarchical", "small")
    labels = list(space.default_sample())
    levels = {**{f"motif{m}": 2 for m in range(1, 7)}, "cell": 3}
    rng = random.Random(0)
    picks = collections.Counter(pick_edge(labels, levels, rng).split("/")[0] for _ in range(3000))
    # a level first (1/2 each), not a label among 46 (the cell's 10 would get 10/46)
    assert abs(picks["cell"] / 3000 - 0.5) < 0.05
    assert all(abs(picks[f"motif{m}"] / 3000 - 0.5 / 6) < 0.03 for m in range(1, 7))
    strategy = nas.strategy("hierarchical", seed=0)
    assert isinstance(strategy, HierarchicalEvolution) and strategy.initial == "base"
    assert strategy.diversify == 1000 and strategy.population_size == 8
    trivial = space.default_sample()
    for n in range(12):
        sample = strategy.ask(space)
        if n < 8:  # the paper's initial population: trivial genotypes, 1000 mutations each
            assert strategy.parent_of(sample) is None
            changed = [k for k in sample if sample[k] != trivial[k]]
            # 1000 mutations over 46 edges leave few at their first candidate (each edge
            # is hit ~20 times; 1/7 of them end at identity or motif1 again)
            assert len(changed) > 30, changed
        else:  # then children: one edge of the parent changed
            parent = strategy.parent_of(sample)
            changed = [k for k in sample if sample[k] != parent[k]]
            assert len(changed) == 1
        strategy.tell(sample, float(n))


def test_hierarchical_diversification_is_the_papers_mutation_repeated():
    # with 1 mutation a member is the trivial genotype with one edge changed; with 0 the
    # population grows as RegularizedEvolution's from the base (the base itself first)
    from retiarii.strategies import HierarchicalEvolution

    space = nas.build_space("hierarchical", "small")
    trivial = space.default_sample()
    levels = {**{f"motif{m}": 2 for m in range(1, 7)}, "cell": 3}
    one = HierarchicalEvolution(4, 2, levels=levels, initial="base", diversify=1, seed=3)
    for _ in range(4):
        sample = one.ask(space)
        assert len([k for k in sample if sample[k] != trivial[k]]) == 1
    none = HierarchicalEvolution(4, 2, levels=levels, initial="base", diversify=0, seed=3)
    assert none.ask(space) == trivial
    with pytest.raises(ValueError, match="diversify"):
        HierarchicalEvolution(4, 2, levels=levels, diversify=-1)
    # resumed: the same draws after a state round trip
    a = HierarchicalEvolution(4, 2, levels=levels, initial="base", seed=5)
    first = a.ask(space)
    b = HierarchicalEvolution(4, 2, levels=levels, initial="base", seed=5)
    b.load_state_dict(a.state_dict())
    assert first != trivial and a.ask(space) == b.ask(space)
