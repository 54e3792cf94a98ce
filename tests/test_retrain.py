"""Retraining a selected architecture: ``rt.fixed_arch`` (a plain module) and ``retiarii
retrain DB --model ID`` (a new experiment of the same store, linked to the model), for a
multi-trial and a one-shot search's model."""
import json

import pytest
import torch
from torch import nn

import retiarii as rt
from retiarii import cli
from retiarii.engine.storage.store import Store
from retiarii.sampler import SampleError

SPACE_FILE = '''
import torch
from torch import nn
import retiarii as rt

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        hidden = rt.ValueChoice([8, 16], label="hidden")
        self.flatten = nn.Flatten()
        self.fc1 = rt.nn.Linear(64, hidden)
        self.act = rt.LayerChoice({"relu": nn.ReLU(), "tanh": nn.Tanh()}, label="act")
        self.fc2 = rt.nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.flatten(x))))

space = rt.ModelSpace(Net(), example_input=torch.zeros(2, 1, 8, 8))
trainer = rt.Trainer(dataset="digits", epochs=1, batch_size=256,
                     lr=rt.ValueChoice([0.01, 0.03], label="lr"))
'''


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = rt.nn.Linear(64, rt.ValueChoice([8, 16], label="width"))

    def forward(self, x):
        return self.fc(x.flatten(1))


def test_fixed_arch_is_a_plain_module_of_the_sample():
    space = rt.ModelSpace(Net(), example_input=torch.zeros(2, 1, 8, 8))
    net = rt.fixed_arch(space, {"width": 16})
    assert not any(type(m).__module__.startswith("retiarii") for m in net.modules())
    assert net(torch.zeros(3, 1, 8, 8)).shape == (3, 16)
    # the state dict of the built module is the exported one: it loads strictly
    again = rt.fixed_arch(space, {"width": 16}, weights=net.state_dict())
    x = torch.randn(3, 1, 8, 8)
    assert torch.equal(again(x), net(x))
    with pytest.raises(SampleError, match=r"never asks for: \['lr'\].*trainer="):
        rt.fixed_arch(space, {"width": 16, "lr": 0.1})
    trainer = rt.Trainer(lr=rt.ValueChoice([0.1, 0.2], label="lr"))
    assert rt.fixed_arch(space, {"width": 8, "lr": 0.1}, trainer=trainer)(x).shape == (3, 8)


def test_fixed_architecture_repeats_each_combination_and_resumes_between_them():
    """repeats=R: each open combination R times in a row (independent runs), then exhausted;
    a strategy restored from its state mid-way proposes what the uninterrupted one would."""
    space = rt.ModelSpace(Net(), example_input=torch.zeros(2, 1, 8, 8)).with_hparams(
        {"lr": rt.ValueChoice([0.1, 0.2], label="lr")})
    whole = rt.strategies.FixedArchitecture({"width": 8}, repeats=3)
    proposed = [whole.ask(space) for _ in range(6)]
    assert proposed == [{"width": 8, "lr": 0.1}] * 3 + [{"width": 8, "lr": 0.2}] * 3
    with pytest.raises(rt.strategies.SpaceExhausted):
        whole.ask(space)
    assert whole.config()["repeats"] == 3 and whole.dedup is False
    assert "repeats" not in rt.strategies.FixedArchitecture({"width": 8}).config()
    first = rt.strategies.FixedArchitecture({"width": 8}, repeats=3)
    head = [first.ask(space) for _ in range(4)]
    for sample in head:
        first.tell(sample, 0.5)
    again = rt.strategies.FixedArchitecture({"width": 8}, repeats=3)
    again.load_state_dict(first.state_dict())
    assert head + [again.ask(space), again.ask(space)] == proposed
    for bad in (0, -2, True, 1.5):
        with pytest.raises(ValueError, match="repeats"):
            rt.strategies.FixedArchitecture({"width": 8}, repeats=bad)
    with pytest.raises(ValueError, match="leave dedup out"):
        rt.strategies.FixedArchitecture({"width": 8}, repeats=2, dedup=True)


