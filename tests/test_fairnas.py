"""FairNAS and SCARLET-NAS: strict fairness (K paths, every candidate once, summed gradients,
one optimizer step), NSGA-II parents over (accuracy, latency), the latency bound of the
selection, and SCARLET-NAS's scalable skip (a linear 1x1 map that trains)."""
from __future__ import annotations

import collections
import random

import pytest
import torch

from one_shot_task import BEST, LinearTask, assert_numbers, make_space, roundtrip, run
from retiarii.strategies import FairNAS
from retiarii.strategies.one_shot.fairnas import fair_paths, summed_step
from retiarii.strategies.one_shot.shared_training import SharedTraining


def test_a_fair_step_uses_every_candidate_of_every_choice_once():
    space = make_space()  # op: 3 candidates, act: 2
    for seed in range(5):
        models = fair_paths(space, random.Random(seed))
        assert len(models) == 3  # K = the most candidates of a choice
        assert sorted(m.sample["op"] for m in models) == ["linear", "skip", "zero"]
        acts = collections.Counter(m.sample["act"] for m in models)
        assert set(acts) == {"identity", "relu"}  # 2 candidates over 3 paths: 2 + 1


def _grads(shared):
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in shared.supergraph.named_parameters()}


def test_one_optimizer_step_per_k_paths_from_the_summed_gradients():
    space, trainer = make_space(), LinearTask()
    shared = SharedTraining(space, trainer, {}, torch.device("cpu"), seed=0)
    models = fair_paths(space, random.Random(1))
    for m in models:  # every path's operators in the pool before the reference
        shared.net(m)
    batch = trainer.train_dataloader({}, 0)[0]
    # the reference: each path's gradient alone, summed by hand
    expected = None
    for m in models:
        shared.optimizer.zero_grad(set_to_none=True)
        net = shared.net(m)
        net.train()
        loss = trainer.training_step(net, batch, {})
        if loss.requires_grad:  # (a path of zero or skip has nothing to train)
            loss.backward()
        g = _grads(shared)
        expected = g if expected is None else {n: expected[n] + g[n] for n in g}
    steps, seen = [], {}
    step = shared.optimizer.step

    def counting_step(*args, **kwargs):
        steps.append(1)
        seen.update(_grads(shared))
        return step(*args, **kwargs)

    shared.optimizer.step = counting_step
    before = {n: p.detach().clone() for n, p in shared.supergraph.named_parameters()}
    summed_step(shared, models, batch)
    assert len(steps) == 1
    assert expected.keys() == seen.keys()
    for name in expected:
        assert torch.allclose(seen[name], expected[name], atol=1e-6), name
    # the linear candidate (used by one path) moved; nothing steps twice
    moved = [n for n, p in shared.supergraph.named_parameters() if not torch.equal(p, before[n])]
    assert moved


def test_a_training_segment_steps_once_per_batch_over_k_paths_each():
    s = FairNAS(train_segments=1, search_population=2, search_generations=1, seed=0)
    space, trainer = make_space(), LinearTask(batches=5)
    s.setup(space, trainer, {}, torch.device("cpu"))
    calls = []
    step = s._shared.optimizer.step
    s._shared.optimizer.step = lambda *a, **k: (calls.append(1), step(*a, **k))[1]
    result = run(s, space, trainer, range(1))[0]
    assert result.metrics["steps"] == result.metrics["batches"] == len(calls) == 5
    assert result.metrics["paths"] == 15


@pytest.mark.parametrize("seed", [0, 1])
def test_fairnas_finds_the_best_model_and_resumes_to_the_same_choice(seed):
    s = FairNAS(train_segments=3, search_population=4, search_generations=2, search_parents=2,
                eval_batches=2, seed=seed)
    space, trainer = make_space(), LinearTask()
    s.setup(space, trainer, {}, torch.device("cpu"))
    results = run(s, space, trainer)
    assert_numbers(results)
    assert s.selected() == BEST
    again = FairNAS(**s.config())
    again.setup(space, trainer, {}, torch.device("cpu"))
    again.load_state_dict(roundtrip(s.state_dict()))
    assert again.selected() == BEST and again.config() == s.config()


