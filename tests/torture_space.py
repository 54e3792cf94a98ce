"""The space, trainer and kill switches of the crash torture at scale (importable by workers).

``space`` x ``trainer`` holds 10 widths x 3 activations x 8 learning rates = 240 models of 30
architectures: a Random search of 200 of them draws several trials of one architecture into
most grouped jobs (fused units) and trials of other architectures beside them (CSE-grouped).

Kill switches, both off unless the driving test sets them:

- :func:`die_at_store_write` makes the driver SIGKILL itself at its n-th store write (before
  the write happens: what was not committed is lost, as for any SIGKILL).
- :class:`KillingTrainer` SIGKILLs its *worker* at planned batches: the environment variable
  ``TORTURE_KILLS`` holds ``DIR:G1,G2,...``; a worker process that has trained ``G_i`` batches
  since it started, when ``i`` kills were already made (files ``DIR/kill-<j>``), claims kill
  ``i`` (an exclusive create: two workers never take one kill) and dies. A worker started in its
  place counts from 0 again. Unset (the reference runs), it is the plain classifier trainer.
"""
from __future__ import annotations

import multiprocessing
import os
import signal

import torch
from torch import nn

import retiarii as rt
from retiarii.engine.storage.plans_table import PlanTable
from retiarii.engine.storage.segments_table import SegmentTable
from retiarii.engine.storage.store import Store
from retiarii.engine.trainers.trainer import ClassifierTrainer

# Every write the driver makes to its store, each one a transaction (or metric rows: flush):
# the Store's (the list of tests/test_crash_torture.py), a grouped job's plans row, and a
# one-shot segment's commit and its rows (tests/test_one_shot_engine.py).
WRITES = [(Store, name) for name in (
    "add_experiment", "set_experiment_status", "stage_model", "trial_added", "transition",
    "result", "flush", "checkpoint", "worker", "set_model_status", "save_strategy_state",
    "scheduler_state", "drop_untrained_orphans", "forget_checkpoint")] + [
    (PlanTable, "add"), (SegmentTable, "commit"), (SegmentTable, "_insert_model"),
    (SegmentTable, "record_result"), (SegmentTable, "clear_error")]


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        hidden = rt.ValueChoice([8, 12, 16, 20, 24, 28, 32, 40, 48, 64], label="hidden")
        self.flatten = nn.Flatten()
        self.fc1 = rt.nn.Linear(64, hidden)
        self.act = rt.LayerChoice({"relu": nn.ReLU(), "tanh": nn.Tanh(), "sigmoid": nn.Sigmoid()},
                                  label="act")
        self.fc2 = rt.nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.flatten(x))))  # (B, 1, 8, 8) -> (B, 10)


class KillingTrainer(ClassifierTrainer):
    """The digits classifier; SIGKILLs its worker at the planned batches (module docstring)."""

    def steps_draw_random(self) -> bool:
        return False  # the steps are the classifier's: they draw nothing

    def training_step(self, model, batch, hparams):
        _maybe_die()
        return super().training_step(model, batch, hparams)


_batches = 0  # batches this process trained


def _maybe_die() -> None:
    global _batches
    plan = os.environ.get("TORTURE_KILLS")
    if not plan or multiprocessing.parent_process() is None:
        return  # the reference runs, or the driver (a one-shot driver checks steps itself)
    _batches += 1
    folder, gaps = plan.rsplit(":", 1)
    gaps = [int(g) for g in gaps.split(",") if g]
    made = sum(1 for f in os.listdir(folder) if f.startswith("kill-"))
    if made < len(gaps) and _batches >= gaps[made]:
        try:
            fd = os.open(os.path.join(folder, f"kill-{made}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, f"worker {os.getpid()} at its batch {_batches}\n".encode())
            os.close(fd)
        except FileExistsError:
            return  # the other worker took this kill
        os.kill(os.getpid(), signal.SIGKILL)


def die_at_store_write(n: int) -> None:
    """From now on, this process SIGKILLs itself at its ``n``-th store write (see WRITES)."""
    count = [0]

    def wrap(cls, name):
        original = getattr(cls, name)

        def write(self, *args, **kwargs):
            if name == "flush" and not self._buffer:
                return original(self, *args, **kwargs)  # nothing to write: not a write point
            count[0] += 1
            if count[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self, *args, **kwargs)

        return write

    for cls, name in WRITES:
        setattr(cls, name, wrap(cls, name))


EXAMPLE = torch.zeros(2, 1, 8, 8)
space = rt.ModelSpace(MLP(), example_input=EXAMPLE)  # 30 architectures
trainer = KillingTrainer(dataset="digits", epochs=2, batch_size=128,
                         lr=rt.ValueChoice([0.005, 0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15],
                                           label="lr"))
# The one-shot search's trainer (tests/one_shot_helpers.py's space; its strategy trains with
# this trainer's steps, so its worker dies at the planned batches too).
one_shot_trainer = KillingTrainer(dataset="digits", epochs=1, batch_size=128)
