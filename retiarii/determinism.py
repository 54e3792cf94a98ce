"""Deterministic mode: the one place that sets PyTorch's reproducibility switches in a process.

``Experiment(deterministic=True)`` (``retiarii run --deterministic``) puts ``"deterministic":
true`` in every trial's spec; the worker that trains a job runs it inside
:func:`deterministic`, and every process a job starts (mixed-parallel ranks, Ray rank
actors, a dedicated module's process) gets the setting of the process that started it
(:func:`carry`, :func:`enabled`). In that mode:

- ``torch.use_deterministic_algorithms(True)``: an op with no deterministic kernel raises
  instead of running a non-deterministic one;
- cuDNN picks deterministic algorithms and does not benchmark (``cudnn.deterministic``,
  not ``cudnn.benchmark``);
- no TF32 in matrix products or cuDNN convolutions and RNNs (full float32);
- ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which cuBLAS needs for reproducible results and
  which PyTorch reads once, when a process first uses cuBLAS: :func:`prepare_worker` sets it
  first thing in every worker process, so any worker can switch to this mode later;
- adaptive average pooling's backward on a GPU, which PyTorch has no deterministic kernel
  for (it raises there; first seen on an H200 with ``AdaptiveAvgPool2d(2)``, as VGG's 7x7 and
  AlexNet's 6x6 pools), runs a deterministic one of ours (:func:`_adaptive_pool_backward`:
  two or three matrix products, no atomic adds) while the block runs. Pooling to 1x1 needs
  none: PyTorch computes it as a mean.

Outside the block the previous settings are back: a worker that trains a deterministic job
and then another job trains the second with the defaults.

Example::

    with deterministic(True):
        run.train_epoch()                # torch.are_deterministic_algorithms_enabled()
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Any, Callable, Iterator

__all__ = ["CUBLAS_WORKSPACE", "DeterminismError", "carry", "check", "deterministic", "enabled",
           "prepare_worker", "settings", "spec_wants"]

# cuBLAS's two workspace configurations that give reproducible results (its docs, "Results
# reproducibility"); the larger is the one its docs recommend on Hopper GPUs.
CUBLAS_WORKSPACE = ":4096:8"
_REPRODUCIBLE_WORKSPACES = (":4096:8", ":16:8")
_ENV = "CUBLAS_WORKSPACE_CONFIG"


class DeterminismError(RuntimeError):
    """Deterministic mode cannot be honoured in this process (cuBLAS already started with a
    workspace setting that is not reproducible)."""


def check(value: Any, where: str = "deterministic") -> bool:
    """``value`` as a deterministic-mode switch: True or False, nothing else.

    Example::

        check(True)        # True
        check("yes")       # ValueError naming the value and the fix
    """
    if not isinstance(value, bool):
        raise ValueError(f"{where}={value!r}: give True or False (True turns on deterministic "
                         f"kernels in every process that trains; docs/engine.md)")
    return value


def spec_wants(specs: Any) -> bool:
    """Whether any of the trial specs ``specs`` asks for deterministic mode (its value
    checked): a job trains deterministically when one of its trials must."""
    return any(check(spec.get("deterministic", False), "spec['deterministic']")
               for spec in specs)


def prepare_worker() -> None:
    """Give this process the reproducible cuBLAS workspace unless one is set already. Called
    first in every worker process, before CUDA starts: PyTorch reads the variable once, when
    the process first uses cuBLAS. It costs 32 MiB of GPU memory per cuBLAS handle."""
    os.environ.setdefault(_ENV, CUBLAS_WORKSPACE)


def _torch():
    import torch

    return torch


def _cuda_started(torch) -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _precision_flags(torch) -> list[tuple[Any, str]]:
    """(object, attribute) of each TF32 switch this torch has: the per-backend
    ``fp32_precision`` of torch >= 2.9 (mixing it with the older ``allow_tf32`` makes torch
    refuse to read the flags), else ``allow_tf32``."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision") and hasattr(getattr(cudnn, "conv", None),
                                                     "fp32_precision"):
        return [(matmul, "fp32_precision"), (cudnn.conv, "fp32_precision"),
                (cudnn.rnn, "fp32_precision")]
    return [(matmul, "allow_tf32"), (cudnn, "allow_tf32")]


