"""ImageFolderTrainer: JPEG folders decoded and augmented by a DataLoader or by DALI.

Its data key is honest: equal keys give the same batches (whatever the trial's seed, the
global RNG state or the number of DataLoader workers), and reading them moves no RNG stream
of the trial; so a grouped job of several models fed by one pipeline gives every trial
exactly its metrics and checkpoint alone, and so does a paused and resumed trial. The DALI
tests skip when the ``dali`` extra is not installed (CI installs it)."""
import itertools
import os
import random

import numpy as np
import pytest
import torch
from torch import nn

import retiarii as rt
from retiarii.engine.storage import checkpoint as ckpt
from retiarii.engine.trainers import data
from retiarii.engine.jobs.job import Job, JobFinished, TrialCheckpointed, TrialTask
from retiarii.engine.trainers.image_trainer import ImageFolderTrainer
from retiarii.engine.worker_side.worker import WorkerContext, _open_task, _units

from test_grouped_jobs import _results, _run, _same


class Tiny(nn.Module):
    """conv, BN, ReLU, a conv the space swaps, pool, dropout, linear: 3 classes."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.act = nn.ReLU()
        self.c2 = nn.Conv2d(6, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(0.3)  # its masks come from the trial's stream: must not move
        self.fc = nn.Linear(8, 3)

    def forward(self, x):  # (B, 3, 16, 16) -> (B, 3)
        x = self.c2(self.act(self.bn(self.c1(x))))
        return self.fc(self.drop(torch.flatten(self.pool(x), 1)))


SPACE = rt.ModelSpace(Tiny(), [rt.apply_mutator("c2", rt.mutators.OperatorMutator(
    {"k3": nn.Conv2d(6, 8, 3, padding=1), "k5": nn.Conv2d(6, 8, 5, padding=2),
     "k1": nn.Conv2d(6, 8, 1)}, label="k"))], example_input=torch.randn(2, 3, 16, 16))
KERNEL = {"a": "k3", "b": "k5", "c": "k1"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """36 JPEGs of 24x24 in 3 classes: 27 for training (4 batches of 8), 9 for validation."""
    return data.make_jpeg_folder(str(tmp_path_factory.mktemp("jpegs")), classes=3,
                                 per_class=12, size=24)


def _config(folder, **kw):
    return {"dataset": folder, "batch_size": 8, "epochs": 2, "image_size": 16, "lr": 3e-3,
            "val_fraction": 0.25, "num_workers": 0, "lr_schedule": "cosine", **kw}


def _trainer_spec(folder, **kw):
    return {"class": "retiarii.engine.trainers.image_trainer:ImageFolderTrainer",
            "config": _config(folder, **kw)}


def _task(trial, tmp, trainer, start=0, stop=2, checkpoint_in=None, tag=""):
    spec = {"space": f"{os.path.abspath(__file__)}:SPACE", "sample": {"k/c2": KERNEL[trial]},
            "trainer": trainer, "hparams": {}, "seed": ord(trial)}
    return TrialTask(trial, spec, start, stop, checkpoint_in, str(tmp / f"{tag}{trial}-{stop}.pt"))


def _same_batches(a, b):
    a, b = list(a), list(b)
    return len(a) == len(b) and all(torch.equal(xa, xb) and torch.equal(ya, yb)
                                    for (xa, ya), (xb, yb) in zip(a, b))


def _rng_state():
    return (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())


# ---- the folder and the loaders ---------------------------------------------------------


def test_make_jpeg_folder_writes_the_imagefolder_layout_deterministically(tmp_path, folder):
    again = data.make_jpeg_folder(str(tmp_path / "again"), classes=3, per_class=12, size=24)
    a, b = data.scan_folder(folder), data.scan_folder(again)
    assert a.classes == ("class0", "class1", "class2") and len(a.files) == 36
    assert a.labels == tuple(c for c in range(3) for _ in range(12))
    for fa, fb in zip(a.files, b.files):
        with open(fa, "rb") as x, open(fb, "rb") as y:
            assert x.read() == y.read()


def test_torch_batches_depend_on_seed_and_epoch_only(folder):
    trainer = ImageFolderTrainer(**_config(folder))
    torch.manual_seed(1)
    first = list(trainer.train_dataloader({}, 0))
    torch.manual_seed(2)  # another global state, 2 worker processes: the same batches
    before = _rng_state()
    second = list(trainer.train_dataloader({"num_workers": 2}, 0))
    after = _rng_state()
    assert _same_batches(first, second)
    # reading them moved no stream (a trial alone reads them inside its own streams)
    assert torch.equal(before[0], after[0]) and np.array_equal(before[1], after[1])
    assert before[2] == after[2]
    assert [x.shape for x, _ in first] == [(8, 3, 16, 16)] * 3 + [(3, 3, 16, 16)]
    assert all(y.dtype == torch.int64 for _, y in first)
    assert not _same_batches(first, trainer.train_dataloader({}, 1))  # the next epoch differs
    assert not _same_batches(first, trainer.train_dataloader({"seed": 1}, 0))
    # what a trial resumed at batch 2 reads (TrialRun skips with islice): the same tail
    assert _same_batches(itertools.islice(iter(trainer.train_dataloader({}, 0)), 2, None), first[2:])
    val = list(trainer.val_dataloader({}))
    assert sum(len(y) for _, y in val) == 9 and _same_batches(val, trainer.val_dataloader({"seed": 5}))


def _epoch_in_a_spawned_process(folder, out):
    """What a worker of the local executor (a spawned process) sees: the start method its
    DataLoaders use for their decoding processes, and the batches of an epoch."""
    import multiprocessing

    contexts = []
    loader_init = torch.utils.data.DataLoader.__init__

    def recording(self, *args, **kwargs):
        context = kwargs.get("multiprocessing_context")
        contexts.append(context.get_start_method() if context is not None else None)
        loader_init(self, *args, **kwargs)

    torch.utils.data.DataLoader.__init__ = recording
    batches = list(data.torch_batches(data.scan_folder(folder), data.Augment(size=16),
                                      batch_size=8, seed=0, epoch=0, num_workers=1))
    # numpy arrays, pickled by value: torch tensors would travel as shared-memory handles,
    # which this process may have closed by exiting before the parent reads them
    out.put((multiprocessing.get_start_method(), contexts,
             [(x.numpy(), y.numpy()) for x, y in batches]))


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="fork: Linux")
def test_a_spawned_worker_forks_its_decoding_processes(folder):
    """The local executor spawns its workers, whose default start method is then spawn too;
    their DataLoaders still fork (no fresh interpreter importing torch every epoch), and the
    batches are those decoded in this process."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_epoch_in_a_spawned_process, args=(folder, out))
    child.start()
    default, contexts, batches = out.get(timeout=120)
    child.join(timeout=60)
    assert default == "spawn" and contexts == ["fork"]
    batches = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches]
    assert _same_batches(batches, data.torch_batches(
        data.scan_folder(folder), data.Augment(size=16), batch_size=8, seed=0, epoch=0,
        num_workers=0))


