"""The per-operator latency table: operator calls and their keys by hand, the prediction as
the sum over calls, rows kept in the store and read for a target device without measuring,
a device whose table lacks a call refused by name, and the cost in an experiment."""
import pytest
import torch

import retiarii as rt
from engine_helpers import InProcessExecutor
from exp_space import space
from retiarii.engine.driver import op_latency
from retiarii.engine.driver.op_latency import OpLatencyTable, describe, operator_calls
from retiarii.engine.storage.pareto import FrontTable
from retiarii.engine.storage.store import Store


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.fc(x)).sum(dim=1) + self.fc(x).mean()


KEYS = ["Linear(in_features=4, out_features=3, bias=True)(f32[1, 4])", "relu(f32[1, 3])",
        ".sum(f32[1, 3], dim=1)", "Linear(in_features=4, out_features=3, bias=True)(f32[1, 4])",
        ".mean(f32[1, 3])", "add(f32[1], f32[])"]


def test_operator_calls_and_keys_by_hand():
    assert describe((torch.zeros(2, 3, dtype=torch.int64), [0.5, None])) == \
        "(int64[2, 3], [0.5, None])"
    x = torch.randn(1, 4)
    calls = operator_calls(Net(), x)
    assert [k for k, _ in calls] == KEYS
    # each call repeats the very operation on the arguments it got
    net = Net()
    assert torch.equal(operator_calls(net, x)[0][1](), net.fc(x))


def test_prediction_is_the_sum_over_calls_of_a_target_devices_table(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a target device's table is read, never measured here")

    monkeypatch.setattr(op_latency, "time_call", never)
    table = OpLatencyTable()
    values = {KEYS[0]: 0.5, KEYS[1]: 0.25, KEYS[2]: 0.125, KEYS[4]: 0.0625, KEYS[5]: 1.0}
    table._memory = {("cuda:Other GPU", k): v for k, v in values.items()}
    # the Linear is called twice: counted twice
    assert table.predict(Net(), torch.zeros(1, 4), device="cuda:Other GPU") == \
        0.5 * 2 + 0.25 + 0.125 + 0.0625 + 1.0
    del table._memory[("cuda:Other GPU", KEYS[1])]
    with pytest.raises(KeyError, match=r"lacks 1 operator calls of this model \(first: "
                                       r"relu\(f32\[1, 3\]\)\)"):
        table.predict(Net(), torch.zeros(1, 4), device="cuda:Other GPU")


def test_rows_are_kept_in_the_store_and_measured_once(tmp_path, monkeypatch):
    timed = []

    def fake(repeat, device, config=None):
        timed.append(repeat())
        return 0.1 * len(timed), 0.0

    monkeypatch.setattr(op_latency, "time_call", fake)
    with Store(tmp_path / "s.db") as store:
        first = OpLatencyTable(store).predict(Net(), torch.zeros(1, 4))
        assert len(timed) == 5  # five distinct calls of six
        assert first == pytest.approx(0.1 + 0.2 + 0.3 + 0.1 + 0.4 + 0.5)
        # another table object, another model sharing the Linear: only the new calls timed
        again = OpLatencyTable(store).predict(Net(), torch.zeros(1, 4))
        assert again == first and len(timed) == 5
        row = FrontTable(store).costs(f"op:{KEYS[0]}", "cpu:1-thread")
        assert row == {"latency_ms": (pytest.approx(0.1), 0.0)}


def test_predicted_latency_as_an_objective(tmp_path):
    trainer = rt.Trainer(dataset="digits", epochs=1, batch_size=256)
    db = tmp_path / "p.db"
    rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=str(db), workers=1,
                  max_models=2, executor=InProcessExecutor(), optimize=False,
                  metric=["val_acc", "predicted_latency_ms"], mode=["max", "min"]).run()
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        models = FrontTable(store).models()
        ops = store.db.execute("SELECT count(*) FROM costs WHERE hash LIKE 'op:%'").fetchone()[0]
    assert len(models) == 2 and all(m["values"]["predicted_latency_ms"] > 0 for m in models)
    assert ops >= 3  # the two linear layers and the activation, at least


class Choice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.op = rt.LayerChoice({"id": torch.nn.Identity(),
                                  "convrelu": torch.nn.Sequential(torch.nn.Conv2d(1, 1, 1),
                                                                  torch.nn.ReLU())},
                                 label="op")
        self.width = rt.ValueChoice([2, 4], label="width")
        self.fc = rt.nn.Linear(64, self.width)

    def forward(self, x):
        return self.fc(self.op(x).flatten(1))


def test_choice_latencies_are_each_candidates_difference_over_the_base(monkeypatch):
    # every operator call costs 1 ms: a model's prediction counts its calls
    monkeypatch.setattr(op_latency, "time_call", lambda repeat, device, config=None: (1.0, 0.0))
    choice_space = rt.ModelSpace(Choice(), example_input=torch.zeros(1, 1, 8, 8))
    table = op_latency.choice_latencies(choice_space, OpLatencyTable())
    # base: id, width 2; convrelu adds one call (conv and relu for identity); the width
    # changes no call count
    assert table == {"op": {"id": 0.0, "convrelu": 1.0}, "width": {2: 0.0, 4: 0.0}}


@pytest.mark.slow  # ~30 s: 150 models of the space built for the table
def test_nas_proxylessnas_gets_its_latency_term_and_resumes_with_it(tmp_path, monkeypatch):
    from retiarii import nas

    timed = []

    def fake(repeat, device, config=None):
        timed.append(1)
        return 0.001 * len(timed), 0.0

    monkeypatch.setattr(op_latency, "time_call", fake)
    db = str(tmp_path / "p.db")
    first = nas.experiment("proxylessnas", epochs=1, workers=1, store=db)
    labels = [f"layer{i}" for i in range(1, 22)]
    assert sorted(first.strategy.latency) == sorted(labels)
    assert first.strategy.latency_weight == nas.LATENCY_TERM["proxylessnas"] == 1.0
    measured = len(timed)
    again = nas.experiment("proxylessnas", epochs=1, workers=1, store=db)
    assert len(timed) == measured  # read from the store: nothing timed again
    assert again.strategy.latency == first.strategy.latency
    # a latency given by the user wins
    mine = nas.experiment("proxylessnas", epochs=1, workers=1, store=db,
                          options={"latency": {"layer1": {"k3_e3": 1.0}}})
    assert mine.strategy.latency == {"layer1": {"k3_e3": 1.0}}
