"""Small stand-ins the engine tests build models and trainers from.

Workers import these by reference (``"tests.engine_helpers:SPACE"`` won't do: ``tests`` is not a
package), so specs use the file path: ``ref("SPACE")`` gives ``"/abs/.../engine_helpers.py:SPACE"``.
"""
from __future__ import annotations

import os
import signal

import torch
from torch import nn

from retiarii.engine.jobs.job import Executor, JobFailed
from retiarii.engine.trainers.trainer import ClassifierTrainer
from retiarii.engine.worker_side.worker import WorkerContext, run_job


def ref(attr: str) -> str:
    """An import reference to ``attr`` of this file, as TrialTask specs carry them."""
    return f"{os.path.abspath(__file__)}:{attr}"


class TinyCNN(nn.Module):
    """A small CNN for 1x8x8 digits: conv -> relu -> (dropout) -> pool -> linear."""

    def __init__(self, width: int = 8, dropout: float = 0.0):
        super().__init__()
        self.conv = nn.Conv2d(1, width, kernel_size=3, padding=1)
        self.drop = nn.Dropout(dropout)  # consumes torch RNG: checks that RNG state is restored
        self.head = nn.Linear(width * 4 * 4, 10)

    def forward(self, x):
        h = torch.relu(self.conv(x))  # (B, 1, 8, 8) -> (B, W, 8, 8)
        h = nn.functional.max_pool2d(self.drop(h), 2)  # -> (B, W, 4, 4)
        return self.head(h.flatten(1))  # -> (B, 10)


class TinySpace:
    """A two-choice space with ``build(sample)``, the only call workers make on a space.

    Special samples make models that misbehave on purpose:
    ``{"fail": "shape"}`` builds a model whose forward raises a shape error,
    ``{"fail": "nan"}`` one whose loss is NaN, ``{"fail": "die"}`` one that SIGKILLs its own
    worker process in forward, ``{"fail": "hang"}`` one that blocks forever in forward,
    ``{"fail": "stop"}`` one that SIGSTOPs its worker (alive, but its heartbeats cease).
    """

    def build(self, sample: dict) -> nn.Module:
        fail = sample.get("fail")
        if fail == "shape":
            return nn.Sequential(nn.Flatten(), nn.Linear(63, 10))  # digits flatten to 64
        if fail == "nan":
            return _Nan()
        if fail == "die":
            return _Die()
        if fail == "hang":
            return _Hang()
        if fail == "stop":
            return _Stop()
        return TinyCNN(width=int(sample.get("width", 8)), dropout=float(sample.get("dropout", 0.0)))


class _Nan(TinyCNN):
    def forward(self, x):
        return super().forward(x) * float("nan")


class _Die(TinyCNN):
    def forward(self, x):
        os.kill(os.getpid(), signal.SIGKILL)


class _Hang(TinyCNN):
    def forward(self, x):
        import threading

        threading.Event().wait()  # never set: the test cancels the job


class _Stop(TinyCNN):
    def forward(self, x):
        os.kill(os.getpid(), signal.SIGSTOP)


SPACE = TinySpace()

# A trainer instance referenced directly by specs (the other form is {"class", "config"}).
TRAINER = ClassifierTrainer(dataset="digits", epochs=4, batch_size=64, lr=3e-3, seed=1)

# Few, large batches: for executor tests, where what is trained matters less than the events.
FAST = ClassifierTrainer(dataset="digits", epochs=4, batch_size=256, lr=1e-2, seed=1)



class DyingTrainer(ClassifierTrainer):
    """SIGKILLs its worker as epoch ``hparams["die_in_epoch"]`` begins, once: the file
    ``hparams["die_marker"]`` remembers it happened, so the retry trains normally."""

    def train_dataloader(self, hparams, epoch):
        marker = hparams.get("die_marker")
        if marker and epoch == hparams.get("die_in_epoch") and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().train_dataloader(hparams, epoch)


DYING = DyingTrainer(FAST.config)


class HangingTrainer(ClassifierTrainer):
    """Stops its worker (SIGSTOP: alive, silent, holding its slot) as epoch
    ``hparams["hang_in_epoch"]`` begins, once (``hparams["hang_marker"]`` remembers): a hung
    worker that only a heartbeat deadline can tell from a busy one."""

    def train_dataloader(self, hparams, epoch):
        marker = hparams.get("hang_marker")
        if marker and epoch == hparams.get("hang_in_epoch") and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        return super().train_dataloader(hparams, epoch)


HANGING = HangingTrainer(FAST.config)


class FailingTrainer(ClassifierTrainer):
    """Raises in step ``hparams["raise_in_step"]`` (1-based), every time: a trial whose own
    code fails (the executor contract's failing task)."""

    def train_dataloader(self, hparams, epoch):
        if hparams.get("raise_in_step") == epoch + 1:
            raise RuntimeError(f"planned failure in step {epoch + 1}")
        return super().train_dataloader(hparams, epoch)


FAILING = FailingTrainer(FAST.config)


class DeviceReportingTrainer(ClassifierTrainer):
    """Reports the ``CUDA_VISIBLE_DEVICES`` its worker process sees (-1: empty, -2: unset)
    and its torch thread count, as metrics."""

    def validation_step(self, model, batch):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        device = -2.0 if visible is None else (-1.0 if visible == "" else float(visible))
        return {**super().validation_step(model, batch), "visible_device": device,
                "threads": float(torch.get_num_threads())}


DEVICE_REPORTING = DeviceReportingTrainer(FAST.config)

# Same as TRAINER, with a cosine LR schedule and SGD momentum: more state the checkpoint must carry.
TRAINER_SGD_COSINE = ClassifierTrainer(dataset="digits", epochs=4, batch_size=32, optimizer="sgd",
                                       lr=0.05, momentum=0.9, lr_schedule="cosine", seed=2)


# ---- a journal that dies mid-write (the driver crashing) ------------------------------------

from retiarii.engine.runner.trial_runner import MemoryJournal  # noqa: E402


class Crash(Exception):
    pass


class CrashingJournal(MemoryJournal):
    """Dies, like the driver would, on its n-th write (in the middle of handling an event)."""

    def __init__(self, crash_at=None):
        super().__init__()
        self.crash_at, self.writes = crash_at, 0

    def _write(self, kind, payload):
        self.writes += 1
        if self.writes == self.crash_at:
            raise Crash()
        super()._write(kind, payload)


class InProcessExecutor(Executor):
    """One slot that runs each job with ``worker.run_job`` in this process (no workers)."""

    num_slots = 1

    def __init__(self):
        self.jobs, self.events, self.context = [], [], WorkerContext()

    def submit(self, job):
        self.jobs.append(job)

    def next_event(self, timeout=None):
        if not self.events and self.jobs:
            run_job(self.jobs.pop(0), self.events.append, context=self.context)
        return self.events.pop(0) if self.events else None

    def cancel(self, job_id):
        self.jobs = [j for j in self.jobs if j.job_id != job_id]
        self.events = [e for e in self.events if e.job_id != job_id]
        self.events.append(JobFailed(job_id, None, "cancelled"))
