"""Single-Path NAS's search: super-kernels built on the row's space, the architecture the
thresholds say, the runtime term's gradient (hand-computed) and its pull toward cheaper
candidates, and a resumed search equal to an uninterrupted one."""
from __future__ import annotations

import pytest
import torch

from one_shot_task import assert_numbers, make_space, roundtrip, run
from retiarii.strategies.one_shot.single_path import SinglePathNAS

BIG = 1e9  # a threshold no norm passes
COST = {"k3_e3": 0.0, "k3_e6": 1.0, "k5_e3": 2.0, "k5_e6": 3.0, "skip": -0.5}


@pytest.fixture(scope="module")
def task():
    from model_spaces import proxylessnas
    from retiarii.engine.trainers.trainer import ClassifierTrainer, load_dataset

    xs, ys = (t[:64] for t in load_dataset("digits"))
    trainer = ClassifierTrainer(dataset=(xs, ys), batch_size=16, val_fraction=0.25)
    return proxylessnas.small("single_path_nas"), trainer


def _strategy(task, **kwargs):
    space, trainer = task
    s = SinglePathNAS(**{"epochs": 2, **kwargs})
    s.setup(space, trainer, {}, torch.device("cpu"))
    return s


def _layers(s):
    return dict(zip(s._net.body.labels, s._net.body.layers))


def test_the_search_selects_what_the_thresholds_say(task):
    space, trainer = task
    s = _strategy(task, epochs=1, threshold_lr=0.0)
    layers = _layers(s)
    # layer1 (4 -> 8 channels) cannot be skipped; layers 2-4 keep their shape
    assert not layers["layer1"].skip and layers["layer2"].skip
    hand = {"layer1": ((BIG, 0.0, BIG), "k3_e3"), "layer2": ((0.0, BIG, 0.0), "skip"),
            "layer3": ((BIG, 0.0, 0.0), "k3_e6"), "layer4": ((0.0, 0.0, BIG), "k5_e3")}
    with torch.no_grad():
        for label, (t, _) in hand.items():
            layers[label].thresholds.copy_(torch.tensor(t))
    [result] = run(s, space, trainer)
    assert_numbers([result])
    expected = {label: "k5_e6" for label in space.default_sample()}  # thresholds 0: largest
    expected.update({label: choice for label, (_, choice) in hand.items()})
    assert s.selected() == expected == result.models[0].sample
    assert space.replay(s.selected()).sample == expected  # a model of the row's space
    assert 0 <= result.models[0].metrics["val_acc"] <= 1


def test_the_runtime_term_and_its_gradient_by_hand(task):
    table = {label: dict(COST) for label in task[0].default_sample()}
    s = _strategy(task, latency=table, base_latency=10.0, latency_weight=2.0)
    # thresholds 0: every test passes, every layer is k5_e6
    r = s.runtime()
    assert float(r.detach()) == pytest.approx(10.0 + 21 * 3.0)
    layer = _layers(s)["layer1"]  # not skippable: R_1 = body
    term = s.latency_weight * torch.log(r)
    term.backward()
    with torch.no_grad():
        ring = layer.depthwise * (1 - layer.centre)
        s_k = torch.sigmoid(ring.pow(2).sum() - layer.thresholds[0])
        outer = ring[layer.small_mid:].pow(2).sum()  # the e6-only channels' ring
        s_w = torch.sigmoid(layer.depthwise[layer.small_mid:].pow(2).sum()
                            - layer.thresholds[2])
    # R_1 = small + kernel (large - small), small/large = c(k, e3) + wide (c(k, e6) - c(k, e3))
    # and wide reads w_k = centre + kernel * ring: d R_1 / d kernel =
    # (large - small) + (c(k5_e6) - c(k5_e3)) * d wide / d kernel, with
    # d wide / d kernel = s_w (1 - s_w) * 2 kernel ||ring[e6 only]||^2 (kernel = 1)
    d_kernel = (3.0 - 1.0) + (3.0 - 2.0) * float(s_w * (1 - s_w)) * 2 * float(outer)
    # d/dt_k of 2 log R = 2/R * d R_1 / d kernel * d kernel / d t_k, the last -s_k (1 - s_k)
    expected = 2.0 / float(r.detach()) * d_kernel * -float(s_k * (1 - s_k))
    assert float(layer.thresholds.grad[0]) == pytest.approx(expected, rel=1e-5)
    assert expected < 0  # a gradient step raises t_k: toward the cheaper 3x3


def _cost(sample):
    return sum(COST[c] for c in sample.values())


def test_a_large_runtime_weight_selects_cheaper_candidates(task):
    space, trainer = task
    table = {label: dict(COST) for label in space.default_sample()}
    costs = {}
    for weight in (0.0, 50.0):
        s = _strategy(task, epochs=2, latency=table, base_latency=10.0, latency_weight=weight,
                      threshold_lr=0.5)
        results = run(s, space, trainer)
        costs[weight] = (_cost(s.selected()), results[-1].models[0].metrics["latency_ms"])
    # (the cross-entropy moves the thresholds too: without the term some layers shrink)
    assert costs[50.0][0] < costs[0.0][0] and costs[50.0][1] < costs[0.0][1]


def test_resumed_equals_uninterrupted(task):
    space, trainer = task
    table = {label: dict(COST) for label in space.default_sample()}
    kwargs = {"epochs": 2, "latency": table, "base_latency": 10.0, "latency_weight": 1.0}
    whole = _strategy(task, **kwargs)
    run(whole, space, trainer)
    first = _strategy(task, **kwargs)
    run(first, space, trainer, range(1))
    resumed = SinglePathNAS(**first.config())
    resumed.setup(space, trainer, {}, torch.device("cpu"))
    resumed.load_state_dict(roundtrip(first.state_dict()))
    run(resumed, space, trainer, range(1, 2))
    a, b = whole.state_dict(), resumed.state_dict()
    assert a["net"].keys() == b["net"].keys()
    assert all(torch.equal(a["net"][k], b["net"][k]) for k in a["net"])
    assert resumed.selected() == whole.selected()


def test_bad_input_is_refused(task):
    with pytest.raises(ValueError, match="base_latency"):
        SinglePathNAS(latency={"layer1": {"k3_e3": 0.0}})
    with pytest.raises(ValueError, match="space.macro"):
        SinglePathNAS(epochs=1).setup(make_space(), task[1], {}, torch.device("cpu"))
    with pytest.raises(ValueError, match="'layer99' is not a choice"):
        _strategy(task, latency={"layer99": {"k3_e3": 0.0}}, base_latency=1.0)
