"""References (refs.py), exports of a user's space file, and stores as trusted input.

The user-level tests run as a user would: the space is a script in its own folder, `retiarii run`
and `retiarii export` run in separate processes from different directories, and the exported
file runs in a fresh interpreter where retiarii cannot be imported.
"""
import ast
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import retiarii as rt
from retiarii import codec
from retiarii.codegen import to_source
from retiarii.engine.worker_side import worker
from retiarii.refs import (
    RefError, TrustedRefs, load_file_module, only_trusted, ref_of, resolve_ref,
)

ROOT = Path(__file__).resolve().parents[1]

SPACE_FILE = '''
import torch
import torch.nn.functional as F
from torch import nn
import retiarii as rt

GAIN = 0.5


def halve(x):
    return x * GAIN


class Base(nn.Module):
    """A base class of the user's own: copied along with the leaf."""

    scale = GAIN


@rt.leaf
class Block(Base):
    """A residual block, opaque to tracing."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + halve(F.relu(self.fc(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(64, 16)
        self.block = rt.LayerChoice({"block": Block(16), "id": nn.Identity()}, label="b")
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc2(self.block(self.fc1(self.flatten(x))))


space = rt.ModelSpace(Net(), example_input=torch.zeros(2, 1, 8, 8))
'''


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _cli(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "retiarii.cli", *map(str, args)], cwd=cwd,
                          env=_env(), capture_output=True, text=True, timeout=300)


# ---- one resolver, one producer -------------------------------------------------------------


def test_one_resolver_accepts_both_forms_everywhere(tmp_path):
    path = tmp_path / "helpers.py"
    path.write_text("def double(x):\n    return 2 * x\n\nclass K:\n    class Inner:\n"
                    "        pass\n")
    fn = resolve_ref(f"{path}:double")
    assert fn(3) == 6
    assert resolve_ref(f"{path}:K.Inner").__name__ == "Inner"
    # the codec (graphs) and the workers (trial specs) resolve through the same function
    assert codec.resolve_ref is resolve_ref and worker.resolve_ref is resolve_ref
    assert codec.decode({"__ref__": f"{path}:double"}) is fn
    assert resolve_ref("torch.nn.modules.conv:Conv2d") is torch.nn.Conv2d
    with pytest.raises(ValueError, match="must be absolute"):
        resolve_ref("relative/file.py:X")
    with pytest.raises(ValueError, match="must look like"):
        resolve_ref("no_colon")
    with pytest.raises(ImportError, match="has no attribute"):
        resolve_ref(f"{path}:missing")
    with pytest.raises(ImportError, match="does not exist"):
        resolve_ref(f"{tmp_path / 'nope.py'}:x")


def test_objects_of_a_loaded_file_are_named_by_the_file(tmp_path):
    """A class of a file loaded as a module (the CLI loads space files so) is named by the
    file's path, which resolves in any later process, not by the module name only this
    process knows."""
    path = tmp_path / "userspace.py"
    path.write_text(SPACE_FILE)
    module = load_file_module(str(path))
    assert ref_of(module.Block) == f"{path}:Block"
    assert ref_of(module.halve) == f"{path}:halve"
    assert ref_of(module.space) == f"{path}:space"  # an instance: by its variable
    # A fresh process (here: a fresh load, not the running one) finds the same class
    fresh = resolve_ref(f"{path}:Block", fresh=True)
    assert fresh is not module.Block and fresh.__qualname__ == "Block"


# ---- export of a space file with a leaf class (issue 10.7) ----------------------------------


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    """`retiarii run space.py` in the space's folder, as a user does."""
    tmp = tmp_path_factory.mktemp("user")
    project = tmp / "project"
    project.mkdir()
    (project / "space.py").write_text(SPACE_FILE)
    run = _cli("run", "space.py", "--strategy", "grid", "--max-models", "2", "--epochs", "1",
               "--workers", "1", "--store", "D/x.db", cwd=project)
    assert run.returncode == 0, run.stderr[-3000:]
    return tmp, project / "D" / "x.db"


