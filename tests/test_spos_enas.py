"""SPOS and ENAS on a super-graph: they find the clearly best model of a synthetic task over
several seeds, resume bit for bit, sample uniformly (SPOS) and update the controller by
REINFORCE with the right sign and baseline (ENAS, checked by hand)."""
from __future__ import annotations

import collections
import copy
import itertools

import pytest
import torch
from torch import nn

from one_shot_task import (BEST, LinearTask, assert_numbers, make_bn_space, make_space,
                           roundtrip, run)
from retiarii.strategies import ENAS, SPOS, Random, WeightSharing
from retiarii.strategies.one_shot.enas import _PolicySampler
from retiarii.strategies.one_shot.base import SegmentContext
from retiarii.strategies.one_shot.shared_training import SharedTraining


def _spos(seed, **kw):
    args = dict(train_segments=3, search_population=4, search_generations=2, search_parents=2,
                eval_batches=2, seed=seed)
    return SPOS(**{**args, **kw})


def _enas(seed, **kw):
    args = dict(segments=3, controller_steps=30, eval_batches=1, seed=seed)
    return ENAS(**{**args, **kw})


def _set_up(strategy, trainer=None):
    space, trainer = make_space(), trainer or LinearTask()
    strategy.setup(space, trainer, {}, torch.device("cpu"))
    return strategy, space, trainer


