"""What training any model with a :class:`~retiarii.Trainer` needs: the size of a batch,
moving a batch to a device, and reading ``configure_optimizers``' answer. The engine's trial
runs and the one-shot strategies (which train their own super-networks) share them.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["batch_size", "parse_optimizers", "to_device"]


def batch_size(batch: Any) -> int:
    """Examples in ``batch``: the length of its first tensor (1 when there is none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size(batch[0])
    if isinstance(batch, dict) and batch:
        return batch_size(next(iter(batch.values())))
    return 1


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def parse_optimizers(out: Any) -> tuple[torch.optim.Optimizer, Any, str]:
    """(optimizer, lr scheduler or None, "epoch" | "step") from configure_optimizers' answer."""
    sched, interval = None, "epoch"
    if isinstance(out, dict):
        opt, sched = out.get("optimizer"), out.get("lr_scheduler")
    elif isinstance(out, (tuple, list)) and len(out) == 2:
        opt, sched = out
    else:
        opt = out
    if isinstance(sched, dict):
        sched, interval = sched.get("scheduler"), sched.get("interval", "epoch")
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"configure_optimizers returned {type(out).__name__}; return an optimizer, "
                        "(optimizer, lr_scheduler) or {'optimizer': ..., 'lr_scheduler': ...}")
    if interval not in ("epoch", "step"):
        raise ValueError(f"lr_scheduler interval must be 'epoch' or 'step', got {interval!r}")
    return opt, sched, interval
