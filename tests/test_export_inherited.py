"""What `retiarii export` hands a user: the selected architecture of every one-shot strategy
with the weights it inherits from the super-net (the exported module, loaded in a process
where retiarii cannot be imported, computes what the super-net computed for that
architecture: the metric the search recorded), and a header saying the inputs the trainer
prepared (digits / 16), which a user follows to get the trainer's accuracy back."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import retiarii as rt
from engine_helpers import InProcessExecutor
from retiarii.cli import main
from retiarii.cli_source import export_header
from retiarii.engine.storage.segments_table import SegmentTable
from retiarii.engine.storage.store import Store
from retiarii.engine.trainers.trainer import ClassifierTrainer
from retiarii.strategies import (DARTS, ENAS, SPOS, GumbelDARTS, ProxylessNAS, SegmentContext)

CPU = torch.device("cpu")

# Runs an exported model file on saved inputs with retiarii made unimportable: the file and
# its .pt are all a user needs.
_USER = """
import sys
sys.modules["retiarii"] = None  # any `import retiarii` now fails
import importlib.util, torch
path, cls, weights, inputs, out = sys.argv[1:6]
spec = importlib.util.spec_from_file_location("exported", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
net = getattr(module, cls)()
net.load_state_dict(torch.load(weights))
net.eval()
with torch.no_grad():
    torch.save(net(torch.load(inputs)), out)
"""


def _run_as_user(tmp_path, py, cls: str, weights, inputs: torch.Tensor) -> torch.Tensor:
    torch.save(inputs, tmp_path / "inputs.pt")
    script = tmp_path / "user.py"
    script.write_text(_USER)
    out = subprocess.run([sys.executable, str(script), str(py), cls, str(weights),
                          str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return torch.load(tmp_path / "outputs.pt")


class Classify(rt.Trainer):
    """Three classes of a random linear map of 8 features; two validation batches."""

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(256 + 64, 8, generator=g)
        self.y = (self.x @ torch.randn(8, 3, generator=g)).argmax(1)

    def train_dataloader(self, hparams, epoch):
        idx = torch.randperm(256, generator=torch.Generator().manual_seed(epoch))
        return [(self.x[i], self.y[i]) for i in idx.split(32)]

    def val_dataloader(self, hparams):
        return [(self.x[i:i + 32], self.y[i:i + 32]) for i in (256, 288)]

    def configure_optimizers(self, model, hparams):
        return torch.optim.Adam(model.parameters(), lr=0.01)

    def training_step(self, model, batch, hparams):
        x, y = batch
        return F.cross_entropy(model(x), y)

    def validation_step(self, model, batch):
        x, y = batch
        logits = model(x)
        return {"val_loss": F.cross_entropy(logits, y),
                "val_acc": (logits.argmax(1) == y).float().mean()}


class Net(nn.Module):
    """A choice between a linear layer and weightless ops, then a BatchNorm every path shares
    (SPOS recalibrates its statistics per path)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.op = rt.LayerChoice({"linear": nn.Linear(16, 16), "tanh": nn.Tanh(),
                                  "identity": nn.Identity()}, label="op")
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.bn(self.op(self.fc(x))))


