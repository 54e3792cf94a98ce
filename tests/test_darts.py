"""The differentiable one-shot strategies (DARTS, GumbelDARTS, ProxylessNAS): each finds the
one candidate that can fit a synthetic task, over several seeds; a resumed search equals an
uninterrupted one bit for bit; they run on the DARTS cell space."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import retiarii as rt
from retiarii.strategies import DARTS, GumbelDARTS, ProxylessNAS, SegmentContext

CPU = torch.device("cpu")


class Regression(rt.Trainer):
    """y = W x for a random W: only a linear layer can fit it; identity, ReLU and tanh cannot."""

    def __init__(self, seed: int, batches: int = 16):
        g = torch.Generator().manual_seed(1000 + seed)
        w = torch.randn(8, 8, generator=g) / 8 ** 0.5
        self.x = torch.randn(batches * 32 + 128, 8, generator=g)
        self.y = self.x @ w.T
        self.n = batches * 32

    def train_dataloader(self, hparams, epoch):
        idx = torch.randperm(self.n, generator=torch.Generator().manual_seed(epoch))
        return [(self.x[i], self.y[i]) for i in idx.split(32)]

    def val_dataloader(self, hparams):
        return [(self.x[i:i + 32], self.y[i:i + 32]) for i in range(self.n, self.n + 128, 32)]

    def configure_optimizers(self, model, hparams):
        return torch.optim.Adam(model.parameters(), lr=0.03)

    def training_step(self, model, batch, hparams):
        x, y = batch
        return F.mse_loss(model(x), y)

    def validation_step(self, model, batch):
        x, y = batch
        return {"val_loss": F.mse_loss(model(x), y), "val_acc": -F.mse_loss(model(x), y)}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.op = rt.LayerChoice({"identity": nn.Identity(), "relu": nn.ReLU(),
                                  "linear": nn.Linear(8, 8), "tanh": nn.Tanh()}, label="op")

    def forward(self, x):
        return self.op(x)


def _space():
    return rt.ModelSpace(Net(), example_input=torch.randn(2, 8))


def _search(strategy, trainer, segments, space=None):
    strategy.setup(space or _space(), trainer, {}, CPU)
    results = [strategy.run_segment(SegmentContext(s, trainer, {}, CPU))
               for s in range(segments)]
    return results


STRATEGIES = {
    "darts": lambda seed: DARTS(epochs=3, arch_lr=0.05, seed=seed),
    "darts-2nd": lambda seed: DARTS(epochs=3, arch_lr=0.05, first_order=False, seed=seed),
    "gumbel": lambda seed: GumbelDARTS(epochs=3, arch_lr=0.05, seed=seed),
    "gumbel-hard": lambda seed: GumbelDARTS(epochs=3, arch_lr=0.05, hard=True, seed=seed),
    "proxyless": lambda seed: ProxylessNAS(epochs=3, arch_lr=0.05, seed=seed),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_strategy_finds_the_candidate_that_fits(name, seed):
    strategy = STRATEGIES[name](seed)
    results = _search(strategy, Regression(seed), 3)
    assert strategy.selected() == {"op": "linear"}
    assert results[-1].models[0].sample == {"op": "linear"}
    p = strategy.relaxation.probabilities()["op"]
    assert int(p.argmax()) == 2
    if name.startswith("darts"):
        assert float(p[2]) > 0.5  # DARTS' weights concentrate on it
    # the entropy of the choice fell from log(4) at the start
    assert results[-1].metrics["arch_entropy"] < torch.log(torch.tensor(4.0)).item() - 0.1


@pytest.mark.parametrize("name", ["darts", "darts-2nd", "gumbel-hard", "proxyless"])
def test_resume_equals_an_uninterrupted_search(name):
    trainer = Regression(0, batches=6)
    whole = STRATEGIES[name](0)
    full = _search(whole, trainer, 2)
    first = STRATEGIES[name](0)
    _search(first, trainer, 1)
    state = first.state_dict()
    torch.manual_seed(123)  # whatever the process did in between
    again = STRATEGIES[name](0)
    again.setup(_space(), trainer, {}, CPU)
    again.load_state_dict(state)
    second = again.run_segment(SegmentContext(1, trainer, {}, CPU))
    assert second.metrics == full[1].metrics
    for a, b in zip(whole.state_dict()["relaxation"].values(),
                    again.state_dict()["relaxation"].values()):
        assert torch.equal(a, b)


def test_segment_reports_metrics_and_the_derived_model():
    strategy = DARTS(epochs=1, arch_lr=0.05)
    (result,) = _search(strategy, Regression(0, batches=4), 1)
    assert set(result.metrics) >= {"train_loss", "arch_loss", "arch_entropy", "val_loss"}
    (model,) = result.models
    assert model.sample == strategy.selected()
    assert model.metrics["train_batches"] == 4
    # the reported val_loss is the derived model's, with the supernet's weights
    net = strategy.export()
    with torch.no_grad():
        losses = [F.mse_loss(net(x), y).item()
                  for x, y in Regression(0, batches=4).val_dataloader({})]
    assert model.metrics["val_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)

@pytest.mark.parametrize("name", list(STRATEGIES))
def test_config_rebuilds_the_strategy(name):
    strategy = STRATEGIES[name](4)
    if name == "proxyless":
        strategy = ProxylessNAS(epochs=2, paths=3, latency={"op": {"linear": 2.0}},
                                latency_weight=0.5, arch_betas=(0.1, 0.9))
    config = json.loads(json.dumps(strategy.config()))
    again = type(strategy)(**config)
    assert again.config() == config
    assert config["seed"] == (0 if name == "proxyless" else 4)


def test_proxyless_latency_term_steers_away_from_a_costly_candidate():
    cheap = ProxylessNAS(epochs=3, arch_lr=0.05, latency={"op": {"linear": 50.0}},
                         latency_weight=1.0)
    _search(cheap, Regression(0), 2)
    assert cheap.selected() != {"op": "linear"}


def test_proxyless_latency_table_errors_name_the_culprit():
    with pytest.raises(ValueError, match="'nope'.*labels are"):
        ProxylessNAS(epochs=1, latency={"nope": {"linear": 1.0}}, latency_weight=1.0).setup(
            _space(), Regression(0), {}, CPU)
    with pytest.raises(ValueError, match="'conv' is not a candidate of label 'op'"):
        ProxylessNAS(epochs=1, latency={"op": {"conv": 1.0}}, latency_weight=1.0).setup(
            _space(), Regression(0), {}, CPU)
    with pytest.raises(ValueError, match="no latency table"):
        ProxylessNAS(epochs=1, latency_weight=1.0)


def test_gumbel_temperature_anneals_geometrically():
    s = GumbelDARTS(epochs=3, temperature=1.0, min_temperature=0.25)
    assert [s.temperature_at(e) for e in range(3)] == pytest.approx([1.0, 0.5, 0.25])
    with pytest.raises(ValueError, match="min_temperature"):
        GumbelDARTS(epochs=3, temperature=0.1, min_temperature=1.0)


def test_using_a_strategy_before_setup_says_so():
    with pytest.raises(RuntimeError, match="setup"):
        DARTS(epochs=1).selected()


@pytest.mark.slow
@pytest.mark.parametrize("cls", [DARTS, GumbelDARTS, ProxylessNAS])
def test_darts_cell_space_on_digits(cls):
    from model_spaces import darts

    space = darts.small()
    trainer = rt.Trainer(dataset="digits", batch_size=128)
    strategy = cls(epochs=1)
    strategy.setup(space, trainer, {}, CPU)
    ctx = SegmentContext(0, trainer, {}, CPU, train=trainer.train_dataloader({}, 0)[:3])
    result = strategy.run_segment(ctx)
    sample = strategy.selected()
    assert space.replay(sample).sample == sample
    assert 0.0 <= result.metrics["val_acc"] <= 1.0
    net = strategy.export(sample).eval()
    x, y = trainer.val_dataloader({})[0]
    with torch.no_grad():
        acc = (net(x.float()).argmax(1) == y).float().mean().item()
    strategy.relaxation.fix(sample).eval()
    with torch.no_grad():
        acc_super = (strategy.relaxation(x.float()).argmax(1) == y).float().mean().item()
    assert acc == pytest.approx(acc_super)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["darts", "gumbel-hard", "proxyless"])
def test_search_on_a_gpu(name):
    cuda = torch.device("cuda")
    trainer = Regression(0)
    strategy = STRATEGIES[name](0)
    strategy.setup(_space(), trainer, {}, cuda)
    for seg in range(3):
        strategy.run_segment(SegmentContext(seg, trainer, {}, cuda))
    assert strategy.selected() == {"op": "linear"}
    relax = strategy.relaxation.fix({"op": "linear"})
    x = torch.randn(4, 8)
    net = strategy.export({"op": "linear"})
    torch.testing.assert_close(relax(x.to(cuda)).cpu(), net(x), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_benchmark_runs_quick():
    """benchmarks/differentiable.py --quick (slow: it reads the DARTS space, ~10-30 s)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import differentiable

    rows = differentiable.main(["--quick", "--strategies", "darts", "proxyless"])
    assert [r["strategy"] for r in rows] == ["darts", "proxyless"]
    for row in rows:
        assert 0.0 <= row["retrained_val_acc"] <= 1.0 and row["models"] >= 1
