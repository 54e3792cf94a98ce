"""EfficientNet's two phases (the efficientnet row): the baseline's RL search first, then the
grid of compound coefficients under alpha * beta^2 * gamma^2 ~= 2 with that baseline fixed."""
import itertools
import math

from torch import nn

from model_spaces import efficientnet
from model_spaces._mobile import scale_width
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


def _scaling(b0_models: int, seed: int) -> CompoundScaling:
    """The row's strategy, told accuracy (max) and FLOPs (min), FLOPs target 1e6."""
    s = CompoundScaling(b0_models=b0_models,
                        reward=MnasNetReward("val_acc", "flops", target=1e6), seed=seed)
    s.use_objectives(["max", "min"], ["val_acc", "flops"])
    return s


def test_phases_run_in_order_the_baseline_fixed_before_the_scaling_grid():
    space, s = efficientnet.small(), _scaling(b0_models=3, seed=0)
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
    again = _scaling(b0_models=3, seed=0)
    again.load_state_dict(s.state_dict())
    assert again.phase() == 2 and again.best() == s.best()


def _stages(net):
    """(layers, SE modules, output width) per stage of a built EfficientNet (see
    tests/test_model_spaces_mobile.py: per_stage)."""
    layers, se, width = [0] * 7, [0] * 7, [0] * 7
    for name, m in net.named_modules():
        if name.startswith("layers."):
            s = int(name.split(".")[1]) // 2
            layers[s] += isinstance(m, nn.Conv2d) and m.groups > 1
            se[s] += name.endswith(".se.reduce")
            if isinstance(m, nn.Conv2d) and m.groups == 1 and ".se." not in name:
                width[s] = m.out_channels  # the last is a layer's 1x1 projection
    return layers, se, width


def test_phase1_searches_se_and_layers_and_phase2_scales_the_found_counts_and_filters():
    space, s = efficientnet.small(), _scaling(b0_models=12, seed=1)
    phase1 = [s.ask(space) for _ in range(12)]
    for stage, (_, _, _, n, _) in enumerate(efficientnet.B0_STAGES, 1):
        # the baseline's search varies SE and the layers of every stage (MnasNet's space)
        assert {p[f"stage{stage}/se"] for p in phase1} == {"se", "none"}
        assert len({p[f"stage{stage}/layers"] for p in phase1}) > 1
        assert {p[f"stage{stage}/layers"] for p in phase1} <= {max(1, n - 1), n, n + 1}
    for i, sample in enumerate(phase1):  # the 6th is B0: the best reward
        s.tell(sample, [0.9 if i == 5 else 0.5, 1e6])
    b0 = phase1[5]
    found = [b0[f"stage{k}/layers"] for k in range(1, 8)]
    assert found != [c[3] for c in efficientnet.B0_STAGES]  # not the published B0's counts
    _, se_b0, _ = _stages(space.build(b0))
    filters = [max(4, c // 4) for _, _, c, _, _ in efficientnet.B0_STAGES]  # the small preset's
    phase2 = []
    while True:
        try:
            phase2.append(s.ask(space))
        except SpaceExhausted:
            break
    assert len(phase2) == 8
    for sample in phase2:
        d, w = int(sample["scaling/depth"]), int(sample["scaling/width"])
        layers, se, width = _stages(space.build(sample))
        # depth: ceil(d * the found count) per stage, as the paper rounds up
        assert layers == [math.ceil(m * d / 100) for m in found]
        assert se == [n if has else 0 for n, has in zip(layers, se_b0)]
        # width: B0's filters (not searched: MnasNet-A1's in MnasNet's row) times w, to
        # multiples of 4 (the small preset)
        assert width == [scale_width(c, w, 4) for c in filters]