def test_data_key_names_what_the_batches_depend_on(folder, tmp_path):
    trainer = ImageFolderTrainer(**_config(folder))
    key = trainer.data_key({})
    assert key is not None and os.path.abspath(folder) in key
    # not the trial's seed, nor how many processes decode: the batches are the same
    assert trainer.data_key({"num_workers": 2, "lr": 0.1, "epochs": 5}) == key
    assert ImageFolderTrainer(**_config(folder)).data_key({}) == key
    for change in ({"batch_size": 4}, {"seed": 1}, {"image_size": 12}, {"min_scale": 0.5},
                   {"flip": False}, {"mean": [0.5, 0.5, 0.5]}, {"val_fraction": 0.5},
                   {"split_seed": 3}, {"val_resize": 1.0}, {"loader": "dali"}):
        assert trainer.data_key(change) != key, change
    # another folder with the same file names, other contents
    copy = data.make_jpeg_folder(str(tmp_path / "other"), classes=3, per_class=12, size=24, seed=1)
    assert ImageFolderTrainer(**_config(copy)).data_key({}) != key

    class OwnBatches(ImageFolderTrainer):
        def train_dataloader(self, hparams, epoch):
            return super().train_dataloader(hparams, epoch)[::-1]

    assert OwnBatches(**_config(folder)).data_key({}) is None


