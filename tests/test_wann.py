"""WANN: each network scored over the sweep of shared weights without training (checked against
a hand computation), WANN's ranking over (mean, connections) / (mean, max) on hand cases, the
tournament taking the best-ranked contestant, and the row running through `nas`."""
from __future__ import annotations

import json

import pytest
import torch

from engine_helpers import InProcessExecutor
from retiarii import nas
from retiarii.engine.storage.store import Store
from retiarii.objectives import Scored
from retiarii.strategies import WANN
from retiarii.weight_agnostic import SWEEP, WANNTrainer, connections, wann_order


def _digits(n=40):
    from retiarii.engine.trainers.trainer import load_dataset

    x, y = load_dataset("digits")
    return x[:n], y[:n]


def test_the_sweep_scores_the_minimal_network_as_computed_by_hand():
    from model_spaces import wann

    space = wann.small()
    net = space.build(space.base_model().sample)
    x, y = _digits()
    trainer = WANNTrainer(dataset=(x, y), val_fraction=0.5)
    (xv, yv), = trainer.val_dataloader({})
    metrics = trainer.validation_step(net, (xv, yv))
    # logits = w * (x @ M): a positive w predicts argmax(x @ M), a negative one argmin
    mask = dict(net.named_buffers())["conn_out.mask"]
    z = xv.flatten(1) @ mask
    pos = float((z.argmax(1) == yv).float().mean())
    neg = float((z.argmin(1) == yv).float().mean())
    assert SWEEP == (-2.0, -1.0, -0.5, 0.5, 1.0, 2.0)
    assert metrics["val_acc"] == pytest.approx((pos + neg) / 2)
    assert metrics["val_acc_max"] == pytest.approx(max(pos, neg))
    assert metrics["connections"] == connections(net) == int((mask != 0).sum())
    assert float(dict(net.named_parameters())["weight"].detach()) == 1.0  # put back after the sweep


def test_a_custom_sweep_and_no_training():
    from model_spaces import wann

    space = wann.small()
    net = space.build(space.base_model().sample)
    x, y = _digits()
    trainer = WANNTrainer(dataset=(x, y), weights=[0.5, 1.0])
    metrics = trainer.validation_step(net, trainer.val_dataloader({})[0])
    assert metrics["val_acc"] == metrics["val_acc_max"]  # two positive values: one argmax
    opt = trainer.configure_optimizers(net, {})
    before = [p.detach().clone() for p in net.parameters()]
    loss = trainer.training_step(net, trainer.train_dataloader({}, 0)[0], {})
    loss.backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert len(trainer.train_dataloader({}, 0)) == 1
    with pytest.raises(ValueError, match="never trained"):
        WANNTrainer(lr=0.1)
    with pytest.raises(ValueError, match="one shared scalar weight"):
        trainer.validation_step(torch.nn.Linear(64, 10), trainer.val_dataloader({})[0])


def test_wann_ranking_on_hand_cases():
    scores = [(0.5, 0.9, 3), (0.6, 0.6, 50), (0.4, 0.8, 1)]  # (mean, max, connections)
    # (mean, connections): no one dominates; crowding: 1 and 2 at the ends, 0 inside
    assert wann_order(scores, by_connections=True) == [1, 2, 0]
    # (mean, max): 0 dominates 2 (better mean and max); front {0, 1}, then {2}
    assert wann_order(scores, by_connections=False) == [0, 1, 2]
    # fewer connections at an equal mean wins
    assert wann_order([(0.5, 0.5, 9), (0.5, 0.5, 4)], by_connections=True) == [1, 0]


def test_the_tournament_takes_the_best_ranked_contestant(monkeypatch):
    s = WANN(population_size=3, sample_size=3, seed=0)
    s.use_objectives(["max", "min", "max"])
    # minimized points (-mean, connections, -max) of the three members above
    s._population.extend([("a", Scored((-0.5, 3.0, -0.9))), ("b", Scored((-0.6, 50.0, -0.6))),
                          ("c", Scored((-0.4, 1.0, -0.8)))])
    monkeypatch.setattr(s, "_mutate", lambda space, parent: parent)
    picks = set()
    for _ in range(40):
        picks.add(s._propose(None))
    # by connections the first is b, by max a: both happen (80% / 20%), c never
    assert picks == {"a", "b"}
    with pytest.raises(ValueError, match="mean accuracy, connections and max accuracy"):
        WANN().use_objectives(["max", "max"])


