"""SPOS and ENAS with mixed parallelism: a segment on 2 ranks (gloo, spawned processes) equals
one process that applies, per step, each shared weight's gradient averaged over the paths that
used it; the evaluations the ranks share are reported once."""
from __future__ import annotations

import functools

import torch

from one_shot_task import LinearTask, make_space
from retiarii.engine.executors.local_ranks import run_segment_on_ranks
from retiarii.sampler import RandomSampler
from retiarii.strategies import ENAS, SPOS
from retiarii.strategies.one_shot.base import SegmentContext
from retiarii.strategies.one_shot.shared_training import SharedTraining, rank_rngs

CPU = torch.device("cpu")
WORLD = 2


def _spos() -> SPOS:
    return SPOS(train_segments=1, search_population=3, search_generations=1, eval_batches=2,
                seed=4)


def build_spos(segment: int):
    s = _spos()
    trainer = LinearTask(batches=9)  # 9 % 2: the last batch is left out on 2 ranks
    s.setup(make_space(), trainer, {}, CPU)
    return s, SegmentContext(segment, trainer, {}, CPU)


def build_enas(segment: int):
    s = ENAS(segments=1, controller_steps=4, seed=2)
    trainer = LinearTask(batches=6)
    s.setup(make_space(), trainer, {}, CPU)
    return s, SegmentContext(segment, trainer, {}, CPU)


def _reference() -> SharedTraining:
    """Segment 0 of _spos() on WORLD ranks, emulated in one process."""
    space, trainer = make_space(), LinearTask(batches=9)
    ref = SharedTraining(space, trainer, {}, CPU, seed=4)
    params = list(ref.supergraph.parameters())
    rngs = rank_rngs(4, 0, WORLD, "train")
    data = trainer.train_dataloader({}, 0)
    for step in range(len(data) // WORLD):
        models = [space.sample(RandomSampler(g)) for g in rngs]
        grads = []
        for r, model in enumerate(models):
            net = ref.net(model)
            params = list(ref.supergraph.parameters())
            ref.optimizer.zero_grad(set_to_none=True)
            loss = trainer.training_step(net, data[step * WORLD + r], {})
            if loss.requires_grad:
                loss.backward()
            grads.append({id(p): p.grad.clone() for p in params if p.grad is not None})
        for p in params:
            used = [g[id(p)] for g in grads if id(p) in g]
            p.grad = torch.stack(used).mean(0) if used else None
        ref.optimizer.step()
    return ref


def test_spos_on_two_ranks_equals_one_process_averaging_over_users():
    result, state = run_segment_on_ranks(functools.partial(build_spos, 0), None, WORLD,
                                         timeout=300)
    assert result.metrics["batches"] == 9 // WORLD  # rank 0's share
    ref = _reference()
    want = {e["key"]: e["state"] for e in ref.supergraph.state_dict()["entries"]}
    got = {e["key"]: e["state"] for e in state["shared"]["supergraph"]["entries"]}
    assert got.keys() == want.keys()
    for key in want:
        for name in want[key]:
            torch.testing.assert_close(got[key][name], want[key][name], rtol=1e-5, atol=1e-6,
                                       msg=f"{key}.{name}")

    # the search: every rank evaluates the same candidates; they are reported once, with the
    # metric averaged over the ranks (equal here: every rank validates on the same batches)
    search, _ = run_segment_on_ranks(functools.partial(build_spos, 1), state, WORLD,
                                     timeout=300)
    assert len(search.models) == 3
    valid = LinearTask().val_dataloader({})[:2]
    for m in search.models:
        expected = ref.evaluate(m.sample, valid)["val_acc"]
        assert abs(m.metrics["val_acc"] - expected) < 1e-5


def test_enas_on_two_ranks_reports_each_controller_step_once():
    result, state = run_segment_on_ranks(functools.partial(build_enas, 0), None, WORLD,
                                         timeout=300)
    steps = [m for m in result.models if not m.metrics.get("select")]
    assert result.metrics["controller_steps"] == 4 and len(steps) == 4
    # the last segment also evaluates every distinct path once, for the selection (#28)
    finals = [m for m in result.models if m.metrics.get("select")]
    assert len({tuple(sorted(m.sample.items())) for m in finals}) == len(finals) >= 1
    assert result.metrics["batches"] == 6 // WORLD
    # the controller state came back whole and loads into a fresh strategy
    s, _ = build_enas(0)
    s.load_state_dict(state)
    assert s.selected().keys() == {"op", "act"}