def test_an_experiment_of_repeated_runs_needs_dedup_off_and_says_so(tmp_path):
    space = rt.ModelSpace(Net(), example_input=torch.zeros(2, 1, 8, 8))
    db = tmp_path / "x.db"
    with pytest.raises(rt.ExperimentError, match=r"repeats=2.*pass dedup=False"):
        rt.Experiment(space, rt.strategies.FixedArchitecture({"width": 8}, repeats=2),
                      rt.Trainer(epochs=1), store=str(db))
    assert not db.exists()  # refused before anything is written


def _run(tmp_path, *flags, lr_label="lr"):
    (tmp_path / "space.py").write_text(SPACE_FILE.replace('label="lr"', f'label="{lr_label}"'))
    db = str(tmp_path / "r.db")
    assert cli.main(["run", str(tmp_path / "space.py"), "--store", db, "--workers", "1",
                     *flags]) == 0
    return db


def _experiment(db, eid):
    with Store(db) as store:
        store.use_experiment(eid)
        return store.get_experiment(), store.models(), store.trials()


# "rate": a trainer setting (lr) whose choice is labelled otherwise; retrain rebuilt it
# under the setting's name and refused the model's own sample (found by a new user's search)
@pytest.mark.parametrize("lr_label", ["lr", "rate"])
def test_retrain_a_multi_trial_model_as_a_new_experiment_linked_to_it(tmp_path, capsys,
                                                                       lr_label):
    db = _run(tmp_path, "--strategy", "grid", "--max-models", "2", lr_label=lr_label)
    _, models, _ = _experiment(db, 1)
    source = models[1]
    capsys.readouterr()
    assert cli.main(["retrain", db, "--model", str(source["id"]), "--epochs", "2",
                     "--workers", "1"]) == 0
    assert f"retrained model {source['id']} (experiment 1) from scratch as experiment 2" in \
        capsys.readouterr().out
    exp, models, trials = _experiment(db, 2)
    assert exp["config"]["origin"]["retrain"]["model"] == source["id"]
    assert exp["config"]["origin"]["retrain"]["experiment"] == 1
    (model,) = models  # the sample it was trained with, its learning rate included
    assert model["sample"] == source["sample"] and model["hash"] == source["hash"]
    (trial,) = trials
    assert trial["state"] == "TERMINATED" and trial["step"] == 2  # --epochs 2
    # the exported .json rebuilds the same architecture with fixed_arch
    out = tmp_path / "out"
    assert cli.main(["export", db, "--experiment", "2", "--out", str(out), "--top", "1"]) == 0
    spec = json.loads((out / f"model_{model['id']}.json").read_text())
    from retiarii.refs import resolve_ref
    space = resolve_ref(f"{tmp_path / 'space.py'}:space")
    trainer = resolve_ref(f"{tmp_path / 'space.py'}:trainer")
    net = rt.fixed_arch(space, out / f"model_{model['id']}.json", trainer=trainer,
                        weights=out / f"model_{model['id']}.pt")
    assert net(torch.zeros(1, 1, 8, 8)).shape == (1, 10) and spec["sample"] == source["sample"]


def test_retrain_refuses_a_model_the_store_lacks(tmp_path, capsys):
    db = _run(tmp_path, "--strategy", "grid", "--max-models", "1")
    assert cli.main(["retrain", db, "--model", "99"]) == 2
    assert "--model 99: " in capsys.readouterr().err


@pytest.mark.slow  # a one-shot search, then two trainings (~60 s here)
def test_retrain_a_one_shot_result_searches_the_trainer_hyper_parameters(tmp_path, capsys):
    from retiarii.engine.driver.one_shot_host import HeldHyperParameters

    with pytest.warns(HeldHyperParameters, match=r"held at lr=0.01") as said:
        db = _run(tmp_path, "--strategy", "spos", "--epochs", "1")
    assert len([w for w in said if w.category is HeldHyperParameters]) == 1  # said once
    exp, _, _ = _experiment(db, 1)
    result = exp["result_model"]
    assert result is not None
    assert cli.main(["retrain", db, "--model", str(result), "--epochs", "1",
                     "--workers", "1"]) == 0
    _, models, trials = _experiment(db, 2)
    # lr was held during the weight-sharing search: each of its values is trained now
    assert sorted(m["sample"]["lr"] for m in models) == [0.01, 0.03]
    assert len({m["hash"] for m in models}) == 1
    assert all(t["state"] == "TERMINATED" for t in trials)
    assert cli.main(["status", db, "--experiment", "2"]) == 0
