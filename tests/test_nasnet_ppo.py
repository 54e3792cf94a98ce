"""NASNet's controller learns by PPO (Zoph et al., CVPR 2018): the clipped surrogate on hand-computed
values, the old policy kept from the draw, one update per batch, resume = uninterrupted."""
from __future__ import annotations

import math

import pytest
import torch

from retiarii import nas
from retiarii.sampler import sample_key
from retiarii.strategies import PolicyBasedRL
from retiarii.strategies.multi_trial.ppo import clipped_surrogate, ppo_update


class Space:
    ops = ["conv", "pool", "skip"]

    def sample(self, sampler):
        s = {}
        for i in range(3):
            s[f"op{i}"] = self.ops[sampler.choose(f"op{i}", self.ops, dict(s))]
        return type("Model", (), {"sample": s})()


def reward(sample: dict) -> float:
    return float(sum(op == "conv" for op in sample.values()))


def test_clipped_surrogate_on_hand_computed_values():
    # ratios 1.5, 0.5, 1.1, 0.7 ; advantages +2, +2, -1, -1 ; eps 0.2
    ratio = torch.tensor([1.5, 0.5, 1.1, 0.7])
    adv = torch.tensor([2.0, 2.0, -1.0, -1.0])
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    got = clipped_surrogate(old + ratio.log(), old, adv, 0.2)
    # min(1.5*2, 1.2*2) = 2.4 ; min(0.5*2, 0.8*2) = 1.0 ; min(-1.1, -1.1) = -1.1 ;
    # min(-0.7, -0.8) = -0.8 (a negative advantage: the pessimistic, clipped side)
    torch.testing.assert_close(got, torch.tensor([2.4, 1.0, -1.1, -0.8]))


def test_a_clipped_ratio_gets_no_gradient_and_an_unclipped_one_does():
    log_prob = torch.tensor([math.log(1.5), math.log(1.1)], requires_grad=True)
    out = clipped_surrogate(log_prob, torch.zeros(2), torch.tensor([1.0, 1.0]), 0.2).sum()
    out.backward()
    # d/dlogp (rho A) = rho A where unclipped; 0 past 1 + eps with A > 0
    torch.testing.assert_close(log_prob.grad, torch.tensor([0.0, 1.1]))


def test_ppo_update_steps_epochs_times_on_the_batch_mean():
    theta = torch.nn.Parameter(torch.tensor([0.0]))
    opt = torch.optim.SGD([theta], lr=0.1)
    calls = []

    def logp(i):  # log p(a_i) = theta * (i + 1), no entropy
        calls.append(i)
        return theta[0] * (i + 1), torch.zeros(())

    losses = ppo_update(logp, [0.0, 0.0], [1.0, 1.0], opt, epochs=3, clip=0.2,
                        entropy_weight=0.0)
    assert calls == [0, 1] * 3 and len(losses) == 3
    # step 1 at theta 0: ratios 1, grad of -mean(rho_i) = -(1 + 2) / 2 -> theta = 0.15
    assert losses[0] == pytest.approx(-1.0)
    # step 2 at 0.15: ratios e^.15 = 1.162 (kept), e^.3 = 1.35 (clipped: no gradient)
    # grad = -(1.162 * 1) / 2 -> theta = 0.15 + 0.0581
    assert theta.item() != pytest.approx(0.15)
    expected = 0.15 + 0.1 * math.exp(0.15) / 2
    expected += 0.1 * (math.exp(expected) if math.exp(expected) <= 1.2 else 0.0) / 2
    assert theta.item() == pytest.approx(expected, rel=1e-5)


def test_ppo_keeps_the_drawing_policy_and_updates_once_per_batch():
    rl = PolicyBasedRL(seed=0, algorithm="ppo", ppo_batch=3, ppo_epochs=2)
    space = Space()
    before = [p.detach().clone() for p in rl._controller.parameters()]
    samples = []
    for _ in range(3):
        sample = rl.ask(space)
        # the old log-probability is the policy's when it drew the sample (no update yet)
        assert rl._old_log_prob[sample_key(sample)] == pytest.approx(
            math.log(rl.probability(space, sample)), abs=1e-6)
        samples.append(sample)
    for s in samples[:2]:
        rl.tell(s, reward(s))
    after_two = list(rl._controller.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after_two))  # no step yet
    rl.tell(samples[2], reward(samples[2]))
    assert not all(torch.equal(a, b) for a, b in zip(before, rl._controller.parameters()))
    assert rl._batch == [] and rl._old_log_prob == {}


def test_ppo_learns_and_resumes_equal_to_uninterrupted():
    space = Space()

    def run(n, rl):
        for _ in range(n):
            s = rl.ask(space)
            rl.tell(s, reward(s))
        return rl

    best = {"op0": "conv", "op1": "conv", "op2": "conv"}
    rl = PolicyBasedRL(seed=1, algorithm="ppo", ppo_batch=4, ppo_epochs=4,
                       learning_rate=0.05, dedup=False)
    start = rl.probability(space, best)
    run(40, rl)
    assert rl.probability(space, best) > 2 * start

    a = run(6, PolicyBasedRL(seed=2, algorithm="ppo"))  # mid-batch: 2 told of the next 4
    pending = a.ask(space)  # and one pending: its old log-probability is in the state
    b = PolicyBasedRL(seed=2, algorithm="ppo")
    b.load_state_dict(a.state_dict())
    for s in (a, b):
        s.tell(pending, reward(pending))
        run(7, s)
    state_a, state_b = a.state_dict(), b.state_dict()
    state_a.pop("elapsed"), state_b.pop("elapsed")  # wall time of the two runs
    assert state_a == state_b
    assert a.best() == b.best()


def test_ppo_bad_settings_name_the_culprit():
    with pytest.raises(ValueError, match="algorithm"):
        PolicyBasedRL(algorithm="a2c")
    with pytest.raises(ValueError, match="ppo_batch"):
        PolicyBasedRL(algorithm="ppo", ppo_batch=0)
    with pytest.raises(ValueError, match="clip"):
        PolicyBasedRL(algorithm="ppo", clip=1.5)


def test_the_nasnet_row_runs_ppo_and_is_faithful():
    rl = nas.strategy("nasnet", seed=0)
    assert isinstance(rl, PolicyBasedRL) and rl.algorithm == "ppo"
    assert nas.get("nasnet").status == "faithful"
    assert rl.config()["algorithm"] == "ppo"