# ---- the right answer ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_spos_ranks_the_best_model_first(seed):
    s, space, trainer = _set_up(_spos(seed))
    results = run(s, space, trainer)
    assert s.selected() == BEST
    search = results[-1].models
    assert search, "the search segment evaluated no candidate"
    ranked = sorted(search, key=lambda m: -m.metrics["val_acc"])
    assert ranked[0].sample == BEST
    # clearly best: its loss is a fraction of the runner-up's
    assert ranked[0].metrics["val_loss"] < 0.5 * ranked[1].metrics["val_loss"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_enas_ranks_the_best_model_first(seed):
    s, space, trainer = _set_up(_enas(seed))
    before = s.probability(BEST)
    run(s, space, trainer)
    assert s.selected() == BEST
    assert s.probability(BEST) > max(0.5, before)


def test_enas_best_of_samples_selects_by_validation():
    s, space, trainer = _set_up(_enas(0, select_samples=4))
    results = run(s, space, trainer)
    chosen = [m for m in results[-1].models if m.metrics.get("select")]
    assert chosen and s.selected() == max(chosen, key=lambda m: m.metrics["val_acc"]).sample
    assert s.selected() == BEST


# ---- resume ----------------------------------------------------------------------------------


def _assert_bit_equal(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_bit_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bit_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("make", [
    lambda: _spos(0, train_segments=1, search_population=3),  # train | search
    lambda: _enas(0, segments=2, controller_steps=5, select_samples=2),
], ids=["SPOS", "ENAS"])
def test_resumed_search_equals_uninterrupted(make):
    whole, space, trainer = _set_up(make())
    full = run(whole, space, trainer)

    first, _, _ = _set_up(make())
    run(first, space, trainer, range(1))
    state = roundtrip(first.state_dict())
    resumed, _, _ = _set_up(make())
    resumed.load_state_dict(state)
    rest = run(resumed, space, trainer, range(1, resumed.num_segments()))

    _assert_bit_equal(whole.state_dict(), resumed.state_dict())
    assert resumed.selected() == whole.selected()
    assert_numbers(full)
    assert [(m.sample, m.metrics) for m in rest[-1].models] == \
        [(m.sample, m.metrics) for m in full[-1].models]


def test_exported_weights_are_the_inherited_ones():
    s, space, trainer = _set_up(_spos(0, train_segments=1))
    run(s, space, trainer)
    net = space.build(s.selected())
    net.load_state_dict(s.export_state(s.selected()))
    path = s._shared.net(s.selected())
    x = torch.randn(5, 8)
    assert torch.equal(net(x), path(x))


def test_load_state_checks_strategy_and_settings():
    s, _, _ = _set_up(_spos(0))
    state = s.state_dict()
    with pytest.raises(ValueError, match="saved by 'SPOS'"):
        _set_up(_enas(0))[0].load_state_dict(state)
    with pytest.raises(ValueError, match="construct it with the saved settings"):
        _set_up(_spos(0, search_population=5))[0].load_state_dict(state)
    with pytest.raises(RuntimeError, match="call setup"):
        _spos(0).load_state_dict(state)


# ---- hand-checked pieces ---------------------------------------------------------------------


def test_spos_samples_each_candidate_evenly(monkeypatch):
    paths = []

    def record(self, model, batch, ctx):
        paths.append(dict(model.sample))
        return 0.0

    monkeypatch.setattr(SharedTraining, "train", record)
    s, space, _ = _set_up(_spos(0, train_segments=1))
    trainer = LinearTask(batches=600)
    s.run_segment(SegmentContext(0, trainer, {}, torch.device("cpu")))
    assert len(paths) == 600
    ops = collections.Counter(p["op"] for p in paths)
    acts = collections.Counter(p["act"] for p in paths)
    # uniform: 200 per op, 300 per act; a 15% band is ~3.5 standard deviations wide
    assert set(ops) == {"linear", "zero", "skip"} and all(170 <= n <= 230 for n in ops.values())
    assert set(acts) == {"identity", "relu"} and all(255 <= n <= 345 for n in acts.values())


def test_spos_fair_takes_every_candidate_once_per_cycle(monkeypatch):
    paths = []
    monkeypatch.setattr(SharedTraining, "train",
                        lambda self, model, batch, ctx: paths.append(dict(model.sample)) or 0.0)
    s, space, _ = _set_up(_spos(0, train_segments=2, fair=True))
    for segment in range(2):
        s.run_segment(SegmentContext(segment, LinearTask(batches=13), {}, torch.device("cpu")))
    assert len(paths) == 26
    for label, k in (("op", 3), ("act", 2)):
        cycles = []
        for segment in range(2):  # the cycles restart with each segment
            seg = paths[13 * segment:13 * (segment + 1)]
            # op has 3 candidates: each once in paths 0-2, 3-5, ...; act (2) in 0-1, 2-3, ...
            cycles += [[p[label] for p in seg[i:i + k]] for i in range(0, 13 - 13 % k, k)]
        assert all(len(set(c)) == k for c in cycles), (label, cycles)
        assert len({tuple(c) for c in cycles}) > 1  # shuffled anew, not one fixed order
    # the uniform sampler does not pair up like that (the test can fail)
    paths.clear()
    plain, _, _ = _set_up(_spos(0, train_segments=1))
    plain.run_segment(SegmentContext(0, LinearTask(batches=12), {}, torch.device("cpu")))
    assert not all(len({p["op"] for p in paths[i:i + 3]}) == 3 for i in range(0, 12, 3))


def test_spos_fair_resumes_bit_for_bit_and_is_part_of_the_settings():
    whole, space, trainer = _set_up(_spos(0, train_segments=2, fair=True))
    run(whole, space, trainer)
    first, _, _ = _set_up(_spos(0, train_segments=2, fair=True))
    run(first, space, trainer, range(1))
    state = roundtrip(first.state_dict())
    with pytest.raises(ValueError, match="construct it with the saved settings"):
        _set_up(_spos(0, train_segments=2))[0].load_state_dict(state)
    resumed, _, _ = _set_up(_spos(0, train_segments=2, fair=True))
    resumed.load_state_dict(state)
    run(resumed, space, trainer, range(1, resumed.num_segments()))
    _assert_bit_equal(whole.state_dict(), resumed.state_dict())
    assert resumed.selected() == whole.selected() == BEST


def test_spos_batches_per_model_trains_each_path_that_many_batches(monkeypatch):
    models = []
    monkeypatch.setattr(SharedTraining, "train",
                        lambda self, model, batch, ctx: models.append(id(model)) or 0.0)
    s, _, _ = _set_up(_spos(0, train_segments=1, batches_per_model=3))
    result = s.run_segment(SegmentContext(0, LinearTask(batches=10), {}, torch.device("cpu")))
    runs = [len(list(g)) for _, g in itertools.groupby(models)]
    assert runs == [3, 3, 3, 1] and result.metrics["paths"] == 4


def test_spos_search_never_evaluates_a_candidate_twice():
    # 6 models in the space: 4 random, then at most the 2 left, then nothing new
    s, space, trainer = _set_up(_spos(0, train_segments=1, search_generations=3))
    results = run(s, space, trainer)
    samples = [tuple(sorted(m.sample.items())) for m in results[-1].models]
    assert len(samples) == len(set(samples)) == 6


def test_recalibrated_evaluation_equals_a_by_hand_recalibration_and_leaves_the_state():
    space, trainer = make_bn_space(), LinearTask()
    s = _spos(0, train_segments=1)
    s.setup(space, trainer, {}, torch.device("cpu"))
    run(s, space, trainer, range(1))  # the shared BatchNorm saw a mixture of paths
    shared = s._shared
    sample = {"op": "linear"}
    calibrate = trainer.train_dataloader({}, 5)[:3]
    valid = trainer.val_dataloader({})
    before = roundtrip(shared.supergraph.state_dict())

    got = shared.evaluate(sample, valid, calibrate)
    _assert_bit_equal(shared.supergraph.state_dict(), before)  # evaluation changed nothing
    plain = shared.evaluate(sample, valid)
    assert plain["val_loss"] != got["val_loss"]  # the mixed statistics do differ

    # reference: a standalone copy with the inherited weights, statistics recomputed by hand
    net = shared.supergraph.export(sample)
    bn = [m for m in net.modules() if isinstance(m, torch.nn.BatchNorm1d)]
    assert len(bn) == 1
    with torch.no_grad():
        feats = torch.cat([net.op(x) for x, _ in calibrate])  # (3 * B, DIM) inputs of the BN
        bn[0].running_mean.copy_(feats.mean(0))
        bn[0].running_var.copy_(torch.stack([f.var(0) for f in
                                             feats.split(len(calibrate[0][0]))]).mean(0))
        net.eval()
        xs, ys = zip(*valid)
        want = torch.nn.functional.mse_loss(net(torch.cat(xs)), torch.cat(ys))
    assert got["val_loss"] == pytest.approx(float(want), rel=1e-5)


def test_enas_reinforce_update_by_hand():
    s, _, _ = _set_up(_enas(0, baseline_decay=0.9, entropy_weight=0.0))

    def log_prob():
        sampler = _PolicySampler(s, None, fixed=BEST)
        with torch.enable_grad():
            s._space.sample(sampler)
        return sampler.log_prob, sampler.entropy

    # The first reward sets the baseline: no advantage, so no change of the policy.
    p0 = s.probability(BEST)
    lp, ent = log_prob()
    assert s.reinforce(lp, ent, 0.7) == 0.0 and s._baseline == 0.7
    assert s.probability(BEST) == pytest.approx(p0, abs=1e-7)

    # With plain SGD the step is exactly lr * (r - b) * grad log p, b moved first.
    lr = 0.1
    s._optimizer = torch.optim.SGD(s._controller.parameters(), lr=lr)
    params = [p for p in s._controller.parameters()]
    lp, ent = log_prob()
    grads = torch.autograd.grad(lp, params, allow_unused=True)
    before = [p.detach().clone() for p in params]
    lp, ent = log_prob()
    advantage = s.reinforce(lp, ent, 1.7)
    assert s._baseline == pytest.approx(0.7 + 0.1 * (1.7 - 0.7))
    assert advantage == pytest.approx(1.7 - 0.8)
    for p, b, g in zip(params, before, grads):
        expected = b if g is None else b + lr * advantage * g
        assert torch.allclose(p.detach(), expected, atol=1e-6)
    assert s.probability(BEST) > p0  # reward above the baseline: the path gets likelier

    # A reward below the baseline makes the path less likely.
    p1 = s.probability(BEST)
    lp, ent = log_prob()
    assert s.reinforce(lp, ent, -5.0) < 0
    assert s.probability(BEST) < p1


# ---- bad input ---------------------------------------------------------------------------


def test_bad_arguments_name_the_culprit():
    with pytest.raises(ValueError, match="search_population"):
        SPOS(search_population=0)
    with pytest.raises(ValueError, match="mutation_prob"):
        SPOS(mutation_prob=2.0)
    with pytest.raises(ValueError, match="mode"):
        SPOS(mode="up")
    with pytest.raises(ValueError, match="fair must be True or False"):
        SPOS(fair="yes")
    with pytest.raises(ValueError, match="baseline_decay"):
        ENAS(baseline_decay=1.0)
    with pytest.raises(ValueError, match="select_samples"):
        ENAS(select_samples=-1)


def test_unknown_metric_and_segment_are_clear_errors():
    s, space, trainer = _set_up(_spos(0, train_segments=1, metric="accuracy"))
    run(s, space, trainer, range(1))
    with pytest.raises(KeyError, match="'accuracy'.*val_acc"):
        run(s, space, trainer, range(1, 2))
    with pytest.raises(ValueError, match="segment 5 is out of range"):
        run(s, space, trainer, range(5, 6))
    e, _, _ = _set_up(_enas(0, metric="accuracy"))
    with pytest.raises(KeyError, match="'accuracy'"):
        run(e, space, trainer, range(1))
    with pytest.raises(RuntimeError, match="call setup"):
        _enas(0).run_segment(SegmentContext(0, trainer, {}, torch.device("cpu")))


# ---- on a GPU (pytest -m gpu) ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("make", [
    lambda: _spos(0),
    lambda: _enas(0),
    lambda: WeightSharing(Random(seed=0, dedup=False), segments=3, eval_batches=2),
], ids=["SPOS", "ENAS", "WeightSharing"])
def test_on_cuda_selects_the_best_and_its_state_loads(make, device="cuda"):
    device = torch.device(device)
    space, trainer = make_space(), LinearTask()
    s = make()
    s.setup(space, trainer, {}, device)
    for seg in range(s.num_segments()):
        s.run_segment(SegmentContext(seg, trainer, {}, device))
    assert s.selected() == BEST
    assert all(p.device.type == device.type for p in s._shared.supergraph.parameters())
    fresh = make()
    fresh.setup(space, trainer, {}, device)
    fresh.load_state_dict(roundtrip(s.state_dict()))
    assert fresh.selected() == s.selected()
    x = torch.randn(4, 8, device=device)
    assert torch.equal(fresh._shared.net(BEST)(x), s._shared.net(BEST)(x))