@pytest.mark.slow
def test_the_wann_row_runs_without_training(tmp_path, monkeypatch):
    from retiarii.engine.trainers import trainer as trainer_module

    x, y = trainer_module.load_dataset("digits")
    monkeypatch.setitem(trainer_module._DATASETS, "digits", (x[:80], y[:80]))
    row = nas.get("wann")
    assert row.status == "faithful" and row.runs_with == "WANN"
    exp = nas.experiment("wann", max_models=6, store=str(tmp_path / "w.db"), workers=1,
                         batch_models=1, executor=InProcessExecutor(),
                         options={"population_size": 3, "sample_size": 2})
    assert isinstance(exp.trainer, WANNTrainer)
    summary = exp.run()
    assert summary["models"] == 6 and summary["failures"]["failed"] == 0
    assert summary["objectives"]["metrics"] == ["val_acc", "connections", "val_acc_max"]
    assert summary["pareto"]
    with Store(str(tmp_path / "w.db")) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        models = store.models()
    assert models[0]["sample"] == {"wann/grow0": False}  # the minimal network first
    for m in models:
        values = json.loads(m["values"])
        assert 0 <= values["val_acc"] <= values["val_acc_max"] <= 1 and values["connections"] > 0


# ---- the retraining: the selected topology with trained weights ------------------------------
GROWN = {"wann/grow0": True, "wann/kind0": "insert_node", "wann/connection0": "conn_out",
         "wann/act0": "tanh", "wann/grow1": True, "wann/kind1": "add_connection",
         "wann/pair1": "flatten->out", "wann/grow2": False}


def test_trained_connections_start_as_the_weight_agnostic_network_at_every_shared_value():
    from retiarii import nas_retrain

    agnostic = nas.build_space("wann", "small").build(GROWN)
    trained = nas_retrain.RETRAIN_SPACES.wann.small.build(GROWN)
    owns = {n: p for n, p in trained.named_parameters() if n.endswith(".own")}
    assert set(owns) == {"wann_0_in.own", "wann_0_out.own", "wann_1_add.own"}  # one a connection
    assert [n for n, _ in agnostic.named_parameters()] == ["weight"]  # the search's: shared only
    x, _ = _digits(16)
    for value in SWEEP:
        with torch.no_grad():
            agnostic.weight.fill_(value)
            trained.weight.fill_(value)
        assert torch.equal(agnostic(x), trained(x))


def test_a_step_trains_each_connection_and_absent_connections_stay_absent():
    from retiarii import nas_retrain

    net = nas_retrain.RETRAIN_SPACES.wann.small.build(GROWN)
    x, y = _digits(32)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)  # (Adam's first step is lr * sign)
    torch.nn.functional.cross_entropy(net(x), y).backward()
    optimizer.step()
    conns = [m for m in net.modules() if getattr(m, "trained", False)]
    assert len(conns) == 3
    for conn in conns:
        present = conn.mask > 0
        assert 0 < present.float().mean() < 1
        assert torch.all(conn.own.grad[~present] == 0)  # the mask's zeros pass no gradient
        assert torch.all(conn.own[~present] == 1)  # untouched: absent stays absent
        assert torch.all((conn.mask * conn.own)[~present] == 0)
        # the present ones train, each its own way (not one shared value moving)
        assert (conn.own[present] != 1).float().mean() > 0.5
        assert conn.own[present].unique().numel() > 10


def test_nas_run_wann_retrains_the_selection_with_trained_weights(tmp_path, few_digits,
                                                                  in_process):
    from retiarii import nas_retrain

    db = str(tmp_path / "w.db")
    result = nas_retrain.search_and_retrain(
        "wann", max_models=3, epochs=1, retrain_epochs=1, store=db, workers=1,
        options={"population_size": 3, "sample_size": 2})
    assert 0 <= result.retrained["val_acc"] <= 1
    with Store(db) as store:
        store.use_experiment(result.retrain_experiment)
        config = store.get_experiment()["config"]
        models = store.models()
    assert [m["sample"] for m in models] == [result.selected]
    assert "RETRAIN_SPACES.wann.small" in json.dumps(config)  # the trained-weights space
    assert nas_retrain.space_ref("nasbench201", "small") == "retiarii.nas:SPACES.nasbench201.small"
    assert nas_retrain.recipe("wann").space == (("trained", True),)