def _tf32(value: Any) -> bool:
    """Whether a TF32 switch's value lets TF32 run (``"tf32"``, or ``allow_tf32=True``)."""
    return value == "tf32" or value is True


def _state(torch) -> dict:
    return {"algorithms": torch.are_deterministic_algorithms_enabled(),
            "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "precision": [getattr(obj, attr) for obj, attr in _precision_flags(torch)]}


def _set(torch, state: dict) -> None:
    torch.use_deterministic_algorithms(state["algorithms"], warn_only=state["warn_only"])
    torch.backends.cudnn.deterministic = state["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = state["cudnn_benchmark"]
    for (obj, attr), value in zip(_precision_flags(torch), state["precision"]):
        setattr(obj, attr, value)


def _ensure_workspace(torch) -> None:
    """The cuBLAS workspace setting, set now if cuBLAS may not have started yet; else it
    must already be a reproducible one."""
    value = os.environ.get(_ENV)
    if value in _REPRODUCIBLE_WORKSPACES:
        return
    if not _cuda_started(torch):
        os.environ[_ENV] = CUBLAS_WORKSPACE
        return
    raise DeterminismError(
        f"deterministic mode needs {_ENV}={CUBLAS_WORKSPACE} (or :16:8) before CUDA starts, "
        f"but CUDA started in process {os.getpid()} with {_ENV}={value!r}: unset it or set "
        f"it to {CUBLAS_WORKSPACE} in the environment, or train in a fresh worker")


def _window_matrix(n_in: int, n_out: int, like: Any) -> tuple[Any, Any]:
    """Adaptive pooling's windows along one dimension: a 0/1 matrix ``(n_out, n_in)`` whose
    row i covers PyTorch's window ``[floor(i n_in / n_out), ceil((i + 1) n_in / n_out))``,
    and each window's length."""
    torch = _torch()
    i = torch.arange(n_out, device=like.device)
    start, end = (i * n_in) // n_out, ((i + 1) * n_in + n_out - 1) // n_out
    j = torch.arange(n_in, device=like.device)
    member = (j[None, :] >= start[:, None]) & (j[None, :] < end[:, None])
    return member.to(like.dtype), (end - start).to(like.dtype)


def _adaptive_pool_backward(grad: Any, inp: Any, dims: int) -> Any:
    """The gradient of ``dims``-d adaptive average pooling with respect to its input,
    ``grad`` that of its output: each output's gradient divided by its window's size and
    spread over the window, as matrix products (deterministic where the native kernel adds
    atomically)."""
    torch = _torch()
    mats, sizes = zip(*(_window_matrix(inp.shape[-dims + d], grad.shape[-dims + d], grad)
                        for d in range(dims)))
    area = sizes[0]
    for size in sizes[1:]:  # each output's window size, (out_1, ..., out_dims)
        area = area[..., None] * size
    outs, ins = "abc"[:dims], "ijk"[:dims]  # "...ab,ai,bj->...ij" in 2-d
    spec = f"...{outs}," + ",".join(o + i for o, i in zip(outs, ins)) + f"->...{ins}"
    out = torch.einsum(spec, grad / area, *mats)
    last = torch.channels_last if dims == 2 else torch.channels_last_3d
    if inp.dim() == dims + 2 and not inp.is_contiguous() and inp.is_contiguous(
            memory_format=last):
        return out.contiguous(memory_format=last)
    return out.contiguous()


def _pool2d_backward(grad: Any, inp: Any) -> Any:
    return _adaptive_pool_backward(grad, inp, 2)


def _pool3d_backward(grad: Any, inp: Any) -> Any:
    return _adaptive_pool_backward(grad, inp, 3)


_KERNELS = {"_adaptive_avg_pool2d_backward": _pool2d_backward,
            "_adaptive_avg_pool3d_backward": _pool3d_backward}
_override_lock = threading.Lock()
_overrides: dict[str, list] = {}  # dispatch key -> [its library, blocks inside]


@contextlib.contextmanager
def _deterministic_kernels(key: str = "CUDA") -> Iterator[None]:
    """Our deterministic kernels (:data:`_KERNELS`) replace PyTorch's for ``key`` while the
    block runs (nested blocks share one registration); PyTorch's are back after it."""
    torch = _torch()
    with _override_lock:
        entry = _overrides.get(key)
        if entry is None:
            lib = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():  # "Overriding a previously registered kernel"
                warnings.simplefilter("ignore")
                for name, kernel in _KERNELS.items():
                    lib.impl(name, kernel, key)
            entry = _overrides[key] = [lib, 0]
        entry[1] += 1
    try:
        yield
    finally:
        with _override_lock:
            entry[1] -= 1
            if entry[1] == 0:
                del _overrides[key]
                entry[0]._destroy()


@contextlib.contextmanager
def deterministic(on: bool = True) -> Iterator[None]:
    """Run the block in deterministic mode when ``on`` (see the module docstring), then put
    the previous settings back (also when the block raises); ``on=False`` changes nothing.
    The settings are process-wide: threads started by the block run with them too."""
    if not check(on):
        yield
        return
    torch = _torch()
    _ensure_workspace(torch)
    before = _state(torch)
    _set(torch, {"algorithms": True, "warn_only": False, "cudnn_deterministic": True,
                 "cudnn_benchmark": False,
                 "precision": ["ieee" if attr == "fp32_precision" else False
                               for _, attr in _precision_flags(torch)]})
    try:
        if torch.cuda.is_available():
            with _deterministic_kernels("CUDA"):
                yield
        else:
            yield
    finally:
        _set(torch, before)


def settings() -> dict[str, float]:
    """This process's switches as numbers (1.0 on, 0.0 off), for metrics and tests:
    ``deterministic_algorithms``, ``cudnn_deterministic``, ``cudnn_benchmark``, ``tf32``
    (any TF32 switch on), ``cublas_workspace`` (the variable holds a reproducible value)."""
    torch = _torch()
    tf32 = any(_tf32(getattr(obj, attr)) for obj, attr in _precision_flags(torch))
    return {"deterministic_algorithms": float(torch.are_deterministic_algorithms_enabled()),
            "cudnn_deterministic": float(torch.backends.cudnn.deterministic),
            "cudnn_benchmark": float(torch.backends.cudnn.benchmark),
            "tf32": float(tf32),
            "cublas_workspace": float(os.environ.get(_ENV) in _REPRODUCIBLE_WORKSPACES)}


def enabled() -> bool:
    """Whether this process runs in deterministic mode now (every switch as
    :func:`deterministic` sets it): what a process started from here must run with."""
    s = settings()
    return (s["deterministic_algorithms"] == 1.0 and s["cudnn_deterministic"] == 1.0
            and s["cudnn_benchmark"] == 0.0 and s["tf32"] == 0.0)


class _Carried:
    """``fn`` run in another process in the deterministic mode of the process that made
    this (picklable when ``fn`` is)."""

    def __init__(self, fn: Callable[..., Any], on: bool):
        self.fn, self.on = fn, on

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with deterministic(self.on):
            return self.fn(*args, **kwargs)


def carry(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` wrapped to run with this process's deterministic mode wherever it is called:
    what a process hands to the processes it starts (ranks, actors).

    Example::

        with deterministic(True):
            spawn(carry(body), 2)     # both ranks run body deterministically
    """
    return _Carried(fn, enabled())