def test_a_validation_folder_replaces_the_held_out_share(folder, tmp_path):
    val = data.make_jpeg_folder(str(tmp_path / "val"), classes=3, per_class=2, size=24, seed=7)
    trainer = ImageFolderTrainer(**_config(folder, val_dataset=val))
    batches = list(trainer.val_dataloader({}))
    assert torch.equal(torch.cat([y for _, y in batches]), torch.tensor([0, 0, 1, 1, 2, 2]))
    assert sum(len(y) for _, y in trainer.train_dataloader({}, 0)) == 36  # all of `dataset`
    key = trainer.data_key({})
    assert os.path.abspath(val) in key and key != ImageFolderTrainer(**_config(folder)).data_key({})


def test_the_worker_rebuilds_it_from_its_spec(folder):
    trainer = ImageFolderTrainer(**_config(folder, loader="torch", flip=False))
    rebuilt = WorkerContext().trainer(trainer.to_spec())
    assert type(rebuilt) is ImageFolderTrainer and rebuilt.data_key({}) == trainer.data_key({})


def test_bad_settings_get_clear_errors(folder, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown loader"):
        ImageFolderTrainer(**_config(folder, loader="ffcv")).train_dataloader({}, 0)
    with pytest.raises(ValueError, match="needs dataset="):
        ImageFolderTrainer().data_key({})
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="ImageFolder layout"):
        ImageFolderTrainer(**_config(str(tmp_path / "empty"))).train_dataloader({}, 0)
    other = data.make_jpeg_folder(str(tmp_path / "four"), classes=4, per_class=1, size=24)
    with pytest.raises(FileNotFoundError, match=r"\['class3'\] extra"):
        ImageFolderTrainer(**_config(folder, val_dataset=other)).val_dataloader({})
    with pytest.raises(TypeError, match="unknown settings"):
        ImageFolderTrainer(dataset=folder, workers=2)
    monkeypatch.setattr(data, "dali_available", lambda: False)
    with pytest.raises(ImportError, match=r"pip install -e \.\[dali\]"):
        ImageFolderTrainer(**_config(folder, loader="dali")).train_dataloader({}, 0)


# ---- grouped jobs and resuming ------------------------------------------------------------


def _alone(tasks):
    results = {}
    for task in tasks:
        events = _run(Job(f"alone-{task.trial_id}", [task]))
        assert isinstance(events[-1], JobFinished), events[-1]
        results.update(_results(events))
    return results


def _grouped_equals_alone(tmp_path, trainer):
    grouped = [_task(t, tmp_path, trainer, tag="g-") for t in KERNEL]
    alone = [_task(t, tmp_path, trainer, tag="s-") for t in KERNEL]
    units = _units(Job("g", grouped, meta={"group": True}), grouped,
                   {t.trial_id: _open_task(t, WorkerContext()) for t in grouped}, WorkerContext())
    assert len(units) == 1 and units[0].trials == tuple(KERNEL)  # one pipeline for the three
    events = _run(Job("g", grouped, meta={"group": True}))
    assert isinstance(events[-1], JobFinished), events[-1]
    assert [e.trial_id for e in events if isinstance(e, TrialCheckpointed)] == list(KERNEL)
    got, expected = _results(events), _alone(alone)
    assert sorted(got) == sorted((t, s) for t in KERNEL for s in (1, 2))
    assert got == expected  # exact floats
    assert len({m["train_loss"] for m in got.values()}) == len(got)  # the models do differ
    for g, s in zip(grouped, alone):
        assert _same(ckpt.load(g.checkpoint_out), ckpt.load(s.checkpoint_out)), g.trial_id


