"""Dedicated devices: a group's shared frozen part on a device of its own, one batch ahead
(paper §5.2, Fig. 9b; docs/optimization.md, "Dedicated devices").

A large frozen encoder that several models read (CSE computes it once per batch in the group
module's ``shared`` cell) need not wait for the models: while they train on batch *i* on
their device, the encoder computes batch *i + 1* on its own::

    encoder device:   enc(b1)  enc(b2)  enc(b3) ...
    models' device:            train(b1) train(b2) train(b3) ...

- **Which operators.** ``Experiment(dedicated=["encoder", "TransformerEncoder"])``: a
  pattern names a module of the model (``fnmatch`` on its qualified name, as in the base
  model: ``"encoder"``, ``"backbone.*"``) or its class (``"TransformerEncoder"``). A grouped
  job whose shared cell holds a matching module runs that whole cell on the dedicated device
  (the shared cell is frozen, weightless or data: it never trains); a group with none trains
  as before.
- **Where.** ``"process"`` (the default on a CPU-only machine, where devices are worker
  slots): a child process of the worker holds a copy of the shared cell, reads each batch's
  inputs from a queue and returns the outputs through shared memory. ``"thread"``: a thread
  of the worker (torch releases the GIL in its kernels, so it uses another core; no process
  to start). ``"cuda:N"``: another GPU, or the models' own GPU on a side CUDA stream; the
  outputs are moved to the models' device.
- **Exact.** The shared cell draws no random numbers and keeps no state, so computing it
  early, elsewhere, gives the same values: bit for bit on the CPU with the same number of
  threads (the child process gets the worker's), tested against the group without a
  dedicated device (``tests/test_dedicated.py``). The model inputs are learnt from the first
  batch (the tensors ``training_step`` passed to the model); a batch whose model inputs turn
  out to be other tensors computes its shared part in place, as without a dedicated device.
"""
from __future__ import annotations

import collections
import dataclasses
import fnmatch
import queue
import threading
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ...determinism import carry
from .group_forward import tensors_of
from .training_group import TrainingGroup
from ..jobs.reports import UnitReport

__all__ = ["DedicatedGroup", "EncoderWorker", "dedicated_modules", "default_device"]


def default_device(models_device: torch.device) -> str:
    """Where a dedicated encoder runs when not said: another GPU when there is one, else a
    side stream of the models' GPU; on a CPU-only machine a process (a worker slot)."""
    if models_device.type == "cuda":
        count = torch.cuda.device_count()
        index = models_device.index or 0
        return f"cuda:{(index + 1) % count}" if count > 1 else f"cuda:{index}"
    return "process"


def dedicated_modules(shared: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The modules of a group's ``shared`` cell that ``patterns`` name (by qualified name as
    in the model, or by class name), e.g. ``["encoder"]`` for ``_m0.encoder``."""
    out = []
    for name, module in shared.named_modules():
        if not name or "." not in name and name.startswith("_m"):
            continue
        plain = name.split(".", 1)[1] if name.startswith("_m") and "." in name else name
        if any(fnmatch.fnmatchcase(plain, p) or type(module).__name__ == p for p in patterns):
            out.append(plain)
    return out


def _encoder_main(encoder: nn.Module, inbox, outbox, threads: int) -> None:
    """The dedicated process: inputs in, the shared cell's outputs out, until None."""
    torch.set_num_threads(threads)
    while True:
        inputs = inbox.get()
        if inputs is None:
            return
        try:
            with torch.no_grad():
                outbox.put(("ok", tuple(encoder(*inputs))))
        except Exception as err:  # noqa: BLE001 (reported to the worker, which raises it)
            outbox.put(("error", f"{type(err).__name__}: {err}"))


