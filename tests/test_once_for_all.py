"""Once-for-All: the progressive-shrinking phases in order, each drawing only its allowed
sub-networks, the kernel transformation of smaller kernels, channel sorting, the predictor-
guided search within the latency constraint, and a resumed search equal to an uninterrupted
one."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from one_shot_task import assert_numbers, make_space, roundtrip, run
from retiarii.optim.elastic import ElasticMBConv, centre
from retiarii.strategies.one_shot.once_for_all import OnceForAll, encode

SMALL_SEARCH = {"predictor_samples": 4, "predictor_steps": 30, "search_population": 6,
                "search_generations": 2, "search_parents": 2, "eval_batches": 1,
                "calibrate_batches": 1}


def _table():
    """A hand-made latency table: cost grows with kernel and expansion; a layer costs 1."""
    slot = {f"k{k}_e{e}": (k - 3) * 0.1 + (e - 3) * 0.2 for k in (3, 5, 7) for e in (3, 4, 6)}
    return {"base": 5.0, **{f"unit{u}": {"first": dict(slot), "rest": dict(slot), "layer": 1.0}
                            for u in (1, 2)}}


@pytest.fixture(scope="module")
def task():
    from model_spaces import once_for_all
    from retiarii.engine.trainers.trainer import ClassifierTrainer, load_dataset

    xs, ys = (t[:64] for t in load_dataset("digits"))
    trainer = ClassifierTrainer(dataset=(xs, ys), batch_size=4, val_fraction=0.25)
    return once_for_all.small(), trainer


def _strategy(task, **kwargs):
    space, trainer = task
    s = OnceForAll(**{**SMALL_SEARCH, "latency": _table(), **kwargs})
    s.setup(space, trainer, {}, torch.device("cpu"))
    return s


def test_the_kernel_transformation_makes_the_smaller_kernels():
    torch.manual_seed(0)
    layer = ElasticMBConv(4, 4, 1)
    with torch.no_grad():
        for m in layer.transforms.values():
            m.copy_(torch.randn_like(m))
    n = 4 * 6
    w7 = layer.depthwise[:n]
    w5 = (centre(w7, 5).reshape(n, 25) @ layer.transforms["5"].T).reshape(n, 1, 5, 5)
    w3 = (centre(w5, 3).reshape(n, 9) @ layer.transforms["3"].T).reshape(n, 1, 3, 3)
    assert torch.allclose(layer.kernel(5, n), w5) and torch.allclose(layer.kernel(3, n), w3)
    assert torch.equal(layer.kernel(7, n), w7)
    assert not torch.allclose(w3, centre(w7, 3))  # not the plain centre
    # the width: expansion 3 runs the first 12 hidden channels of 24
    x = torch.randn(2, 4, 6, 6)
    layer.eval()
    out = layer(x, kernel=3, expansion=3)
    h = F.relu(layer.expand_bn.eval()(F.conv2d(x, layer.expand.weight))[:, :12])
    h = F.relu(F.batch_norm(F.conv2d(h, w3[:12], None, 1, 1, 1, 12), layer.dw_bn.running_mean[:12],
                            layer.dw_bn.running_var[:12], layer.dw_bn.weight[:12],
                            layer.dw_bn.bias[:12], False, 0.0, layer.dw_bn.eps))
    ref = layer.project_bn(F.conv2d(h, layer.project.weight[:, :12])) + x
    assert torch.allclose(out, ref, atol=1e-5)


def test_channel_sorting_keeps_the_largest_network_and_puts_important_channels_first():
    torch.manual_seed(0)
    layer = ElasticMBConv(4, 4, 1, se=True).eval()
    x = torch.randn(2, 4, 6, 6)
    before = layer(x)
    layer.sort_channels()
    assert torch.allclose(layer(x), before, atol=1e-5)
    importance = layer.project.weight.abs().sum((0, 2, 3))
    assert torch.all(importance[:-1] >= importance[1:])


def test_the_phases_run_in_order_each_drawing_only_its_set(task):
    space, trainer = task
    s = _strategy(task, epochs=1)
    initial = {k: v.clone() for k, v in s._net.state_dict().items() if "transforms" in k}
    results = run(s, space, trainer, range(1))
    assert all(torch.equal(s._net.state_dict()[k], v) for k, v in initial.items())  # unused
    results += run(s, space, trainer, range(1, 4))
    assert_numbers(results)
    assert [r.metrics["phase"] for r in results] == [0, 1, 2, 3]
    assert "kd_loss" not in results[0].metrics and all("kd_loss" in r.metrics
                                                       for r in results[1:])
    drawn = [(h["phase"], h["kernels"], h["expansions"], h["depths"]) for h in s.history()]
    assert drawn == [("full", [7], [6], [4]), ("kernel", [3, 5, 7], [6], [4]),
                     ("depth", [3, 5, 7], [6], [2, 3, 4]),
                     ("width", [3, 5, 7], [3, 4, 6], [2, 3, 4])]
    # the kernel phase trained the transformation matrices
    assert not all(torch.equal(s._net.state_dict()[k], v) for k, v in initial.items())


def test_the_search_stays_within_the_latency_constraint(task):
    space, trainer = task
    s = _strategy(task, epochs=1, max_latency=7.0)
    results = run(s, space, trainer)
    assert_numbers(results)
    over = [c for c in (s.draw(__import__("random").Random(i)) for i in range(50))
            if s.latency_of(c) > 7.0]
    assert over  # the bound excludes part of the space
    assert s._search and all(lat <= 7.0 for lat, _ in s._search)
    best = results[-1].models[-1]
    assert best.sample == s.selected() and best.metrics["latency_ms"] <= 7.0
    assert space.replay(s.selected()).sample == s.selected()  # a model of the row's space
    measured = [m for m in results[-1].models if m.metrics.get("measured_for_predictor")]
    assert len(measured) == 4 and len(encode([(2, [(3, 3), (7, 6)])] * 2)) == 2 * 4 * 6


def test_resumed_equals_uninterrupted(task):
    space, trainer = task
    whole = _strategy(task, epochs=1)
    run(whole, space, trainer)
    first = _strategy(task, epochs=1)
    run(first, space, trainer, range(2))  # the teacher exists; sorting and search to come
    resumed = OnceForAll(**first.config())
    resumed.setup(space, trainer, {}, torch.device("cpu"))
    resumed.load_state_dict(roundtrip(first.state_dict()))
    run(resumed, space, trainer, range(2, resumed.num_segments()))
    a, b = whole.state_dict(), resumed.state_dict()
    assert all(torch.equal(a["net"][k], b["net"][k]) for k in a["net"])
    assert resumed.selected() == whole.selected() and a["search"] == b["search"]
    assert a["history"] == b["history"]


def test_bad_input_is_refused(task):
    with pytest.raises(ValueError, match="space.macro"):
        OnceForAll().setup(make_space(), task[1], {}, torch.device("cpu"))
    with pytest.raises(ValueError, match="epochs must be a positive int"):
        OnceForAll(epochs=0)
    s = _strategy(task, epochs=1, max_latency=0.1)
    with pytest.raises(ValueError, match="raise max_latency"):
        run(s, task[0], task[1])