@pytest.mark.slow
def test_spos_on_the_shufflenet_block_space_selects_an_exportable_model():
    from model_spaces import spos as spos_space
    from retiarii.engine.trainers.trainer import ClassifierTrainer, load_dataset

    x, y = (t[:96] for t in load_dataset("digits"))
    trainer = ClassifierTrainer(dataset=(x, y), batch_size=16, val_fraction=0.25)
    space = spos_space.small()
    s = SPOS(train_segments=1, search_population=3, search_generations=2, search_parents=2,
             calibrate_batches=2, eval_batches=1, seed=0)
    s.setup(space, trainer, {}, torch.device("cpu"))
    results = run(s, space, trainer)
    assert_numbers(results)
    assert len(results[-1].models) == 6  # 3 random, then 3 children
    best = s.selected()
    net = space.build(best)
    net.load_state_dict(s.export_state(best))
    net.eval()
    # The reference: the path's shared weights with its BatchNorm statistics recomputed, by
    # hand, on the search segment's first calibrate_batches training batches (a cumulative
    # average), as the search judged the path; the supernet's own statistics, averaged over
    # every path trained, are not what the exported model should compute (since c1f45ee)
    ref = copy.deepcopy(s._shared.net(best))
    bns = [m for m in ref.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert bns  # the ShuffleNet blocks' BatchNorms: what this test is about
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    ref.train()
    with torch.no_grad():
        for xb, _ in itertools.islice(trainer.train_dataloader({}, s.num_segments() - 1),
                                      s.calibrate_batches):
            ref(xb)
    ref.eval()
    xs = x[:8].float()
    assert torch.allclose(net(xs), ref(xs), atol=1e-6)
    assert not torch.allclose(net(xs), s._shared.net(best).eval()(xs), atol=1e-3)