class EncoderWorker:
    """Runs ``encoder`` (a group's shared cell) on a dedicated device, in submission order.

    Example::

        worker = EncoderWorker(group.shared, "thread")
        worker.submit((x1,)); worker.submit((x2,))
        out1 = worker.result(); out2 = worker.result()     # what group.shared(x) returns
        worker.close()

    Args:
        encoder: the module; in ``"process"`` mode a copy goes to the child process.
        device: ``"process"``, ``"thread"``, or a CUDA device (``"cuda:1"``; the models'
            own device gives a side stream).
        out_device: where results are returned (the models' device).
    """

    def __init__(self, encoder: nn.Module, device: str = "process",
                 out_device: torch.device | str = "cpu"):
        self.device, self.out_device = device, torch.device(out_device)
        self._waiting: collections.deque = collections.deque()
        self._closed = False
        if device == "process":
            ctx = torch.multiprocessing.get_context("spawn")
            self._in, self._out = ctx.Queue(), ctx.Queue()
            # carry: a process of its own runs in the job's deterministic mode too (a
            # thread shares the process's)
            self._process = ctx.Process(target=carry(_encoder_main), daemon=True, args=(
                encoder, self._in, self._out, torch.get_num_threads()))
            self._process.start()
        elif device == "thread":
            self._in, self._out = queue.Queue(), queue.Queue()
            self._thread = threading.Thread(target=_encoder_main, daemon=True, args=(
                encoder, self._in, self._out, torch.get_num_threads()))
            self._thread.start()
        elif str(device).startswith("cuda"):
            self._cuda = torch.device(device)
            self._encoder = encoder.to(self._cuda)
            self._stream = torch.cuda.Stream(self._cuda)
        else:
            raise ValueError(f"dedicated device {device!r}: give 'process', 'thread' or 'cuda:N'")

    def submit(self, inputs: tuple) -> None:
        """Start computing ``encoder(*inputs)``; results come back in submission order."""
        if self.device in ("process", "thread"):
            self._in.put(tuple(t.detach().cpu() if isinstance(t, torch.Tensor) else t
                               for t in inputs))
            self._waiting.append(None)
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self._cuda))
        with torch.cuda.device(self._cuda), torch.cuda.stream(self._stream), torch.no_grad():
            self._stream.wait_event(ready)  # the inputs were written on the current stream
            moved = [t.to(self._cuda, non_blocking=True) if isinstance(t, torch.Tensor) else t
                     for t in inputs]
            outs = tuple(self._encoder(*moved))
        done = torch.cuda.Event()
        done.record(self._stream)
        self._waiting.append((outs, done))

    def result(self, timeout: float = 600.0) -> tuple:
        """The outputs of the oldest submission not yet returned, on ``out_device``."""
        entry = self._waiting.popleft()
        if entry is None:
            try:
                kind, value = self._out.get(timeout=timeout)
            except queue.Empty:
                raise RuntimeError(f"the dedicated {self.device} computed nothing in {timeout} s"
                                   ) from None
            if kind == "error":
                raise RuntimeError(f"the dedicated {self.device} failed: {value}")
            return tuple(v.to(self.out_device) if isinstance(v, torch.Tensor) else v
                         for v in value)
        outs, done = entry
        torch.cuda.current_stream(self.out_device).wait_event(done)
        return tuple(v.to(self.out_device, non_blocking=True) if isinstance(v, torch.Tensor)
                     else v for v in outs)

    def close(self) -> None:
        """Stop the process or thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.device in ("process", "thread"):
            self._in.put(None)
            worker = self._process if self.device == "process" else self._thread
            worker.join(timeout=10)
            if self.device == "process" and worker.is_alive():
                worker.kill()


class DedicatedGroup(TrainingGroup):
    """A :class:`~.grouped.TrainingGroup` whose shared cell runs on a dedicated device, one
    batch ahead of the models (see the module docstring).

    Args:
        patterns: what names a dedicated module (see :func:`dedicated_modules`); a group
            whose shared cell holds none trains as a plain :class:`~.grouped.TrainingGroup`.
        device: ``"process"``, ``"thread"`` or ``"cuda:N"`` (see :class:`EncoderWorker`).
        (the others: :class:`~.grouped.TrainingGroup`'s)
    """

    def __init__(self, plan, runs, trainer, profile=None, patterns: Sequence[str] = (),
                 device: str = "process"):
        self._device, self._patterns = device, list(patterns)
        self.dedicated: list[str] = []  # the modules of its shared cell the patterns name
        self._worker: EncoderWorker | None = None
        self._positions: list[int] | None = None  # which batch tensors are the model inputs
        self._pending: collections.deque = collections.deque()  # per batch read ahead: submitted?
        super().__init__(plan, runs, trainer, profile=profile)

    def _build(self) -> nn.Module:
        group = super()._build()
        if self._worker is not None:  # the group changed (a trial left): a new copy of the cell
            for submitted in self._pending:  # what the old one computed ahead is dropped ...
                if submitted:
                    self._worker.result()
            # ... and those batches compute their shared part in place
            self._pending = collections.deque(False for _ in self._pending)
            self._worker.close()
            self._worker = None
        # A shared part that updates running statistics (a frozen BatchNorm in train mode)
        # runs in place, in order: a copy computing ahead would update its own statistics.
        self.dedicated = ([] if getattr(group, "holds_state", False)
                          else dedicated_modules(group.shared, self._patterns))
        if self.dedicated:
            first = next(iter(self.runs.values()))
            self._worker = EncoderWorker(group.shared, self._device, first.device)
        return group

    def report(self) -> UnitReport:
        return dataclasses.replace(super().report(), dedicated=tuple(self.dedicated),
                                   dedicated_device=self._device if self.dedicated else None)

    def drop(self, trials) -> None:
        super().drop(trials)
        if not self.runs and self._worker is not None:
            self._worker.close()
            self._worker = None
            self._pending.clear()  # nothing will read what was computed ahead

    def _feed(self, batches: Iterator) -> Iterator:
        """Yield the epoch's batches, keeping the next one's shared part submitted to the
        dedicated device while the models train on the current one."""
        ahead: collections.deque = collections.deque()
        try:
            while True:
                while len(ahead) < 2:  # the current batch and the next, both submitted
                    batch = next(batches, None)
                    if batch is None:
                        break
                    ahead.append(batch)
                    self._pending.append(self._submit(batch))
                if not ahead:
                    return
                yield ahead.popleft()
        finally:
            for submitted in self._pending:  # read ahead but never trained (the epoch ended)
                if submitted and self._worker is not None:
                    self._worker.result()
            self._pending.clear()

    def _submit(self, batch: Any) -> bool:
        if self._positions is None or self._worker is None:
            return False  # the first batch: the model inputs are not known yet
        tensors = tensors_of(batch)
        self._worker.submit(tuple(tensors[i] for i in self._positions))
        return True

    def _ahead(self, batch: Any):
        submitted = self._pending.popleft() if self._pending else False
        # taken now, whatever the step does with it: results come back in submission order
        result = self._worker.result() if submitted else None
        tensors = tensors_of(batch)

        def common(inputs: tuple) -> tuple | None:
            ids = [id(t) for t in tensors]
            positions = [ids.index(id(a)) if isinstance(a, torch.Tensor) and id(a) in ids
                         else -1 for a in inputs]
            if -1 in positions or (self._positions is not None and positions != self._positions):
                return None  # other inputs than learnt: computed in place
            self._positions = positions
            return result

        return common