def test_export_of_a_space_file_with_a_leaf_needs_only_torch(user_run):
    tmp, db = user_run
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    export = _cli("export", db, "--top", "2", "--out", "E", cwd=elsewhere)
    assert export.returncode == 0, export.stderr[-3000:]
    files = sorted((elsewhere / "E").glob("model_*.py"))
    assert len(files) == 2
    with_block = [f for f in files if "Block(16)" in f.read_text()]
    assert len(with_block) == 1
    for py in files:
        source = py.read_text()
        assert "Needs only torch." in source.splitlines()[0]
        imported = {alias.name.split(".")[0] for node in ast.parse(source).body
                    if isinstance(node, (ast.Import, ast.ImportFrom))
                    for alias in (node.names if isinstance(node, ast.Import)
                                  else [ast.alias(node.module)])}
        assert imported == {"torch"}, source
    source = with_block[0].read_text()
    assert "rt.leaf" not in source and "class Block(Base)" in source and "def halve(" in source
    assert "class Base(nn.Module)" in source
    assert "GAIN = 0.5" in source
    # The exported file runs in a fresh interpreter that cannot import retiarii, and computes
    # what the space's own model computes with the trained weights.
    py = with_block[0]
    script = textwrap.dedent(f"""
        import importlib.util, sys, torch
        class NoRetiarii:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] == 'retiarii':
                    raise ImportError('retiarii is not installed here')
        sys.meta_path.insert(0, NoRetiarii())
        torch.manual_seed(0)
        spec = importlib.util.spec_from_file_location('exported', {str(py)!r})
        m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
        net = getattr(m, 'Model' + {py.stem.split('_')[1]!r})()
        net.load_state_dict(torch.load({str(py.with_suffix('.pt'))!r}))
        net.eval()
        x = torch.arange(2 * 64, dtype=torch.float32).reshape(2, 1, 8, 8) / 100
        torch.save(net(x).detach(), {str(tmp / 'y.pt')!r})
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ran = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp)
    assert ran.returncode == 0, ran.stderr[-3000:]
    space = load_file_module(str(db.parent.parent / "space.py")).space
    reference = space.build({"b": "block"})
    reference.load_state_dict(torch.load(py.with_suffix(".pt")))
    reference.eval()
    x = torch.arange(2 * 64, dtype=torch.float32).reshape(2, 1, 8, 8) / 100
    with torch.no_grad():
        assert torch.equal(torch.load(tmp / "y.pt"), reference(x))


def test_export_says_what_it_imports_when_it_cannot_copy_a_class(tmp_path):
    path = tmp_path / "numpyspace.py"
    path.write_text(textwrap.dedent("""
        import numpy as np
        import torch
        from torch import nn
        import retiarii as rt

        TABLE = np.arange(4)

        @rt.leaf
        class Lookup(nn.Module):
            def forward(self, x):
                return x + float(TABLE.sum())

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.lookup = Lookup()

            def forward(self, x):
                return self.lookup(x)
    """))
    module = load_file_module(str(path))
    graph = rt.trace(module.Net())
    source = to_source(graph, "Exported")
    header = source.splitlines()[0]
    assert "Needs only torch" not in header
    assert f"{path} importable as numpyspace" in header and "TABLE" in header
    assert "from numpyspace import Lookup" in source


# ---- a store is code (issue 10.8) -----------------------------------------------------------


def _tamper(db: Path, out: Path, edit) -> Path:
    copy = out / "tampered.db"
    copy.write_bytes(db.read_bytes())
    with sqlite3.connect(copy) as conn:
        for model_id, text in conn.execute("SELECT id, graph FROM models").fetchall():
            graph = json.loads(text)
            for node in graph["nodes"]:
                edit(node["op"])
            conn.execute("UPDATE models SET graph = ? WHERE id = ?", (json.dumps(graph), model_id))
    return copy


def test_export_refuses_a_store_that_names_anything_else(user_run, tmp_path):
    _, db = user_run
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.py"  # outside the space's folder: must not even be loaded
    evil.write_text(f"open({str(marker)!r}, 'w').close()\ndef f(x):\n    return x\n")
    def becomes(kind, target=None, cls=None):
        def edit(op):  # the node of the last layer calls something else
            if op["kind"] == "module" and op.get("attr") == "fc2":
                if cls is not None:
                    op["spec"]["cls"] = cls
                else:
                    op.update(kind=kind, target=target)
                    op.pop("spec"), op.pop("attr")
        return edit

    cases = {
        "posix:system": becomes("function", "posix:system"),
        f"{evil}:f": becomes("function", f"{evil}:f"),
        "builtins:eval": becomes("function", "builtins:eval"),
        "torch.serialization:load": becomes("module", cls="torch.serialization:load"),
        "'__class__'": becomes("method", "__class__"),
    }
    for i, (culprit, edit) in enumerate(cases.items()):
        folder = tmp_path / f"case{i}"
        folder.mkdir()
        tampered = _tamper(db, folder, edit)
        export = _cli("export", tampered, "--out", folder / "E", cwd=folder)
        assert export.returncode != 0, culprit
        message = export.stderr.strip().splitlines()[-1]
        assert "refusing" in message and culprit in message, export.stderr[-2000:]
        assert "Traceback" not in export.stderr
        assert not list((folder / "E").glob("*.py"))
    assert not marker.exists()


def test_trusted_refs_rule():
    rule = TrustedRefs("/home/me/proj/space.py:space")
    for ok in ("torch:cat", "torch.nn.modules.conv:Conv2d", "torch._C._nn:linear",
               "_operator:add", "math:sqrt", "builtins:getattr", "/home/me/proj/space.py:Block",
               "/home/me/proj/lib/blocks.py:Cell", "retiarii.ops:Sum"):
        rule.check(ok)
    for bad in ("posix:system", "os:system", "builtins:eval", "builtins:open", "torch:load",
                "torch.hub:load", "torch.utils.cpp_extension:load_inline", "operator:attrgetter",
                "/home/me/other.py:x", "torch:Tensor.__reduce_ex__", "subprocess:run",
                "retiarii.engine.worker_side.worker:run_job"):
        with pytest.raises(RefError, match="refusing"):
            rule.check(bad)
    package = TrustedRefs("mypkg.spaces:space")
    package.check("mypkg.blocks:Cell")
    with pytest.raises(RefError):
        package.check("otherpkg:Cell")
    with pytest.raises(RefError):  # the demo's space trusts the demo, not all of retiarii
        TrustedRefs("retiarii.demo:space").check("retiarii.engine.worker_side.worker:run_job")
    # `retiarii nas run`'s spaces are built from the model_spaces package, and name it only
    launcher = TrustedRefs("retiarii.nas:SPACES.enas_rnn.small")
    launcher.check("model_spaces.recurrent:RecurrentNet")
    for bad in ("retiarii.engine.worker_side.worker:run_job", "model_spaces_evil:x", "os:system"):
        with pytest.raises(RefError):
            launcher.check(bad)
    with pytest.raises(RefError):
        package.check("model_spaces.recurrent:RecurrentNet")
    with only_trusted(rule), pytest.raises(RefError, match="posix:system"):
        resolve_ref("posix:system")
    assert resolve_ref("posix:getpid")  # no rule outside the block


# ---- references workers cannot see (issue 10.10) --------------------------------------------

SCRIPT = '''
import torch
from torch import nn
import retiarii as rt

X, Y = torch.zeros(8, 1, 8, 8), torch.zeros(8, dtype=torch.long)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(64, 10)
        self.act = rt.LayerChoice([nn.ReLU(), nn.Tanh()], label="act")

    def forward(self, x):
        return self.act(self.fc(self.flatten(x)))


space = rt.ModelSpace(Net(), example_input=torch.zeros(2, 1, 8, 8))

if __name__ == "__main__":
    import sys
    for trainer in [rt.Trainer(dataset=(X, Y), epochs=1, batch_size=4)]:
        try:
            exp = rt.Experiment(space, rt.strategies.Random(seed=0), trainer,
                                store=sys.argv[1], workers=1, max_models=2)
        except rt.ExperimentError as e:
            print("REFUSED", e)
            sys.exit(3)
        exp.run()
'''


def test_experiment_refuses_a_trainer_bound_under_the_main_guard(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    store = tmp_path / "runs" / "x.db"
    ran = subprocess.run([sys.executable, str(script), str(store)], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 3, (ran.stdout + ran.stderr)[-3000:]
    message = ran.stdout
    assert "trainer" in message and str(script) in message
    assert 'if __name__ == "__main__":' in message and "module level" in message
    assert not store.exists()  # refused before anything was written


def test_experiment_takes_the_module_that_defines_an_object(tmp_path):
    """A trainer imported into a script is referenced through its own module."""
    sys.path.insert(0, str(tmp_path))
    try:
        (tmp_path / "trainer_home.py").write_text(
            "import torch\nimport retiarii as rt\n"
            "trainer = rt.Trainer(dataset=(torch.zeros(4, 1, 8, 8), "
            "torch.zeros(4, dtype=torch.long)), epochs=1)\n")
        import trainer_home
        from retiarii.engine.driver.experiment import object_ref

        main = sys.modules["__main__"]
        main.__dict__["_test_alias_trainer"] = trainer_home.trainer
        try:
            assert object_ref(trainer_home.trainer, "trainer") == "trainer_home:trainer"
        finally:
            del main.__dict__["_test_alias_trainer"]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("trainer_home", None)
