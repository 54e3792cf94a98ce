"""The per-operator table's calibration: the fit's arithmetic on hand-made timings, the
calibration measured on whole passes (fake timings), kept in the store with the table and
reloaded, and each device's prediction corrected by that device's own calibration."""
import pytest
import torch

from retiarii.engine.driver import op_latency
from retiarii.engine.driver.op_latency import (CALIBRATION, OpLatencyTable, fit_calibration,
                                               operator_calls)
from retiarii.engine.storage.pareto import FrontTable
from retiarii.engine.storage.store import Store


class Net(torch.nn.Module):  # six calls: the Linear twice, relu, sum, mean, add
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.fc(x)).sum(dim=1) + self.fc(x).mean()


def small():  # two calls: the Linear (one of Net's) and a ReLU module
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())


X = torch.zeros(1, 4)


def keys(module):
    return [k for k, _ in operator_calls(module, X)]


def fill(store, device, ms_of):
    """The device's operator rows: ms_of(key) each."""
    for key in set(keys(Net())) | set(keys(small())):
        FrontTable(store).add_costs(f"op:{key}", device, {"latency_ms": (ms_of(key), 0.0)})


def test_fit_recovers_scale_and_per_call_cost_by_hand():
    # measured = 1.5 * sum + 0.01 * calls exactly
    scale, per_call = fit_calibration([1.0, 2.0, 3.0], [10, 10, 30], [1.6, 3.1, 4.8])
    assert scale == pytest.approx(1.5) and per_call == pytest.approx(0.01)
    # sums proportional to calls: only the scale is fitted, 2 * sum
    assert fit_calibration([1.0, 2.0], [10, 20], [2.0, 4.0]) == (pytest.approx(2.0), 0.0)
    # the exact solution is 2 * sum - 0.01 * calls: a negative per-call cost is dropped and
    # the scale refitted alone on relative errors, sum(s/m) / sum((s/m)^2)
    x1, x2 = 1.0 / 1.9, 2.0 / 3.9
    assert fit_calibration([1.0, 2.0], [10, 10], [1.9, 3.9]) == \
        (pytest.approx((x1 + x2) / (x1 * x1 + x2 * x2)), 0.0)
    # one model: the scale alone makes it exact
    assert fit_calibration([0.5], [4], [1.0]) == (pytest.approx(2.0), 0.0)


def test_fit_refuses_bad_input_by_name():
    with pytest.raises(ValueError, match="at least one model"):
        fit_calibration([], [], [])
    with pytest.raises(ValueError, match="at least one model"):
        fit_calibration([1.0], [2], [1.0, 2.0])
    with pytest.raises(ValueError, match="must be positive"):
        fit_calibration([1.0, 2.0], [1, 3], [1.0, 0.0])
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        OpLatencyTable().calibrate([Net()], X, rounds=0)


def test_calibration_is_fitted_on_whole_passes_stored_and_reloaded(tmp_path, monkeypatch):
    # whole passes, in rounds over [Net, small]: each model's median over the rounds is kept
    passes = iter([1.5, 0.7, 1.2, 0.6, 1.1, 0.9])

    def fake(repeat, device, config=None):
        return next(passes), 0.0  # the operators are all in the store: only passes timed

    monkeypatch.setattr(op_latency, "time_call", fake)
    relu = keys(small())[1]
    with Store(tmp_path / "s.db") as store:
        fill(store, "cpu:1-thread", lambda key: 0.3 if key == relu else 0.1)
        # Net: sum 0.6 over 6 calls, measured 1.2; small: 0.4 over 2, measured 0.7;
        # 1.5 * 0.6 + 0.05 * 6 = 1.2 and 1.5 * 0.4 + 0.05 * 2 = 0.7
        table = OpLatencyTable(store)
        assert table.calibrate([Net(), small()], X, rounds=3) == (pytest.approx(1.5), pytest.approx(0.05))
        assert next(passes, None) is None  # three rounds of two models
        rows = FrontTable(store).costs(CALIBRATION, "cpu:1-thread")
        assert rows == {"scale": (pytest.approx(1.5), None),
                        "per_call_ms": (pytest.approx(0.05), None), "models": (2.0, None)}
    with Store(tmp_path / "s.db") as store:  # another process: read from the store
        again = OpLatencyTable(store)
        assert again.calibration() == (pytest.approx(1.5), pytest.approx(0.05))
        assert again.predict(Net(), X) == pytest.approx(1.5 * 0.6 + 0.05 * 6)
        assert again.predict(Net(), X, calibrated=False) == pytest.approx(0.6)


def test_each_device_is_corrected_by_its_own_calibration(tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("every call is in the store: nothing is timed")

    monkeypatch.setattr(op_latency, "time_call", never)
    with Store(tmp_path / "s.db") as store:
        fill(store, "cpu:1-thread", lambda key: 0.1)
        fill(store, "cuda:Other GPU", lambda key: 0.01)
        fill(store, "cuda:Uncalibrated GPU", lambda key: 0.02)
        front = FrontTable(store)
        front.add_costs(CALIBRATION, "cpu:1-thread",
                        {"scale": (1.5, None), "per_call_ms": (0.05, None)})
        front.add_costs(CALIBRATION, "cuda:Other GPU",
                        {"scale": (3.0, None), "per_call_ms": (0.002, None)})
        table = OpLatencyTable(store)
        assert table.predict(Net(), X) == pytest.approx(1.5 * 0.6 + 0.05 * 6)
        assert table.predict(Net(), X, device="cuda:Other GPU") == \
            pytest.approx(3.0 * 0.06 + 0.002 * 6)
        # a device never calibrated: the plain sum
        assert table.calibration("cuda:Uncalibrated GPU") is None
        assert table.predict(Net(), X, device="cuda:Uncalibrated GPU") == pytest.approx(0.12)


def test_calibration_from_latencies_measured_elsewhere_times_no_pass(tmp_path, monkeypatch):
    # the engine's own latency_ms of models a search measured: nothing is timed again
    def fake(repeat, device, config=None):
        raise AssertionError("a pass was timed although its latency was given")

    monkeypatch.setattr(op_latency, "time_call", fake)
    relu = keys(small())[1]
    with Store(tmp_path / "s.db") as store:
        fill(store, "cpu:1-thread", lambda key: 0.3 if key == relu else 0.1)
        table = OpLatencyTable(store)
        # the sums and calls of the test above: the same fit from the same latencies
        assert table.calibrate([Net(), small()], X, measured=[1.2, 0.7]) == (
            pytest.approx(1.5), pytest.approx(0.05))
        with pytest.raises(ValueError, match="one latency per module"):
            table.calibrate([Net(), small()], X, measured=[1.2])
