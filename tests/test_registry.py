"""The one registry of names (retiarii/registry.py), and ``Experiment(...)`` checking its
arguments before it writes anything: the names resolve to the same classes in the CLI,
``retiarii nas`` and ``Experiment``; a name not found is refused with the valid ones."""
import os
import pathlib
import subprocess
import sys

import pytest

import retiarii as rt
from exp_space import space, trainer
from retiarii import nas, registry
from retiarii.cli import main
from retiarii.engine.jobs.job import Executor
from retiarii.strategies import OneShot, Scheduler, Strategy


@pytest.mark.parametrize("name", registry.strategy_names())
def test_every_strategy_name_builds_its_class_by_name_and_by_class_name(name):
    cls = registry.strategy_class(name)
    assert issubclass(cls, (Strategy, OneShot))
    assert cls is getattr(rt.strategies, cls.__name__)  # the public class, not a copy
    assert registry.strategy_class(cls.__name__) is cls
    built = registry.make_strategy(name, seed=3)
    assert type(built) is cls and getattr(built, "seed", 3) == 3
    assert registry.is_one_shot(name) == isinstance(built, OneShot)


def test_schedulers_and_executors_resolve_to_their_classes():
    asha = registry.make_scheduler("asha", "val_acc", "max", max_t=7)
    assert isinstance(asha, rt.strategies.ASHA) and isinstance(asha, Scheduler)
    assert isinstance(registry.make_scheduler("median"), rt.strategies.MedianStopping)
    assert registry.make_scheduler("none") is None
    local = registry.make_executor("local", 3, [])
    assert isinstance(local, Executor) and local.num_slots == 3
    assert registry.make_executor("local", 3, [], one_shot=True).num_slots == 1  # one segment


def test_a_near_miss_is_refused_with_did_you_mean_and_the_valid_names():
    with pytest.raises(registry.UnknownName) as err:
        registry.make_strategy("evolutoin")
    text = str(err.value)
    assert "did you mean 'evolution'?" in text
    assert all(n in text for n in registry.strategy_names())
    with pytest.raises(registry.UnknownName, match="did you mean 'asha'"):
        registry.make_scheduler("ashaa")
    with pytest.raises(registry.UnknownName, match="unknown executor 'kubernetes'; valid"):
        registry.entry("executor", "kubernetes")


def test_importing_the_registry_and_the_cli_does_not_import_ray():
    code = ("import sys, retiarii.registry, retiarii.cli; "
            "retiarii.registry.entry('executor', 'ray'); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_every_nas_row_runs_a_registered_strategy():
    for row in nas.ROWS:
        if row.runs_with:
            e = registry.entry("strategy", row.runs_with)
            assert row.one_shot == (e.name in registry.ONE_SHOT), row.name


def test_cli_strategy_near_miss_says_did_you_mean(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run", "demo", "--strategy", "evolutoin"])
    assert exit_.value.code == 2
    assert "did you mean 'evolution'?" in capsys.readouterr().err


def test_a_space_file_strategy_name_resolves_or_is_refused(tmp_path, capsys):
    from retiarii.cli import _build

    here = os.path.dirname(os.path.abspath(__file__))
    flags = {"strategy": None, "seed": 4, "max_models": 2, "workers": 1, "epochs": None,
             "store": str(tmp_path / "s.db"), "scheduler": "none", "executor": "local"}
    for value, ok in (("tpe", True), ("evolutoin", False)):
        path = tmp_path / f"space_{ok}.py"
        path.write_text(f"import sys\nsys.path.insert(0, {here!r})\n"
                        f"from exp_space import space\nstrategy = {value!r}\n")
        if ok:
            exp = _build(str(path), flags, recorded_space=str(path))
            assert type(exp.strategy) is rt.strategies.TPE and exp.strategy.seed == 4
        else:
            assert main(["run", str(path), "--store", flags["store"]]) == 2
            err = capsys.readouterr().err
            assert "strategy = 'evolutoin'" in err and "did you mean 'evolution'?" in err
    assert not os.path.exists(flags["store"])


# ---- Experiment(...) checks every argument at construction, before writing anything ----------


def test_experiment_takes_a_strategy_name_as_the_cli_builds_it(tmp_path):
    exp = rt.Experiment(space, "evolution", trainer, store=str(tmp_path / "e.db"), seed=5,
                        scheduler="asha")
    assert type(exp.strategy) is rt.strategies.RegularizedEvolution
    assert exp.strategy.config() == registry.make_strategy("evolution", seed=5).config()
    assert isinstance(exp.scheduler, rt.strategies.ASHA)
    assert os.listdir(tmp_path) == []


BAD = [
    ({"strategy": "evolutoin"}, r"strategy='evolutoin'.*did you mean 'evolution'\?.*valid: random"),
    ({"strategy": object()}, r"is not a strategy: give one of rt.strategies"),
    ({"strategy": rt.strategies.Random}, r"give an instance \(Random\(...\)\)"),
    ({"trainer": "digits"}, r"trainer='digits' is not a Trainer"),
    ({"scheduler": "ashaa"}, r"did you mean 'asha'"),
    ({"scheduler": 3}, r"scheduler=3 is not a scheduler"),
    ({"executor": "rey"}, r"did you mean 'ray'"),
    ({"executor": object()}, r"is not an Executor"),
    ({"workers": 0}, r"workers=0: give a whole number >= 1"),
    ({"max_models": "10"}, r"max_models='10'"),
    ({"max_time": -1}, r"max_time=-1: give seconds > 0"),
    ({"seed": 1.5}, r"seed=1.5"),
    ({"metric": ""}, r"metric=''"),
    ({"max_failures": -1}, r"max_failures=-1"),
    ({"dedup": "yes"}, r"dedup='yes'"),
    ({"progress": 3}, r"progress=3"),
    ({"devices": "0"}, r"devices='0'"),
]


@pytest.mark.parametrize("bad,message", BAD, ids=[next(iter(b)) + str(i) for i, (b, _) in
                                                   enumerate(BAD)])
def test_experiment_refuses_a_bad_argument_and_writes_nothing(tmp_path, bad, message):
    args = {"strategy": rt.strategies.Random(seed=0), "trainer": trainer}
    args.update(bad)
    store = tmp_path / "runs" / "x.db"
    with pytest.raises(rt.ExperimentError, match=message):
        rt.Experiment(space, args.pop("strategy"), args.pop("trainer"), store=str(store), **args)
    assert os.listdir(tmp_path) == []  # no folder, no store, no lock file


def test_a_store_that_is_a_folder_is_refused(tmp_path):
    with pytest.raises(rt.ExperimentError, match="is a folder: give the path of a SQLite file"):
        rt.Experiment(space, "random", trainer, store=str(tmp_path))


def test_epochs_of_a_one_shot_strategy_are_its_training_segments_as_the_docs_say():
    """#28: `--epochs 2` ran 3 segments for SPOS while docs/cli.md said `--epochs` is the
    segment count: the docs now say SPOS adds its search segment; this holds them to it."""
    from retiarii import registry

    assert registry.make_strategy("spos", segments=2).num_segments() == 3  # + the search
    for name in ("darts", "gumbel", "proxyless", "enas"):
        assert registry.make_strategy(name, segments=2).num_segments() == 2, name
    text = (pathlib.Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    assert "`--epochs 2`: 3 segments" in " ".join(text.split())
