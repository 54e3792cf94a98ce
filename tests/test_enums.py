"""The shared enums (issue #11.7): one validation of ``mode`` everywhere, model statuses checked
and stored as the same strings, TrialState below the engine."""
import ast
import doctest
import json
from pathlib import Path

import pytest

import retiarii as rt
import retiarii.enums
from retiarii.engine.storage.store import Store
from retiarii.engine.runner.trial_runner import TrialState as RunnerTrialState
from retiarii.enums import Mode, ModelStatus, TrialState

from exp_space import space, trainer

STRATEGIES = Path(rt.__file__).parent / "strategies"


@pytest.mark.parametrize("make", [
    lambda mode: rt.strategies.Random(seed=0, mode=mode),
    lambda mode: rt.strategies.ASHA("acc", mode),
    lambda mode: rt.strategies.Hyperband("acc", mode),
    lambda mode: rt.strategies.HyperTrick("acc", mode),
    lambda mode: rt.strategies.MedianStopping("acc", mode),
    lambda mode: rt.strategies.PBT("acc", mode, {"lr": rt.strategies.Continuous(0.1, 1.0)}),
    lambda mode: rt.Experiment(space, rt.strategies.Random(seed=0), trainer, mode=mode),
], ids=["strategy", "asha", "hyperband", "hypertrick", "median", "pbt", "experiment"])
def test_every_mode_is_parsed_by_one_helper(make, tmp_path):
    # (an Experiment says it as an ExperimentError, before anything is written)
    with pytest.raises((ValueError, rt.ExperimentError),
                       match="mode must be 'max' or 'min', got 'maximize'"):
        make("maximize")
    made = make("min")
    assert made.mode is Mode.MIN
    assert json.dumps({"mode": made.mode}) == '{"mode": "min"}'  # saved as before


def test_mode_reads_like_the_string_it_replaces():
    assert Mode.parse("max") is Mode.MAX and Mode.parse(Mode.MIN) is Mode.MIN
    assert Mode.MAX == "max" and f"{Mode.MIN}" == "min"
    assert (Mode.MAX.sign, Mode.MIN.sign) == (1.0, -1.0)
    result = doctest.testmod(retiarii.enums)
    assert result.attempted > 0 and result.failed == 0


def test_model_statuses_are_checked_and_stored_as_the_same_strings(tmp_path):
    with Store(tmp_path / "m.db") as store:
        store.add_experiment({}, seed=0)
        model = store.add_model({"a": 1}, status=ModelStatus.TRAINING)
        store.set_model_status(model, ModelStatus.TRAINED, 0.5)
        store.add_model({"a": 2}, status="failed")
        with pytest.raises(ValueError, match="'trainedd' is not a valid ModelStatus"):
            store.set_model_status(model, "trainedd")
        with pytest.raises(ValueError, match="'done' is not a valid ModelStatus"):
            store.add_model({"a": 3}, status="done")
        raw = store.db.execute("SELECT status FROM models ORDER BY id").fetchall()
    assert raw == [("trained",), ("failed",)] and all(type(s) is str for s, in raw)


def test_trial_state_lives_below_the_engine():
    """Schedulers import TrialState from retiarii.enums; no strategy module imports the engine."""
    assert RunnerTrialState is TrialState and rt.engine.TrialState is TrialState
    for path in STRATEGIES.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = {0: "", 1: "retiarii.strategies.", 2: "retiarii."}[node.level]
                module = base + (node.module or "")
                assert not module.startswith("retiarii.engine"), (path.name, module)
