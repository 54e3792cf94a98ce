"""Modules that moved keep their old import paths (retiarii/moved.py): the very same module
object answers the old name, references and pickles written with old names still load, and a
store written before the moves resumes."""
import ast
import importlib
import json
import pickle
import sqlite3
import subprocess
import sys

import pytest

import retiarii
from exp_driver import experiment
from retiarii.moved import MOVED, MOVED_NAMES, current_ref, current_refs
from retiarii.refs import ref_of, resolve_ref
from test_layering import _modules, import_graph


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_old_name_is_the_moved_module(old):
    module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    assert module.__name__ == MOVED[old] and module.__spec__.name == MOVED[old]
    package, _, leaf = old.rpartition(".")
    assert getattr(importlib.import_module(package), leaf) is module  # from package import leaf


def test_the_table_names_no_module_that_exists_and_every_new_one_does():
    modules = _modules()
    assert not set(MOVED) & set(modules), "an old name still has a file: the alias would hide it"
    assert set(MOVED.values()) <= set(modules)


def test_the_package_imports_only_new_names():
    """Old names are for stores, pickles and users' scripts; the package's own code uses the
    new ones, so the table can one day shrink."""
    old = {(m, t) for m, ts in import_graph().items() for t in ts if t in MOVED}
    assert not old


def test_old_names_work_in_a_fresh_interpreter():
    """``import retiarii.engine.trials`` first thing, before anything imported ``retiarii``."""
    code = ("import retiarii.engine.trials as t, retiarii.strategies.evolution as e\n"
            "from retiarii.engine.grouped import TrainingGroup\n"
            "import retiarii.engine.runner.trial_runner as n\n"
            "assert t is n and e.RegularizedEvolution.__module__.endswith('multi_trial.evolution')\n"
            "assert TrainingGroup.__module__ == 'retiarii.engine.worker_side.training_group'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_old_references_resolve_and_new_ones_are_written():
    cls = resolve_ref("retiarii.strategies.evolution:RegularizedEvolution")
    assert cls is retiarii.strategies.RegularizedEvolution
    assert ref_of(cls) == "retiarii.strategies.multi_trial.evolution:RegularizedEvolution"
    assert resolve_ref("retiarii.strategies.one_shot:OneShot") is retiarii.strategies.OneShot
    assert current_ref("retiarii.engine.trainer:ClassifierTrainer") == \
        "retiarii.engine.trainers.trainer:ClassifierTrainer"
    assert current_ref("/abs/file.py:SPACE") == "/abs/file.py:SPACE"
    assert current_refs({"a": ["retiarii.strategies.scheduler:Scheduler", 1]}) == \
        {"a": ["retiarii.strategies.schedulers.base:Scheduler", 1]}


def test_pickles_name_new_modules_and_old_pickles_load():
    from retiarii.engine.runner.trial import Trial

    assert pickle.loads(pickle.dumps(Trial)) is Trial
    assert b"retiarii.engine.runner.trial" in pickle.dumps(Trial, protocol=0)
    old = b"cretiarii.engine.trial\nTrial\n."  # a pickle written before the move (protocol 0)
    assert pickle.loads(old) is Trial


def _write_old_refs(db) -> str:
    """The experiment's config as a store written before the moves holds it."""
    with sqlite3.connect(db) as con:
        (config,) = con.execute("SELECT config FROM experiments").fetchone()
        old = config
        for before, after in MOVED.items():
            old = old.replace(after + ":", before + ":")
        assert old != config  # the config names moved classes (strategy, scheduler)
        con.execute("UPDATE experiments SET config = ?", (old,))
    return old


def test_a_store_written_with_old_references_resumes(tmp_path):
    db = tmp_path / "old.db"
    experiment(str(db), max_models=2, workers=1).run()
    old = _write_old_refs(db)
    assert "retiarii.strategies.random_search:Random" in old
    summary = experiment(str(db), max_models=3, workers=1).resume()
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT count(*) FROM models").fetchone()[0] == 3
        (config,) = con.execute("SELECT config FROM experiments").fetchone()
    assert json.loads(config)["strategy"]["class"] == "retiarii.strategies.random_search:Random"
    assert summary


def test_old_submodule_names_are_attributes_of_their_packages_in_a_fresh_interpreter():
    """``rt.engine.experiment.ExperimentError`` worked when the package imported the module
    itself; it still does, with no import statement naming the old path."""
    code = ("import retiarii as rt\n"
            "assert rt.engine.experiment.ExperimentError is rt.ExperimentError\n"
            "assert rt.strategies.evolution.RegularizedEvolution is "
            "rt.strategies.RegularizedEvolution\n"
            "assert rt.engine.executors.base.Job is rt.engine.jobs.job.Job\n"
            "try:\n    rt.engine.no_such_module\nexcept AttributeError as e:\n"
            "    assert 'no_such_module' in str(e)\nelse:\n    raise SystemExit('no error')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("old", sorted(MOVED_NAMES))
def test_every_moved_name_answers_at_its_old_path(old):
    """The launcher of ranks left optim for the executors: ``from retiarii.optim import spawn``
    (docs/weight_sharing.md) gives the very object the new module holds."""
    module, _, name = old.rpartition(".")
    new = getattr(importlib.import_module(MOVED_NAMES[old]), name)
    assert getattr(importlib.import_module(module), name) is new
    assert resolve_ref(f"{module}:{name}") is new
    assert current_ref(f"{module}:{name}") == f"{MOVED_NAMES[old]}:{name}"
    assert name not in vars(importlib.import_module(module))  # answered, not re-exported


def test_the_moved_names_left_their_old_module_and_exist_in_the_new_one():
    modules = _modules()
    for old, new in MOVED_NAMES.items():
        module, _, name = old.rpartition(".")
        assert module in modules and new in modules
        tree = ast.parse(open(modules[module]).read())
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}
        assert name not in defined, f"{old} is defined again at its old path"


def test_old_names_of_the_rank_launcher_work_in_a_fresh_interpreter():
    code = ("from retiarii.optim import RankError, spawn\n"
            "from retiarii.optim.mixed_parallel import run_segment_on_ranks\n"
            "import retiarii.engine.executors.local_ranks as lr\n"
            "assert spawn is lr.spawn and RankError is lr.RankError\n"
            "assert run_segment_on_ranks is lr.run_segment_on_ranks\n"
            "import retiarii.optim as o\n"
            "try:\n    o.no_such_name\nexcept AttributeError as e:\n"
            "    assert 'no_such_name' in str(e)\nelse:\n    raise SystemExit('no error')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
