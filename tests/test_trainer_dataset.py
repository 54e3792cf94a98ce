"""``rt.Trainer(dataset=<a torch Dataset>)``: a map-style Dataset of (input, label) items is read
once into tensors and trains exactly as the same tensors given as ``(X, y)``; what cannot be read
(a DataLoader, an iterable-only data set, items that are not pairs, inputs that are not tensors,
labels that are not classes) is refused when the trainer is made or first read, naming the fix
(found by writing a search in a script the way a new user does: a Dataset was refused deep in
every worker with a message about ValueChoices)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

import retiarii as rt
from retiarii.engine.trainers.torch_datasets import read_dataset
from retiarii.engine.trainers.trial_training import TrialRun

HERE = os.path.dirname(os.path.abspath(__file__))


class Pairs(Dataset):
    """(x, y) items over given tensors; labels as Python ints, as most user Datasets return."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def _data(n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=g)
    return x, (x[:, :6].sum(1) > 0).long() + 2 * (x[:, 6:].sum(1) > 0).long()


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4))


def test_a_dataset_trains_exactly_as_its_tensors():
    x, y = _data()
    as_tensors = rt.Trainer(dataset=(x, y), epochs=2, batch_size=32)
    as_dataset = rt.Trainer(dataset=Pairs(x, y), epochs=2, batch_size=32)
    assert as_dataset.data_key({}) == as_tensors.data_key({})  # a content hash: same data
    runs = [TrialRun(_net, t, {}, seed=0) for t in (as_tensors, as_dataset)]
    for _ in range(2):
        a, b = (run.train_epoch() for run in runs)
        assert a == b  # every metric, bit for bit
    assert as_dataset.chance_level("val_acc") == as_tensors.chance_level("val_acc")
    assert "Pairs" in as_dataset.preprocessing()


def test_a_tensor_dataset_is_its_tensors():
    x, y = _data(50)
    got = read_dataset(torch.utils.data.TensorDataset(x, y.to(torch.int32)))
    assert got[0] is x and torch.equal(got[1], y) and got[1].dtype == torch.int64
    # the same as reading it item by item
    class Items(Dataset):
        def __len__(self):
            return len(x)

        def __getitem__(self, i):
            return x[i], y[i]

    by_items = read_dataset(Items())
    assert torch.equal(by_items[0], got[0]) and torch.equal(by_items[1], got[1])


def test_read_dataset_stacks_inputs_and_takes_integer_labels_of_any_kind():
    items = [(np.ones(3, dtype=np.float32) * i, lab)
             for i, lab in enumerate([1, np.int64(2), torch.tensor(0)])]

    class Items(Dataset):
        def __len__(self):
            return len(items)

        def __getitem__(self, i):
            return items[i]

    x, y = read_dataset(Items())
    assert x.shape == (3, 3) and x.dtype == torch.float32 and x[2, 0] == 2
    assert y.tolist() == [1, 2, 0] and y.dtype == torch.int64


class _Listed(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


@pytest.mark.parametrize("items, message", [
    ([{"x": torch.zeros(2), "y": 0}], r"item 0 .* is dict, not an \(input, label\) pair"),
    ([("a picture", 0)], r"item 0's input is str, not a tensor.*ToTensor"),
    ([(torch.zeros(2), 0.5)], r"item 0's label is 0.5, not an integer class"),
    ([(torch.zeros(2), True)], r"item 0's label is True"),
    ([(torch.zeros(2), 0), (torch.zeros(3), 1)], r"several shapes"),
    ([], r"is empty"),
])
def test_unreadable_items_are_refused_naming_the_fix(items, message):
    trainer = rt.Trainer(dataset=_Listed(items), epochs=1)
    with pytest.raises(ValueError, match=message):
        trainer.train_dataloader({}, 0)


class _Stream(IterableDataset):
    def __iter__(self):
        yield torch.zeros(2), 0


def test_a_loader_or_a_stream_is_refused_when_the_trainer_is_made():
    x, y = _data(40)
    with pytest.raises(TypeError, match=r"dataset=loader.dataset, batch_size=8"):
        rt.Trainer(dataset=DataLoader(Pairs(x, y), batch_size=8))
    with pytest.raises(TypeError, match="can only be iterated.*FunctionTrainer"):
        rt.Trainer(dataset=_Stream())
    with pytest.raises(TypeError, match=r"got int: give a name"):
        rt.Trainer(dataset=3)


def test_a_search_over_a_dataset_defined_in_the_users_script(tmp_path):
    # as a new user writes it: the Dataset class, the space and the trainer at module level
    script = tmp_path / "my_search.py"
    db = tmp_path / "s.db"
    script.write_text(textwrap.dedent(f"""
        import torch
        from torch import nn
        from torch.utils.data import Dataset
        import retiarii as rt

        class Noisy(Dataset):
            def __init__(self, n=256):
                g = torch.Generator().manual_seed(0)
                self.x = torch.randn(n, 20, generator=g)
                self.y = (self.x.sum(1) > 0).long()
            def __len__(self):
                return len(self.x)
            def __getitem__(self, i):
                return self.x[i], int(self.y[i])

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = rt.LayerChoice([nn.Linear(20, 16),
                                            nn.Sequential(nn.Linear(20, 16), nn.ReLU())])
                self.head = nn.Linear(16, 2)
            def forward(self, x):
                return self.head(self.body(x))

        space = rt.ModelSpace(Net(), example_input=torch.zeros(2, 20))
        trainer = rt.Trainer(dataset=Noisy(), epochs=1, batch_size=64)
        if __name__ == "__main__":
            rt.Experiment(space, rt.strategies.GridSearch(), trainer, store={str(db)!r},
                          workers=1).run()
    """))
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    from retiarii.engine.storage.store import Store

    with Store(str(db)) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        trials = store.trials()
        assert [str(t["state"]) for t in trials] == ["TERMINATED", "TERMINATED"]
        assert all(store.learning_curve(t["id"], "val_acc") for t in trials)