def test_parents_by_nsga_ii_over_accuracy_and_latency_and_the_latency_bound():
    latency = {"op": {"linear": 3.0, "zero": 0.0, "skip": 1.0}, "act": {"relu": 0.5}}
    s = FairNAS(search_parents=3, latency=latency, max_latency=2.0)
    s.setup(make_space(), LinearTask(), {}, torch.device("cpu"))
    members = {  # (val_acc, latency) by hand
        "a": ({"op": "linear", "act": "identity"}, 0.9),   # (0.9, 3.0)  front 0
        "b": ({"op": "skip", "act": "identity"}, 0.5),     # (0.5, 1.0)  front 0
        "c": ({"op": "zero", "act": "identity"}, 0.1),     # (0.1, 0.0)  front 0
        "d": ({"op": "skip", "act": "relu"}, 0.4),         # (0.4, 1.5)  dominated by b
        "e": ({"op": "linear", "act": "relu"}, 0.3),       # (0.3, 3.5)  dominated by a, d
    }
    s._evaluated = {k: (sample, {"val_acc": acc}) for k, (sample, acc) in members.items()}
    assert s.latency_of(members["e"][0]) == 3.5
    # front 0 is {a, b, c}: a and c at the ends (infinite crowding), b inside
    assert s._parents() == [members["a"][0], members["c"][0], members["b"][0]]
    # the most accurate within 2.0 ms is b (a is faster than nothing but over the bound)
    assert s.selected() == members["b"][0]
    s.max_latency = None
    assert s.selected() == members["a"][0]


def test_a_latency_table_naming_no_choice_is_refused():
    s = FairNAS(latency={"opp": {"linear": 1.0}})
    with pytest.raises(ValueError, match="'opp' is not a choice of the space"):
        s.setup(make_space(), LinearTask(), {}, torch.device("cpu"))


def test_scarlet_nas_skip_is_a_linear_map():
    from model_spaces import proxylessnas

    space = proxylessnas.small("scarlet_nas")
    net = space.build({**space.default_sample(), "layer2": "skip"})
    skips = dict(net.named_modules())
    # the skip is the LET's 1x1 conv, C -> C, no bias, and nothing after it (no BN, no act)
    conv = skips["layers.2.skip.conv"]
    assert isinstance(conv, torch.nn.Conv2d) and conv.kernel_size == (1, 1)
    assert conv.in_channels == conv.out_channels == 8 and conv.bias is None
    assert [n for n in skips if n.startswith("layers.2.skip.")] == ["layers.2.skip.conv"]
    let = proxylessnas.ScalableSkip(8)
    x, y = torch.randn(2, 8, 4, 4), torch.randn(2, 8, 4, 4)
    assert torch.allclose(let(2 * x - y), 2 * let(x) - let(y), atol=1e-5)  # linear
    assert proxylessnas.small("fairnas").size() < space.size()  # the skip is a candidate


@pytest.mark.slow
def test_scarlet_nas_lets_train_under_strict_fairness():
    from model_spaces import proxylessnas
    from retiarii.engine.trainers.trainer import ClassifierTrainer, load_dataset

    space = proxylessnas.small("scarlet_nas")
    xs, ys = (t[:48] for t in load_dataset("digits"))
    trainer = ClassifierTrainer(dataset=(xs, ys), batch_size=16, val_fraction=0.25)
    s = FairNAS(train_segments=1, search_population=2, search_generations=1, seed=0)
    s.setup(space, trainer, {}, torch.device("cpu"))
    result = run(s, space, trainer, range(1))[0]
    assert result.metrics["paths"] == 7 * result.metrics["steps"]  # 6 MBConvs + the skip
    # the initial weights: a fresh super-graph of the same seed (each operator seeded by key)
    fresh = SharedTraining(space, trainer, {}, torch.device("cpu"), seed=0)
    skip_labels = [f"layer{i}" for i in range(1, 20)
                   if "skip" in str(space.sample(_Only(f"layer{i}")).sample[f"layer{i}"])]
    assert len(skip_labels) == 13  # the layers that keep their shape
    fresh.net({**space.default_sample(), **{label: "skip" for label in skip_labels}})
    initial = dict(fresh.supergraph.named_parameters())
    trained = dict(s._shared.supergraph.named_parameters())
    lets = [n for n in initial if ".skip.conv" in n]
    assert len(lets) == 13 and all(n in trained for n in lets)
    assert all(not torch.equal(trained[n], initial[n]) for n in lets)  # every LET trained


class _Only:
    """The skip of ``label`` when it has one (else its first candidate), others first."""

    def __init__(self, label):
        self.label = label

    def choose(self, label, candidates, context):
        return candidates.index("skip") if label == self.label and "skip" in candidates else 0
