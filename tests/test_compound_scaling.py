"""EfficientNet's two phases (the efficientnet row): the baseline's RL search first, then the
grid of compound coefficients under alpha * beta^2 * gamma^2 ~= 2 with that baseline fixed."""
import itertools

from model_spaces import efficientnet
from retiarii.scalarization import MnasNetReward
from retiarii.strategies.multi_trial.base import SpaceExhausted
from retiarii.strategies.multi_trial.compound_scaling import CompoundScaling, constrained_grid

SCALING = ("scaling/depth", "scaling/width", "scaling/resolution")


def test_the_grid_proposes_only_triples_that_meet_the_constraint():
    grid = [1.0, 1.05, 1.1, 1.15, 1.2, 1.3, 1.4]
    triples = constrained_grid(grid, grid, grid, 2.0, 0.05)
    assert triples and (1.2, 1.1, 1.15) in triples  # the paper's: 1.2 * 1.21 * 1.3225 = 1.92
    for a, b, g in triples:
        assert min(a, b, g) >= 1 and abs(a * b * b * g * g - 2) <= 0.1
    # and every triple of the grid that meets it is proposed
    meets = [t for t in itertools.product(grid, grid, grid)
             if abs(t[0] * t[1] ** 2 * t[2] ** 2 - 2) <= 0.1]
    assert sorted(triples) == sorted(meets)
    assert constrained_grid([0.9, 1.0], [1.0], [1.5], 2.0, 0.2) == [(1.0, 1.0, 1.5)]  # < 1 out


def test_phases_run_in_order_the_baseline_fixed_before_the_scaling_grid():
    space = efficientnet.small()
    reward = MnasNetReward("val_acc", "flops", target=1e6)
    s = CompoundScaling(b0_models=3, reward=reward, seed=0)
    s.use_objectives(["max", "min"], ["val_acc", "flops"])
    phase1 = [s.ask(space) for _ in range(3)]
    for sample in phase1:  # the baseline's search holds the scaling at 1
        assert [sample[k] for k in SCALING] == [100, 100, 8] or \
            [str(sample[k]) for k in SCALING] == ["100", "100", "8"]
    # in flight: the scaling search waits for the baseline
    try:
        s.ask(space)
        raise AssertionError("the scaling search started before the baseline was told")
    except SpaceExhausted:
        pass
    assert s.phase() == 1
    # the best reward wins, not the best accuracy: 0.9 at 4x the FLOPs loses to 0.88 at T
    values = [[0.5, 1e6], [0.9, 4e6], [0.88, 1e6]]
    for sample, value in zip(phase1, values):
        s.tell(sample, value)
    b0 = phase1[2]
    phase2 = []
    while True:
        try:
            phase2.append(s.ask(space))
        except SpaceExhausted:
            break
    # the small preset's grid: depth 1, 1.2, 1.4; width 1, 1.1, 1.2; resolution 8, 9, 10 px
    # (1, 1.125, 1.25): 8 of its 27 triples are within 10% of 2
    assert s.phase() == 2 and len(phase2) == 8
    for sample in phase2:
        assert {k: v for k, v in sample.items() if k not in SCALING} == \
            {k: v for k, v in b0.items() if k not in SCALING}
        d, w = float(sample["scaling/depth"]) / 100, float(sample["scaling/width"]) / 100
        r = float(sample["scaling/resolution"]) / 8
        assert abs(d * w * w * r * r - 2) <= 0.2
    for i, sample in enumerate(phase2):
        s.tell(sample, [0.8 + i / 100, 2e6])
    assert s.best()[0] == phase2[-1]
    # a resumed strategy is in the same place
    again = CompoundScaling(b0_models=3, reward=reward, seed=0)
    again.use_objectives(["max", "min"], ["val_acc", "flops"])
    again.load_state_dict(s.state_dict())
    assert again.phase() == 2 and again.best() == s.best()