@pytest.mark.parametrize("workers", [0, 2])
def test_a_grouped_job_equals_each_model_alone(tmp_path, folder, workers):
    _grouped_equals_alone(tmp_path, _trainer_spec(folder, num_workers=workers))


def test_paused_and_resumed_equals_uninterrupted(tmp_path, folder):
    """Epoch 1 (grouped and alone), checkpoint, epoch 2 from it == epochs 1-2 in one go."""
    trainer = _trainer_spec(folder, num_workers=2)
    whole = [_task(t, tmp_path, trainer, tag="w-") for t in "ab"]
    expected = _alone(whole)
    first = [_task(t, tmp_path, trainer, stop=1, tag="p-") for t in "ab"]
    assert isinstance(_run(Job("p1", first, meta={"group": True}))[-1], JobFinished)
    second = [_task(t, tmp_path, trainer, start=1, stop=2, checkpoint_in=f.checkpoint_out, tag="p-")
              for t, f in zip("ab", first)]
    alone_second = _alone(second[:1])  # a alone from its grouped checkpoint
    events = _run(Job("p2", second, meta={"group": True}))
    assert isinstance(events[-1], JobFinished)
    assert _results(events) == {k: v for k, v in expected.items() if k[1] == 2}
    assert alone_second == {("a", 2): expected[("a", 2)]}
    for r, w in zip(second, whole):
        assert _same(ckpt.load(r.checkpoint_out), ckpt.load(w.checkpoint_out)), r.trial_id


# ---- DALI ---------------------------------------------------------------------------------


def _dali():
    return pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed "
                               "(pip install -e .[dali]); CI installs it")


def test_dali_batches_are_the_same_across_pipeline_builds(folder):
    _dali()
    trainer = ImageFolderTrainer(**_config(folder, loader="dali", dali_device="cpu"))
    torch.manual_seed(1)
    first = list(trainer.train_dataloader({}, 0))
    torch.manual_seed(2)
    before = _rng_state()
    again = list(trainer.train_dataloader({"dali_threads": 1}, 0))  # another build, 1 thread
    after = _rng_state()
    assert _same_batches(first, again)
    assert torch.equal(before[0], after[0]) and np.array_equal(before[1], after[1])
    assert [x.shape for x, _ in first] == [(8, 3, 16, 16)] * 3 + [(3, 3, 16, 16)]
    # the labels are those of the epoch's order, as with the DataLoader
    torch_first = list(ImageFolderTrainer(**_config(folder)).train_dataloader({}, 0))
    assert all(torch.equal(a[1], b[1]) for a, b in zip(first, torch_first))
    assert not _same_batches(first, trainer.train_dataloader({}, 1))
    assert _same_batches(trainer.val_dataloader({}), trainer.val_dataloader({}))
    assert "dali_device" in trainer.data_key({}) and \
        trainer.data_key({"dali_threads": 4}) == trainer.data_key({})


def test_dali_grouped_job_equals_each_model_alone(tmp_path, folder):
    _dali()
    _grouped_equals_alone(tmp_path, _trainer_spec(folder, loader="dali", dali_device="cpu"))


@pytest.mark.gpu
def test_dali_gpu_decoding_gives_the_same_batches_across_builds(folder):
    _dali()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    trainer = ImageFolderTrainer(**_config(folder, loader="dali", dali_device="gpu"))
    first = list(trainer.train_dataloader({}, 0))
    assert first[0][0].is_cuda
    assert _same_batches(first, trainer.train_dataloader({"dali_threads": 1}, 0))
