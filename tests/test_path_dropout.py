"""Bender et al.'s one-shot training (the oneshot row): the dropout schedule, the keep rule,
ghost BatchNorm, L2 on the used weights only, evaluation with the other paths zeroed out."""
import pytest
import torch
from torch import nn

from model_spaces import oneshot
from retiarii.engine.trainers.trainer import ClassifierTrainer
from retiarii.strategies.one_shot.base import SegmentContext
from retiarii.strategies.one_shot.path_dropout import (GhostBatchNorm2d, PathDropout,
                                                       dropout_rate, ghost_batch_norm,
                                                       path_masks)


def test_dropout_rate_ramps_linearly_from_zero_to_the_final_rate():
    # 11 steps, r = 0.4: step s has 0.4 * s / 10
    assert dropout_rate(0, 11, 0.4) == 0.0
    assert dropout_rate(5, 11, 0.4) == pytest.approx(0.2)
    assert dropout_rate(10, 11, 0.4) == pytest.approx(0.4)
    assert dropout_rate(3, 11, 0.4) == pytest.approx(0.12)
    assert dropout_rate(20, 11, 0.4) == pytest.approx(0.4)  # never past r


def test_masks_drop_each_path_with_rate_to_the_one_over_k_and_keep_at_least_one():
    g = torch.Generator().manual_seed(0)
    m = path_masks(7, 20000, 0.5, g)
    assert set(m.unique().tolist()) <= {0.0, 1.0}
    assert bool((m.sum(1) >= 1).all())  # never a dark choice point
    # all 7 drew a drop with probability 0.5 (then one is kept), so a row keeps exactly one
    # path with probability 0.5 + 7 * q * p^6 (p = 0.5 ** (1/7), q = 1 - p)
    p = 0.5 ** (1 / 7)
    expected_one = 0.5 + 7 * (1 - p) * p ** 6
    assert float((m.sum(1) == 1).float().mean()) == pytest.approx(expected_one, abs=0.015)
    assert bool((path_masks(3, 50, 0.0, g) == 1).all())  # rate 0: every path
    # at a rate near 1 almost every row is rescued, still with exactly one path
    assert bool((path_masks(2, 500, 0.999999, g).sum(1) == 1).all())


def test_ghost_batch_norm_normalizes_each_ghost_batch_by_its_own_statistics():
    bn = ghost_batch_norm(nn.Sequential(nn.BatchNorm2d(1, affine=False)), 2)[0]
    assert isinstance(bn, GhostBatchNorm2d)
    x = torch.tensor([1.0, 3.0, 10.0, 30.0]).view(4, 1, 1, 1)
    out = bn(x).flatten()
    # ghost batches (1, 3) and (10, 30): each normalized to (-1, 1) (eps aside)
    assert out.tolist() == pytest.approx([-1, 1, -1, 1], abs=1e-4)
    plain = nn.BatchNorm2d(1, affine=False)(x).flatten()  # the whole batch's statistics
    assert plain.tolist() != pytest.approx([-1, 1, -1, 1], abs=1e-2)
    # running mean updated once per ghost batch (momentum 0.1): 0.9 * (0.1 * 2) + 0.1 * 20
    assert float(bn.running_mean) == pytest.approx(0.9 * 0.2 + 2.0)


def _strategy(**kw):
    trainer = ClassifierTrainer(dataset="digits", epochs=1, weight_decay=0.0)
    s = PathDropout(**{"epochs": 1, "search_population": 3, "ghost_batch": 16, **kw})
    s.setup(oneshot.small(), trainer, {}, torch.device("cpu"))
    return s, trainer


def test_l2_reaches_only_the_weights_the_batch_used():
    s, trainer = _strategy(weight_decay=0.1)
    batch = next(iter(trainer.train_dataloader({}, 0)))
    masks = s.masks(len(batch[1]), 0.0)  # every path ...
    masks["cells.0.ops0"][:, 2] = 0.0  # ... but sep_conv_3x3 of block 0 in cell 0, for all
    dropped = s._net.cells[0].b0_sep_conv_3x3
    kept = s._net.cells[0].b0_conv_1x1
    before = {n: p.detach().clone() for n, p in s._net.named_parameters()}
    s._opt = torch.optim.SGD(s._net.parameters(), lr=1.0)  # a step is the gradient itself
    s.train_step(batch, masks)
    for p in dropped.parameters():  # no data gradient, and no weight-decay gradient
        assert p.grad is None
    after = dict(s._net.named_parameters())
    for n, p in dropped.named_parameters():
        assert torch.equal(after[f"cells.0.b0_sep_conv_3x3.{n}"], before[
            f"cells.0.b0_sep_conv_3x3.{n}"])
    # a used weight's gradient is the data gradient plus 0.1 * w: recompute the former
    s2, _ = _strategy(weight_decay=0.0)
    s2._net.load_state_dict({**s._net.state_dict(), **before})
    s2._opt = torch.optim.SGD(s2._net.parameters(), lr=1.0)
    s2.train_step(batch, masks)
    w = next(p for p in kept.parameters() if p.dim() == 4)  # its conv's weight
    name = next(n for n, p in s._net.named_parameters() if p is w)
    data_grad = dict(s2._net.named_parameters())[name].grad
    assert torch.allclose(w.grad, data_grad + 0.1 * before[name], atol=1e-6)


def test_candidates_are_evaluated_with_the_other_paths_zeroed_out():
    s, trainer = _strategy()
    sample = {**oneshot.small().default_sample(), "block0/ops": "conv_1x1+max_pool_3x3"}
    paths = s._net.paths_of(sample)
    assert paths["cells.2.ops0"] == [1, 5] and paths["cells.0.in0"] == [0]
    # zeroing the others computes what the sampled architecture computes on those weights
    seen = []
    hook = s._net.cells[0].b0_sep_conv_3x3.register_forward_hook(lambda *a: seen.append(1))
    batch = next(iter(trainer.val_dataloader({})))
    metrics = s.evaluate(sample, [batch])
    hook.remove()
    assert not seen and 0.0 <= metrics["val_acc"] <= 1.0


def test_a_search_trains_with_the_schedule_then_ranks_random_architectures(monkeypatch):
    from retiarii.engine.trainers import trainer as trainer_module

    x, y = trainer_module.load_dataset("digits")  # 300 images: a few batches an epoch
    monkeypatch.setitem(trainer_module._DATASETS, "digits", (x[:300], y[:300]))
    s, trainer = _strategy(epochs=2, search_population=4)
    ctx = lambda seg: SegmentContext(seg, trainer, {}, torch.device("cpu"))  # noqa: E731
    first = s.run_segment(ctx(0))
    assert 0 < first.metrics["dropout_rate"] < 0.5
    second = s.run_segment(ctx(1))
    assert second.metrics["dropout_rate"] == pytest.approx(0.5)
    state = s.state_dict()
    result = s.run_segment(ctx(2))
    assert len(result.models) == 4
    best = max(result.models, key=lambda m: m.metrics["val_acc"])
    assert s.selected() == best.sample
    # resumed from the saved state: the same ranking
    s2, _ = _strategy(epochs=2, search_population=4)
    s2.load_state_dict(state)
    again = s2.run_segment(ctx(2))
    assert [m.metrics for m in again.models] == [m.metrics for m in result.models]
