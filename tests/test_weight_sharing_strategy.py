"""WeightSharing: multi-trial strategies (ask/tell) run on a super-graph, one model per few
batches. It finds the clearly best model of a synthetic task, tells exactly what a by-hand
loop over the same models measures, resumes bit for bit, and ends when the strategy does."""
from __future__ import annotations

import pytest
import torch

from one_shot_task import BEST, LinearTask, assert_numbers, make_space, roundtrip, run
from retiarii.strategies import (SPOS, PolicyBasedRL, Random, RegularizedEvolution,
                                 WeightSharing)
from retiarii.strategies.one_shot.base import SegmentContext
from retiarii.strategies.one_shot.shared_training import SharedTraining


def _set_up(strategy, trainer=None):
    space, trainer = make_space(), trainer or LinearTask()
    strategy.setup(space, trainer, {}, torch.device("cpu"))
    return strategy, space, trainer


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_with_weight_sharing_finds_the_best_model(seed):
    ws, space, trainer = _set_up(WeightSharing(Random(seed=seed, dedup=False), segments=3,
                                               eval_batches=2, seed=seed))
    results = run(ws, space, trainer)
    assert ws.selected() == BEST
    assert sum(len(r.models) for r in results) == 3 * 16  # one model per batch


@pytest.mark.parametrize("inner", [
    lambda: RegularizedEvolution(population_size=4, sample_size=2, seed=0, dedup=False),
    lambda: PolicyBasedRL(seed=0, dedup=False),
], ids=["evolution", "rl"])
def test_other_strategies_with_weight_sharing_find_the_best_model(inner):
    ws, space, trainer = _set_up(WeightSharing(inner(), segments=3, eval_batches=2))
    run(ws, space, trainer)
    assert ws.selected() == BEST


def test_told_values_equal_a_by_hand_loop_over_the_same_models():
    inner = Random(seed=3, dedup=False)
    ws, space, trainer = _set_up(WeightSharing(inner, batches_per_model=2, eval_batches=1,
                                               segments=1, seed=5))
    result = run(ws, space, trainer)[0]
    assert len(result.models) == 8  # 16 batches, 2 per model
    # the values told to the strategy are the ones recorded
    told = [value for _, value in inner._told]
    assert told == [m.metrics["val_acc"] for m in result.models]

    # reference: the same models, trained and evaluated by hand on a fresh super-graph
    ref = SharedTraining(space, trainer, {}, torch.device("cpu"), seed=5)
    ctx = SegmentContext(0, trainer, {}, torch.device("cpu"))
    batches = trainer.train_dataloader({}, 0)
    valid = trainer.val_dataloader({})[:1]
    with ref.own_rng():
        for i, model in enumerate(result.models):
            losses = [ref.train(model.sample, b, ctx) for b in batches[2 * i:2 * i + 2]]
            metrics = ref.evaluate(model.sample, valid)
            assert metrics["val_acc"] == model.metrics["val_acc"]
            assert sum(losses) / 2 == model.metrics["train_loss"]


def test_resumed_search_equals_uninterrupted():
    def make():
        return WeightSharing(RegularizedEvolution(population_size=4, sample_size=2, seed=1,
                                                  dedup=False), segments=2)

    whole, space, trainer = _set_up(make())
    full = run(whole, space, trainer)
    first, _, _ = _set_up(make())
    run(first, space, trainer, range(1))
    resumed, _, _ = _set_up(make())
    resumed.load_state_dict(roundtrip(first.state_dict()))
    rest = run(resumed, space, trainer, range(1, 2))

    a, b = whole.state_dict(), resumed.state_dict()
    a["inner"].pop("elapsed"), b["inner"].pop("elapsed")  # (wall time, not search state)
    assert a["inner"] == b["inner"] and a["latest"] == b["latest"]
    for x, y in zip(a["shared"]["supergraph"]["entries"], b["shared"]["supergraph"]["entries"]):
        assert x["key"] == y["key"]
        assert all(torch.equal(x["state"][k], y["state"][k]) for k in x["state"])
    assert resumed.selected() == whole.selected()
    assert_numbers(full)
    assert [(m.sample, m.metrics) for m in rest[0].models] == \
        [(m.sample, m.metrics) for m in full[1].models]


def test_search_ends_when_the_strategy_has_nothing_new():
    inner = Random(seed=0)  # dedup: each of the 6 models once
    ws, space, trainer = _set_up(WeightSharing(inner, segments=2))
    first, second = run(ws, space, trainer)
    samples = [tuple(sorted(m.sample.items())) for m in first.models]
    assert len(samples) == len(set(samples)) == space.size() == 6
    assert first.metrics["exhausted"] == 1 and second.models == []
    assert ws.selected() == max(first.models, key=lambda m: m.metrics["val_acc"]).sample


def test_min_mode_metric_is_told_as_is():
    inner = Random(seed=0, dedup=False, mode="min")
    ws, space, trainer = _set_up(WeightSharing(inner, segments=3, eval_batches=2,
                                               metric="val_loss"))
    results = run(ws, space, trainer)
    assert [v for _, v in inner._told][:3] == [m.metrics["val_loss"] for m in
                                              results[0].models[:3]]
    assert ws.selected() == BEST


def test_segments_default_to_the_trainers_epochs():
    ws = WeightSharing(Random(seed=0, dedup=False))
    with pytest.raises(RuntimeError, match="segments="):
        ws.num_segments()
    trainer = LinearTask()
    trainer.epochs = 4
    _set_up(ws, trainer)
    assert ws.num_segments() == 4


def test_config_rebuilds_the_strategy_as_workers_do():
    import json

    from retiarii.refs import resolve_ref

    ws = WeightSharing(RegularizedEvolution(population_size=4, sample_size=2, seed=7,
                                            dedup=False), batches_per_model=2, segments=3)
    config = json.loads(json.dumps(ws.config()))  # JSON, as the store keeps it
    inner = config.pop("strategy")
    again = WeightSharing(resolve_ref(inner["class"])(**inner["config"]), **config)
    assert again.config() == ws.config()
    assert isinstance(again.strategy, RegularizedEvolution) and again.strategy.seed == 7
    _, space, _ = _set_up(again)
    assert again.strategy.ask(space) == RegularizedEvolution(
        population_size=4, sample_size=2, seed=7, dedup=False).ask(space)


def test_bad_input_names_the_culprit():
    with pytest.raises(TypeError, match="ask/tell"):
        WeightSharing(object())
    with pytest.raises(TypeError, match="already one-shot"):
        WeightSharing(SPOS())
    with pytest.raises(ValueError, match="batches_per_model"):
        WeightSharing(Random(), batches_per_model=0)
    ws, space, trainer = _set_up(WeightSharing(Random(seed=0, dedup=False), segments=1,
                                               metric="accuracy"))
    with pytest.raises(KeyError, match="'accuracy'"):
        run(ws, space, trainer)
    with pytest.raises(ValueError, match="one rank"):
        ws.run_segment(SegmentContext(0, trainer, {}, torch.device("cpu"), world=2))
    state = ws.state_dict()
    other, _, _ = _set_up(WeightSharing(Random(seed=0, dedup=False), segments=2,
                                        metric="accuracy"))
    with pytest.raises(ValueError, match="construct it with the saved settings"):
        other.load_state_dict(state)
