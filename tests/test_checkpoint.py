"""Checkpoints: a resumed trial equals the uninterrupted one bit for bit (weights, optimizer,
LR scheduler), the test notices when any piece of state is missing, and unusable files get
clear errors naming them."""
from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from engine_helpers import SPACE, TRAINER, TRAINER_SGD_COSINE
from retiarii.engine.storage import checkpoint as ckpt
from retiarii.engine.storage.checkpoint import CheckpointError
from retiarii.engine.trainers.trainer import ClassifierTrainer, TrainingError, TrialRun, train_trial

SAMPLE = {"width": 6, "dropout": 0.25}  # dropout draws from the torch RNG every batch


def build():
    return SPACE.build(SAMPLE)


def flat(state):
    """Every tensor of a (nested) state dict, by path."""
    out = {}

    def walk(obj, path):
        if isinstance(obj, torch.Tensor):
            out[path] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}.{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]")
        else:
            out[path] = obj
    walk(state, "")
    return out


def assert_identical(a: TrialRun, b: TrialRun):
    for part in ("model", "optimizer", "lr_scheduler"):
        fa, fb = flat(a.state_dict()[part]), flat(b.state_dict()[part])
        assert fa.keys() == fb.keys()
        for key in fa:
            if isinstance(fa[key], torch.Tensor):
                assert torch.equal(fa[key], fb[key]), f"{part}{key} differs"
            else:
                assert fa[key] == fb[key], f"{part}{key} differs"


def segments(tmp_path, trainer, bounds, seed=3, hparams=None, tamper=None):
    """Train through checkpoints at ``bounds``; ``tamper(run)`` runs after every resume."""
    previous, run, reports = None, None, []
    for start, stop in zip(bounds, bounds[1:]):
        run = TrialRun(build, trainer, hparams, seed=seed, checkpoint=previous)
        if tamper and previous:
            tamper(run)
        assert run.step == start
        while run.step < stop:
            reports.append((run.step + 1, run.train_epoch()))
        previous = str(tmp_path / f"seg-{stop}.pt")
        run.save(previous)
    return run, reports


@pytest.mark.parametrize("trainer", [TRAINER, TRAINER_SGD_COSINE], ids=["adam", "sgd-cosine"])
def test_resume_equals_uninterrupted_bit_for_bit(tmp_path, trainer):
    reports = []
    full = train_trial(build, trainer, stop_step=4, seed=3, report=lambda s, m: reports.append((s, m)))
    resumed, seg_reports = segments(tmp_path, trainer, [0, 1, 3, 4])
    assert_identical(full, resumed)
    assert seg_reports == reports  # every metric of every step, exactly
    assert reports[-1][1]["val_acc"] > reports[0][1]["val_acc"]  # it did learn something


def test_a_checkpoint_that_drops_state_is_caught(tmp_path):
    """The comparison above can fail: losing the RNG stream or the optimizer moments shows."""
    full = train_trial(build, TRAINER_SGD_COSINE, stop_step=3, seed=3)

    def lose_rng(run):
        run._rng = ckpt.native_rng()  # the stream of whatever ran before, not the trial's

    def lose_optimizer(run):
        fresh = TrialRun(build, TRAINER_SGD_COSINE, seed=3)
        run.optimizer.load_state_dict(fresh.optimizer.state_dict())  # momentum buffers reset

    for tamper in (lose_rng, lose_optimizer):
        resumed, _ = segments(tmp_path, TRAINER_SGD_COSINE, [0, 1, 3], tamper=tamper)
        with pytest.raises(AssertionError, match="differs"):
            assert_identical(full, resumed)


