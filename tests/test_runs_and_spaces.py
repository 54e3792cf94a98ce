"""Runs and spaces as a new user meets them: a space file importing a sibling module runs
under ``retiarii run`` (driver and workers), a failed import says where and why, the folder
travels with a Ray job, and ``--experiment N`` reads or continues any experiment of a store."""
import json
import os
import sys

import pytest

from engine_helpers import InProcessExecutor
from retiarii import cli, refs
from retiarii.engine.storage.store import Store

HERE = os.path.dirname(os.path.abspath(__file__))

SIBLING = '''
import torch
from torch import nn
import retiarii as rt


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        h = rt.ValueChoice([8, 16], label="h")
        self.flatten = nn.Flatten()
        self.fc = rt.nn.Linear(64, h)
        self.act = rt.LayerChoice({"relu": nn.ReLU(), "tanh": nn.Tanh()}, label="act")
        self.out = rt.nn.Linear(h, 10)

    def forward(self, x):
        return self.out(self.act(self.fc(self.flatten(x))))


space = rt.ModelSpace(Net(), example_input=torch.zeros(2, 1, 8, 8))
'''


@pytest.fixture
def space_folder(tmp_path, monkeypatch):
    """proj/mut_space.py (the space) and proj/mut_ws.py (``from mut_space import space``),
    run from another folder, with proj on no import path."""
    proj = tmp_path / "proj"
    proj.mkdir()
    name = f"mut_space_{os.getpid()}_{abs(hash(str(tmp_path))) % 10**8}"  # one per test
    (proj / f"{name}.py").write_text(SIBLING)
    (proj / "mut_ws.py").write_text(f"from {name} import space\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(proj))])
    return proj


def test_a_space_file_importing_a_sibling_runs_under_retiarii_run(space_folder, capsys):
    """Real worker processes: each imports the space file, hence its sibling."""
    db = space_folder / "runs" / "ws.db"
    code = cli.main(["run", str(space_folder / "mut_ws.py"), "--strategy", "random",
                     "--max-models", "2", "--workers", "1", "--epochs", "1", "--optimize", "off",
                     "--store", str(db)])
    assert code == 0, capsys.readouterr().err
    with Store(db) as store:
        store.use_experiment(1)
        assert {t["state"] for t in store.trials()} == {"TERMINATED"}


def test_an_import_failure_says_where_and_what_is_missing(tmp_path, capsys):
    space_file = tmp_path / "broken.py"
    space_file.write_text("import torch\n\nfrom nowhere_to_be_found import space\n")
    assert cli.main(["run", str(space_file), "--store", str(tmp_path / "b.db")]) == 2
    err = capsys.readouterr().err
    assert f"(at {space_file}:3)" in err
    assert f"'nowhere_to_be_found' is neither installed nor a module in {tmp_path}" in err
    assert "to see the traceback" not in err  # `python FILE` would succeed or fail alike
    assert not os.path.exists(tmp_path / "b.db")


def test_a_ray_cluster_run_ships_the_space_folder_without_the_run(space_folder):
    pytest.importorskip("ray", reason="Ray is not installed")
    flags = {"strategy": "random", "seed": 0, "max_models": 2, "workers": 2, "epochs": 1,
             "store": str(space_folder / "runs" / "r.db"), "scheduler": "none",
             "executor": "ray", "address": "127.0.0.1:1"}  # connects on first use only
    exp = cli._build(str(space_folder / "mut_ws.py"), flags, recorded_space="mut_ws.py")
    env = exp.executor.runtime_env
    assert env["working_dir"] == str(space_folder)
    assert "/runs/" in env["excludes"] and "*.db" in env["excludes"]


def test_a_node_loads_the_space_file_from_its_shipped_copy(tmp_path, monkeypatch):
    """What a Ray node does: the driver's path does not exist there, the working_dir copy
    does (add_shipped_folder is what the worker actor calls)."""
    copy = tmp_path / "node_copy"
    copy.mkdir()
    (copy / "sib_mod_for_ship.py").write_text("VALUE = 41\n")
    (copy / "ship_space.py").write_text("from sib_mod_for_ship import VALUE\nX = VALUE + 1\n")
    monkeypatch.setattr(refs, "_SHIPPED", [])
    monkeypatch.setattr(sys, "path", list(sys.path))
    driver_path = str(tmp_path / "driver" / "proj" / "ship_space.py")  # not on this "node"
    with pytest.raises(refs.RefError, match="does not exist"):
        refs.load_file_module(driver_path, fresh=True)
    refs.add_shipped_folder(str(copy))
    assert refs.load_file_module(driver_path, fresh=True).X == 42


# ---- several experiments in one store --------------------------------------------------------


@pytest.fixture
def in_process(monkeypatch):
    monkeypatch.setattr("retiarii.engine.executors.local.LocalExecutor.for_search",
                        lambda *args, **kwargs: InProcessExecutor())


def _run(db, strategy, models):
    space = os.path.join(HERE, "exp_space.py")
    return cli.main(["run", space, "--strategy", strategy, "--max-models", str(models),
                     "--store", str(db)])


def test_experiment_flag_reads_and_continues_any_experiment_of_a_store(
        tmp_path, capsys, in_process):
    db = tmp_path / "two.db"
    assert _run(db, "grid", 1) == 0 and _run(db, "random", 2) == 0
    capsys.readouterr()
    assert cli.main(["status", str(db)]) == 0
    out = capsys.readouterr().out
    assert "experiments (2; * shown" in out and "*2  done" in out and " 1  done" in out
    assert "experiment 2 (done), 2 models" in out
    assert cli.main(["status", str(db), "--experiment", "1", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["experiment"] == 1 and first["models"] == 1
    assert [e["id"] for e in first["experiments"]] == [1, 2]
    assert cli.main(["export", str(db), "--experiment", "1", "--out",
                     str(tmp_path / "out")]) == 0
    assert [p for p in os.listdir(tmp_path / "out") if p.endswith(".py")] == [
        f"model_{first['best'][0]['model_id']}.py"]
    assert cli.main(["plot", str(db), "--experiment", "1", "--out",
                     str(tmp_path / "p.png")]) == 0
    # continuing experiment 1 with a larger budget trains in experiment 1 only
    assert cli.main(["resume", str(db), "--experiment", "1", "--max-models", "2"]) == 0
    with Store(db) as store:
        assert [e["id"] for e in store.experiments()] == [1, 2]
        store.use_experiment(1)
        assert len(store.models()) == 2
        store.use_experiment(2)
        assert len(store.models()) == 2
    capsys.readouterr()
    for command in (["status", str(db)], ["resume", str(db)],
                    ["export", str(db), "--out", str(tmp_path / "o2")],
                    ["plot", str(db), "--out", str(tmp_path / "p2.png")]):
        assert cli.main([*command, "--experiment", "7"]) == 2
        assert "--experiment 7: " in capsys.readouterr().err


# ---- a budget the strategy's start-up spends whole ---------------------------------------------


def test_a_budget_inside_the_start_up_warns_once_naming_the_numbers(tmp_path):
    import warnings

    import retiarii as rt
    from exp_space import space, trainer
    from retiarii.engine.driver.experiment_checks import BudgetWarning

    exp = rt.Experiment(space, "evolution", trainer, store=str(tmp_path / "b.db"),
                        executor=InProcessExecutor(), max_models=2, optimize=False, workers=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exp.run()
    budget = [str(w.message) for w in caught if w.category is BudgetWarning]
    assert budget == ["max_models=2 does not pass the start-up of RegularizedEvolution "
                      "(population_size=16 random models): every model is drawn before it "
                      "learns from a result, a random search. Give max_models > 16, or lower "
                      "its start-up"]


def test_the_start_up_of_each_learning_strategy_is_named():
    import retiarii as rt
    from retiarii.engine.driver.experiment_checks import budget_warning

    tpe = budget_warning(rt.strategies.TPE(n_startup=10), 5, 1, 1)
    assert "max_models=5" in tpe and "n_startup=10 random models" in tpe
    # RL learns from its first result: what is proposed before it comes back is its start-up
    rl = budget_warning(rt.strategies.PolicyBasedRL(seed=0), 10, 2, 8)
    assert "16 models proposed before the first result (2 workers x 8 per job)" in rl
    assert budget_warning(rt.strategies.PolicyBasedRL(seed=0), 17, 2, 8) is None
    assert budget_warning(rt.strategies.TPE(n_startup=10), 11, 1, 1) is None
    assert budget_warning(rt.strategies.Random(seed=0), 1, 4, 8) is None  # never learns
    assert budget_warning(rt.strategies.TPE(n_startup=10), None, 1, 1) is None  # no budget


def test_every_multi_trial_nas_row_runs_its_method_at_its_default_budget(tmp_path, capsys):
    """The launcher's default budget passes each row's start-up (issue #31: at a flat 8 models,
    13 of the 15 multi-trial rows drew every model before learning from one, a random
    search), with half of the models left to the method."""
    from retiarii import nas
    from retiarii.engine.driver.experiment_checks import budget_warning, startup_need

    # hand-computed: amoebanet's population of 8 and 2 workers x 8 models a job -> 16 drawn
    # before the first result, 32 by default; 1 worker -> 8 and 16; optimize=False, one
    # model a job: its population alone -> 16
    assert nas.default_models("amoebanet") == 32 and nas.default_models("amoebanet", 1) == 16
    assert nas.default_models("amoebanet", 1, 1) == 16
    # chamnet's 4 random models: 8 at least
    assert nas.default_models("chamnet", 1, 1) == 8 and nas.default_models("chamnet", 2) == 32
    assert nas.default_models("pnas") == 20  # set by its method: 5 levels of K=4
    for row in nas.ROWS:
        if row.one_shot:
            continue
        for workers, in_job in ((1, 1), (1, 8), (2, 8), (4, 8)):
            budget = nas.default_models(row.name, workers, in_job)
            strategy = nas.strategy(row.name)
            assert budget_warning(strategy, budget, workers, in_job) is None, row.name
            need = startup_need(strategy, workers, in_job)
            assert need is None or budget - need >= need or row.name in nas.MODELS, row.name
    # nas.experiment takes it, and `nas show` states it
    exp = nas.experiment("amoebanet", workers=1, store=str(tmp_path / "a.db"),
                         executor=InProcessExecutor())
    assert exp.max_models == 16
    assert cli.main(["nas", "show", "amoebanet"]) == 0
    assert "default budget:      32 models with 2 workers, 16 with 1" in capsys.readouterr().out