STRATEGIES = {
    "DARTS": lambda: DARTS(epochs=2, arch_lr=3e-3),
    "GumbelDARTS": lambda: GumbelDARTS(epochs=2, arch_lr=3e-3),
    "ProxylessNAS": lambda: ProxylessNAS(epochs=2),
    "SPOS": lambda: SPOS(train_segments=1, search_population=3, search_generations=1,
                         eval_batches=None),  # (also Once-for-All's strategy)
    "ENAS": lambda: ENAS(segments=2, controller_steps=6, eval_batches=2),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_exported_weights_reproduce_what_the_super_net_measured(name, tmp_path):
    torch.manual_seed(0)
    space, trainer = rt.ModelSpace(Net(), example_input=torch.randn(2, 8)), Classify()
    strategy = STRATEGIES[name]()
    strategy.setup(space, trainer, {}, CPU)
    results = [strategy.run_segment(SegmentContext(seg, trainer, {}, CPU))
               for seg in range(strategy.num_segments())]
    selected = strategy.selected()
    # what the search measured for the architecture it selected, with the super-net's weights
    (measured,) = [m.metrics for r in results for m in r.models if m.sample == selected][-1:]
    weights = strategy.export_state(selected)  # what the engine's last unit keeps

    py = tmp_path / "model_1.py"
    py.write_text(space.replay(selected).graph.to_source("Model1"))
    torch.save(weights, tmp_path / "model_1.pt")
    x = torch.cat([b[0] for b in trainer.val_dataloader({})])
    y = torch.cat([b[1] for b in trainer.val_dataloader({})])
    logits = _run_as_user(tmp_path, py, "Model1", tmp_path / "model_1.pt", x)
    assert float(F.cross_entropy(logits, y)) == pytest.approx(measured["val_loss"], rel=1e-5)
    assert float((logits.argmax(1) == y).float().mean()) == pytest.approx(measured["val_acc"])
    if hasattr(strategy, "relaxation"):  # and the super-net fixed to it computes the same
        relax = strategy.relaxation.fix(selected).eval()
        with torch.no_grad():
            assert torch.allclose(relax(x), logits, atol=1e-5)


# ---- the CLI: run, export, and a user who follows the header --------------------------------

SPACE = '''
import torch
from torch import nn
import retiarii as rt


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.op = rt.LayerChoice({"conv": nn.Conv2d(8, 8, 3, padding=1),
                                  "pool": nn.MaxPool2d(3, 1, 1), "skip": nn.Identity()},
                                 label="op")
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.pool(torch.relu(self.bn(self.op(self.stem(x))))).flatten(1))


space = rt.ModelSpace(Net(), example_input=torch.zeros(2, 1, 8, 8))
'''

# A user with the exported files and scikit-learn's digits, following the header: / 16.
_DIGITS_USER = _USER.replace(
    "    torch.save(net(torch.load(inputs)), out)",
    "    from sklearn.datasets import load_digits\n"
    "    idx = torch.load(inputs)\n"
    "    x = torch.tensor(load_digits().data[idx.numpy()] / 16.0, dtype=torch.float32)\n"
    "    torch.save(net(x.reshape(-1, 1, 8, 8)), out)")


def _val_split():
    """The digits the default trainer validates on (its documented split: 20%, seed 0)."""
    order = np.random.default_rng(0).permutation(1797)
    return torch.from_numpy(order[:int(round(1797 * 0.2))])


def _user_logits(tmp_path, out_dir) -> tuple[str, torch.Tensor]:
    (py,) = sorted(out_dir.glob("model_*.py"))
    torch.save(_val_split(), tmp_path / "idx.pt")
    script = tmp_path / "digits_user.py"
    script.write_text(_DIGITS_USER)
    cls = "Model" + py.stem.split("_")[1]
    out = subprocess.run([sys.executable, str(script), str(py), cls,
                          str(py.with_suffix(".pt")), str(tmp_path / "idx.pt"),
                          str(tmp_path / "logits.pt")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return py.read_text(), torch.load(tmp_path / "logits.pt")


def _header(source: str) -> str:
    return source.split('"""')[1]


@pytest.fixture
def in_process(monkeypatch):
    monkeypatch.setattr("retiarii.engine.executors.local.LocalExecutor.for_search",
                        lambda *args, **kwargs: InProcessExecutor())


def test_darts_export_from_the_cli_carries_weights_and_the_digits_preprocessing(
        tmp_path, capsys, in_process):
    (tmp_path / "space.py").write_text(SPACE)
    db = str(tmp_path / "darts.db")
    assert main(["run", str(tmp_path / "space.py"), "--strategy", "darts", "--epochs", "2",
                 "--store", db]) == 0
    assert main(["export", db, "--out", str(tmp_path / "out")]) == 0
    assert "weights inherited from the super-network" in capsys.readouterr().out
    source, logits = _user_logits(tmp_path, tmp_path / "out")
    header = _header(source)
    assert "divided by 16" in header and "(N, 1, 8, 8)" in header
    assert "net.load_state_dict(torch.load(" in header and "with the weights it inherits" in header
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        table = SegmentTable(store)
        result = table.result()
        measured = [m for m in table.evaluated() if m["sample"] == result["sample"]][-1]
    y = ClassifierTrainer().val_dataloader({})[0][1]
    assert float((logits.argmax(1) == y).float().mean()) == pytest.approx(result["value"])
    assert float(F.cross_entropy(logits, y)) == pytest.approx(measured["metrics"]["val_loss"],
                                                              rel=1e-5)
    fresh = rt.fixed_arch(rt.refs.load_file_module(str(tmp_path / "space.py")).space,
                          result["sample"]).eval()
    x = torch.cat([b[0] for b in ClassifierTrainer().val_dataloader({})])
    with torch.no_grad():  # the inherited weights are not a fresh initialization
        assert not torch.allclose(fresh(x), logits, atol=1e-3)


def test_demo_export_header_states_the_scaling_and_a_user_gets_the_accuracy_back(
        tmp_path, capsys):
    from retiarii.demo import space

    db = str(tmp_path / "demo.db")
    rt.Experiment(space, rt.strategies.Random(seed=0), ClassifierTrainer(epochs=1), store=db,
                  executor=InProcessExecutor(), max_models=1).run()
    assert main(["export", db, "--out", str(tmp_path / "out"), "--top", "1"]) == 0
    capsys.readouterr()
    source, logits = _user_logits(tmp_path, tmp_path / "out")
    header = _header(source)
    assert "divided by 16" in header and "validation: 20% of the examples held out" in header
    value = json.loads(next((tmp_path / "out").glob("model_*.json")).read_text())["val_acc"]
    y = ClassifierTrainer().val_dataloader({})[0][1]
    assert float((logits.argmax(1) == y).float().mean()) == pytest.approx(value)


def test_export_header_of_a_trainer_that_says_nothing_says_so():
    source = '"""Model3: generated by retiarii from the graph IR. Needs only torch."""\nimport torch\n'
    out = export_header(source, "model_3", "model 3 of r.db", {}, weights=False)
    assert out.startswith('"""Model3: generated by retiarii') and out.endswith("import torch\n")
    assert "Inputs (the trainer's preprocessing): not described" in out
    assert "load_state_dict" not in out  # no weights: nothing to load
    compile(out, "model_3.py", "exec")
    tricky = export_header(source, "model_3", "x", {"preprocessing": 'a """ and a \\ here'}, True)
    namespace: dict = {}
    exec(compile(tricky, "model_3.py", "exec"), namespace)  # still a valid module
    assert 'a """ and a \\ here' in namespace["__doc__"].replace("\n", " ")
