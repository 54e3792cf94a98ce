"""What undoes a measuring group's first fused step: the models' storage from before fusing,
their optimizers' state and their RNG streams.

A first fused step in which every trial fails before the fused optimizer steps (a forward or
backward that cannot run fused: out of memory for K models at once, say) is fusion's failure,
not the trials'. Fusing gives the models new storage and leaves the old untouched, so keeping
the old tensors and optimizer state entries costs no copy; :meth:`FusedUndo.undo` puts every
model, optimizer and RNG stream back to before the step, and the batch runs again in another
layout (``measuring_group.MeasuringGroup``).

Example::

    undo = FusedUndo(runs)             # before fused_unit(runs)
    module, fopt = fused_unit(runs)
    undo.before_step(runs)             # the streams the step starts from
    ...                                # the step: every trial failed, nothing stepped
    undo.undo(runs)
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

__all__ = ["FusedUndo"]


class FusedUndo:
    """A snapshot of ``runs`` before fusing (see the module docstring).

    Args:
        runs: trial -> its ``TrialRun`` (``model``, ``optimizer``, ``_rng``).
    """

    def __init__(self, runs: Mapping[str, Any]):
        self.tensors = [(t, t.data) for run in runs.values()
                        for t in itertools.chain(run.model.parameters(), run.model.buffers())]
        self.states = [(run.optimizer, dict(run.optimizer.state)) for run in runs.values()]
        self.rng: dict[str, Any] = {}

    def before_step(self, runs: Mapping[str, Any]) -> None:
        """Keep the RNG streams the first fused step starts from."""
        self.rng = {t: getattr(r, "_rng", None) for t, r in runs.items()}

    def undo(self, runs: Mapping[str, Any]) -> None:
        """Every model, optimizer and RNG stream of ``runs`` back to before the step (their
        storage from before fusing: nothing fused ever wrote to it), gradients cleared."""
        for tensor, data in self.tensors:
            tensor.data = data
        for optimizer, state in self.states:
            optimizer.state.clear()
            optimizer.state.update(state)
        for trial, streams in self.rng.items():
            if trial in runs:
                runs[trial]._rng = streams
        for run in runs.values():
            for p in run.model.parameters():
                p.grad = None