def test_scheduler_position_survives(tmp_path):
    run, _ = segments(tmp_path, TRAINER_SGD_COSINE, [0, 2])
    resumed = TrialRun(build, TRAINER_SGD_COSINE, seed=3, checkpoint=str(tmp_path / "seg-2.pt"))
    assert resumed.scheduler.last_epoch == 2
    assert resumed.optimizer.param_groups[0]["lr"] == run.optimizer.param_groups[0]["lr"] < 0.05


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    ckpt.seed_rng(11)
    random.random(), np.random.rand(), torch.rand(3)  # move every stream off its seed
    ckpt.save(tmp_path / "rng.pt", {"rng": ckpt.capture_rng()})
    want = (random.random(), np.random.rand(), torch.rand(3), np.random.randn())
    ckpt.seed_rng(99)
    ckpt.restore_rng(ckpt.load(tmp_path / "rng.pt")["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3), np.random.randn())
    assert want[:2] == got[:2] and torch.equal(want[2], got[2]) and want[3] == got[3]


def test_checkpoint_file_holds_every_piece_and_loads_weights_only(tmp_path):
    _, _ = segments(tmp_path, TRAINER_SGD_COSINE, [0, 1])
    raw = torch.load(tmp_path / "seg-1.pt", weights_only=True)
    state = raw["state"]
    assert raw["format"] == "retiarii-checkpoint"
    assert {"model", "optimizer", "lr_scheduler", "rng", "step", "data_position", "hparams",
            "trial_id"} <= state.keys()
    assert state["step"] == 1 and state["data_position"] == {"epoch": 1, "batch": 0}
    assert {"python", "numpy", "torch"} <= state["rng"].keys()


def test_pbt_child_takes_new_hparams_and_keeps_moments(tmp_path):
    train_trial(build, TRAINER, {"lr": 1e-3}, stop_step=1, checkpoint_out=str(tmp_path / "p.pt"))
    parent = torch.load(tmp_path / "p.pt", weights_only=True)["state"]
    child = TrialRun(build, TRAINER, {"lr": 2e-3}, checkpoint=str(tmp_path / "p.pt"))
    assert child.optimizer.param_groups[0]["lr"] == pytest.approx(2e-3)
    exp_avg = child.optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(exp_avg, parent["optimizer"]["state"][0]["exp_avg"])
    same = TrialRun(build, TRAINER, {"lr": 1e-3}, checkpoint=str(tmp_path / "p.pt"))
    assert same.optimizer.param_groups[0]["lr"] == 1e-3


# ---- errors -------------------------------------------------------------------------------


def test_corrupt_missing_and_foreign_files_name_the_file(tmp_path):
    good = tmp_path / "good.pt"
    ckpt.save(good, {"step": 1, "w": torch.ones(1000)})
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:300])
    noise = tmp_path / "noise.pt"
    noise.write_bytes(os.urandom(2048))
    for bad in (truncated, noise):
        with pytest.raises(CheckpointError, match=f"checkpoint {bad} is corrupt"):
            ckpt.load(bad)
    with pytest.raises(CheckpointError, match="missing.pt does not exist"):
        ckpt.load(tmp_path / "missing.pt")
    torch.save({"weights": torch.ones(1)}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="foreign.pt is a torch file but not a retiarii"):
        ckpt.load(tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="truncated.pt is corrupt"):
        TrialRun(build, TRAINER, checkpoint=str(truncated))


def test_unloadable_state_fails_at_save_and_writes_nothing(tmp_path):
    path = tmp_path / "c.pt"
    ckpt.save(path, {"step": 1})
    with pytest.raises(CheckpointError, match=r"checkpoint state\['sched'\]\['fn'\] is a .*function"):
        ckpt.save(path, {"step": 2, "sched": {"fn": lambda e: e}})
    assert ckpt.load(path) == {"step": 1}  # the previous checkpoint is untouched
    assert os.listdir(tmp_path) == ["c.pt"]  # and no temporary file is left behind


def test_interrupted_write_leaves_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    ckpt.save(path, {"step": 1})

    def crash(obj, f):
        f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save(path, {"step": 2})
    monkeypatch.undo()
    assert ckpt.load(path) == {"step": 1} and os.listdir(tmp_path) == ["c.pt"]


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    train_trial(build, TRAINER, stop_step=1, checkpoint_out=str(tmp_path / "a.pt"))
    with pytest.raises(CheckpointError, match="does not fit trial t9's model"):
        TrialRun(lambda: SPACE.build({"width": 3}), TRAINER, checkpoint=str(tmp_path / "a.pt"),
                 trial_id="t9")


def test_nan_loss_and_bad_segments_are_clear_errors(tmp_path):
    with pytest.raises(TrainingError, match="trial t7: training loss is nan in epoch 1"):
        train_trial(lambda: SPACE.build({"fail": "nan"}), TRAINER, stop_step=1, trial_id="t7")
    with pytest.raises(ValueError, match="starts at step 2 but a fresh start is at step 0"):
        train_trial(build, TRAINER, start_step=2, stop_step=3)
    with pytest.raises(TypeError, match=r"not a plain value.*hparams\['lr'\]"):
        train_trial(build, ClassifierTrainer(lr=object()), stop_step=1)
    with pytest.raises(ValueError, match="unknown optimizer 'adamax'"):
        train_trial(build, TRAINER, {"optimizer": "adamax"}, stop_step=1)
