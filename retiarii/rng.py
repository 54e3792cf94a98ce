"""RNG states as plain tensors: take, put back, store and seed python's, numpy's and torch's
random streams together.

The engine checkpoints them with every trial (``engine/checkpoint.py`` re-exports these
functions), and one-shot strategies swap their own streams in and out with them; they live
here, below both, so strategies never import the engine.
"""
from __future__ import annotations

import contextlib
import random
from typing import Any

import numpy as np
import torch

__all__ = ["NativeRng", "RngError", "capture_rng", "native_from_portable", "native_rng",
           "portable_rng", "restore_rng", "seed_rng", "set_native_rng", "swapped_in"]


class RngError(RuntimeError):
    """RNG states that cannot be put back here (CUDA states for another number of GPUs)."""


def capture_rng() -> dict[str, Any]:
    """The python, numpy and torch RNG states, in a form ``weights_only`` loading accepts.

    Example::

        state = capture_rng(); a = torch.rand(2); restore_rng(state); assert torch.equal(a, torch.rand(2))
    """
    return portable_rng(native_rng())


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the RNG states captured by :func:`capture_rng`.

    Example::

        restore_rng(capture_rng())

    Args:
        state: the dict :func:`capture_rng` returned (possibly after a save/load round trip).
    """
    set_native_rng(native_from_portable(state))


class NativeRng(tuple):
    """The RNG states as the RNG modules hand them out: cheap to take and put back, but not
    loadable with ``weights_only`` (see :func:`portable_rng`). Fields: python, numpy, torch,
    cuda (a list, empty while CUDA is not initialized)."""

    __slots__ = ()


def native_rng() -> NativeRng:
    """The current RNG states, for swapping streams in and out (:func:`set_native_rng`)."""
    cuda = []
    # Only read CUDA states once CUDA is up: asking earlier would initialize it as a side effect.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state_all()
    return NativeRng((random.getstate(), np.random.get_state(legacy=True),
                      torch.get_rng_state(), cuda))


def set_native_rng(state: NativeRng) -> None:
    """Put back the states :func:`native_rng` took."""
    py, np_state, torch_state, cuda = state
    random.setstate(py)
    np.random.set_state(np_state)
    torch.set_rng_state(torch_state)
    if cuda and torch.cuda.is_available():
        devices = torch.cuda.device_count()
        if devices != len(cuda):
            raise RngError(
                f"the checkpoint holds RNG states for {len(cuda)} CUDA devices but "
                f"{devices} are visible; resume with the same number of visible GPUs"
            )
        torch.cuda.set_rng_state_all(cuda)


def portable_rng(state: NativeRng) -> dict[str, Any]:
    """``state`` as tensors, numbers and strings (what a checkpoint stores)."""
    (version, mt, gauss), np_state, torch_state, cuda = state
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np_state
    return {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "name": np_name,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),  # uint32 -> int64: exact
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch_state,
        "cuda": list(cuda),
    }


def native_from_portable(state: dict[str, Any]) -> NativeRng:
    """The inverse of :func:`portable_rng`."""
    py, n = state["python"], state["numpy"]
    return NativeRng((
        (py["version"], tuple(py["state"].tolist()), py["gauss"]),
        (n["name"], n["keys"].cpu().numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]),
        state["torch"].cpu(), [s.cpu() for s in state.get("cuda") or []],
    ))


def seed_rng(seed: int) -> None:
    """Seed python, numpy and torch (all devices) from one integer.

    Example::

        seed_rng(0); a = torch.rand(1); seed_rng(0); assert torch.equal(a, torch.rand(1))

    Args:
        seed: any non-negative integer; numpy's legacy RNG only takes 32 bits, so it gets
            ``seed % 2**32``.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    # torch.manual_seed also queues a seed for every accelerator backend that is not up, taking
    # a stack trace for each (about a millisecond per trial); seed the ones that exist.
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if torch.backends.mps.is_available():
        torch.mps.manual_seed(seed)


@contextlib.contextmanager
def swapped_in(owner: Any, attr: str = "_rng"):
    """Swap ``owner``'s own RNG streams (a :class:`NativeRng` at ``owner.<attr>``) in for the
    block; on the way out they are saved back there and the outer streams restored. A trial
    and a one-shot strategy keep their randomness apart from everything else this way."""
    outer = native_rng()
    set_native_rng(getattr(owner, attr))
    try:
        yield
    finally:
        setattr(owner, attr, native_rng())
        set_native_rng(outer)
