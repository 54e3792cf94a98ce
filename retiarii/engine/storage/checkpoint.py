"""Checkpoints: everything the next training step reads, in one file.

A trial is trained in segments (see :mod:`retiarii.engine.jobs.job`); between two segments
it lives only in its checkpoint, which may be loaded by another worker process. The engine's
contract (docs/architecture.md, "Jobs and executors") is that a paused and resumed trial
follows exactly the trajectory of an uninterrupted one, so a checkpoint holds:

- the model weights, the optimizer state and the LR scheduler position;
- the python, numpy and torch (CPU and CUDA) RNG states;
- the step counter and the data position (epoch and batch index: the data order of an epoch is a
  function of the seed and the epoch, so no data loader is pickled).

Files are written with :func:`torch.save` to a temporary name and renamed into place, so a
crash never leaves half a checkpoint behind (a killed process may leave its ``.tmp-PID`` file,
which :meth:`CheckpointDir.remove_temporaries` clears at resume); they are read with
``torch.load(weights_only=True)``, which unpickles nothing but tensors and plain containers.
That is why the RNG states are stored
as tensors and lists rather than as the tuples the RNG modules hand out, and why :func:`save`
checks the whole state up front: an object that ``weights_only`` cannot read back fails at save
time, naming where it sits, instead of at resume time.
"""
from __future__ import annotations

import collections
import logging
import os
import re
from typing import Any, Callable

import torch

from ... import rng as _rng
from ...rng import (NativeRng, capture_rng, native_from_portable, native_rng,  # noqa: F401
                   portable_rng, seed_rng)

FORMAT = "retiarii-checkpoint"
VERSION = 1

__all__ = ["CheckpointError", "CheckpointPathError", "CheckpointDir", "save", "load", "capture_rng",
           "restore_rng", "seed_rng", "native_rng", "set_native_rng", "portable_rng", "native_from_portable"]


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt, not ours, or holds something unloadable."""


class CheckpointPathError(CheckpointError, ValueError):
    """A checkpoint name (or trial id) that would reach outside the run's checkpoint folder."""


_log = logging.getLogger("retiarii.engine")
_TEMPORARY = re.compile(r"\.tmp-\d+$")  # what save() writes before its rename


class CheckpointDir:
    """A run's checkpoint folder: the only place the run reads, writes or deletes checkpoints.

    Checkpoints are known by their *name* relative to the folder (``e1-trial-0003/step-000002``),
    which is what the store records, so a run folder (the store and its ``.checkpoints``
    folder) can be moved or copied and resumed: the copy reads and deletes its own files. A name
    that is absolute, climbs out with ``..``, or resolves outside the folder through a symlink
    is refused with :class:`CheckpointPathError`; so is a trial id that is not one plain path
    component.

    Example::

        folder = CheckpointDir("runs/exp.checkpoints")
        name = folder.name_for("e1-trial-0003", 2)      # 'e1-trial-0003/step-000002'
        save(folder.path(name), state)
        folder.remove(name)

    Args:
        root: the folder (it need not exist yet).
    """

    def __init__(self, root: str | os.PathLike):
        self.root = os.path.abspath(os.fspath(root))

    def name_for(self, trial_id: str, step: int) -> str:
        """The name of ``trial_id``'s checkpoint after ``step`` steps."""
        check_trial_id(trial_id)
        return f"{trial_id}/step-{int(step):06d}"

    def path(self, name: str) -> str:
        """The file a checkpoint name stands for, refusing any that lies outside the folder."""
        if not isinstance(name, str) or not name or "\0" in name or os.path.isabs(name):
            raise CheckpointPathError(f"checkpoint {name!r} is not a name inside the run's "
                                      f"checkpoint folder {self.root}; refused")
        parts = name.split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise CheckpointPathError(f"checkpoint {name!r} climbs out of (or around in) the "
                                      f"run's checkpoint folder {self.root}; refused")
        path = os.path.join(self.root, *parts)
        root = os.path.realpath(self.root)
        if os.path.commonpath([root, os.path.realpath(path)]) != root:
            raise CheckpointPathError(f"checkpoint {name!r} resolves to "
                                      f"{os.path.realpath(path)} through a symlink, outside the "
                                      f"run's checkpoint folder {self.root}; refused")
        return path

    def name(self, path: str | os.PathLike) -> str:
        """The name of ``path``: a file inside the folder, or a name already; refuses others."""
        path = os.fspath(path)
        if os.path.isabs(path):
            if os.path.commonpath([self.root, os.path.normpath(path)]) != self.root:
                raise CheckpointPathError(f"checkpoint {path} is outside the run's checkpoint "
                                          f"folder {self.root}; refused")
            path = os.path.relpath(os.path.normpath(path), self.root).replace(os.sep, "/")
        self.path(path)  # validates (.., symlinks)
        return path

    def remove(self, name: str) -> bool:
        """Delete a checkpoint file; False when it was already gone. Refuses names outside the
        folder (:class:`CheckpointPathError`); other ``OSError`` s propagate."""
        try:
            os.remove(self.path(name))
        except FileNotFoundError:
            return False
        return True

    def remove_temporaries(self) -> list[str]:
        """Delete the ``.tmp-PID`` files killed writers left in the folder (never following a
        symlink out of it); returns the names removed."""
        removed = []
        for folder, dirs, files in os.walk(self.root):  # os.walk does not enter symlinked dirs
            for file in files:
                full = os.path.join(folder, file)
                if _TEMPORARY.search(file) and not os.path.islink(full):
                    try:
                        os.remove(full)
                    except FileNotFoundError:
                        continue
                    removed.append(os.path.relpath(full, self.root).replace(os.sep, "/"))
        if removed:
            _log.info("removed %d unfinished checkpoint file(s) left by killed workers in %s",
                      len(removed), self.root)
        return removed


def check_trial_id(trial_id: Any) -> None:
    """Raise :class:`CheckpointPathError` unless ``trial_id`` can name a folder of its own (one
    path component: no ``/``, no ``..``), so its checkpoints stay inside the run's folder."""
    if (not isinstance(trial_id, str) or trial_id in ("", ".", "..") or "/" in trial_id
            or os.sep in trial_id or "\0" in trial_id or (os.altsep and os.altsep in trial_id)):
        raise CheckpointPathError(f"trial id {trial_id!r} cannot name a checkpoint folder: use "
                                  "one path component, without '/' or '..'")


def legacy_name(path: str, root: str) -> str:
    """What an old store's absolute checkpoint path stands for in the folder ``root``.

    Stores written before checkpoints were recorded by name hold absolute paths of the folder
    the run had then (``/old/place/exp.checkpoints/e1-trial-0003/step-000002``). A path inside
    ``root`` becomes its name; one laid out as ``<...>.checkpoints/<trial>/<file>`` (a moved or
    copied run) becomes ``<trial>/<file>``, a file of *this* run; anything else is returned
    unchanged and refused where it is used.
    """
    if not isinstance(path, str) or not os.path.isabs(path):
        return path
    root, norm = os.path.abspath(root), os.path.normpath(path)
    if os.path.commonpath([root, norm]) == root:
        return os.path.relpath(norm, root).replace(os.sep, "/")
    folder, file = os.path.split(norm)
    runs, trial = os.path.split(folder)
    if runs.endswith(".checkpoints") and file and trial not in ("", ".", ".."):
        return f"{trial}/{file}"
    return path


# ---- RNG states as plain tensors (retiarii/rng.py) -------------------------------------------


def set_native_rng(state: NativeRng) -> None:
    """:func:`retiarii.rng.set_native_rng`, failing with :class:`CheckpointError`."""
    try:
        _rng.set_native_rng(state)
    except _rng.RngError as err:
        raise CheckpointError(str(err)) from None


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the RNG states captured by :func:`capture_rng` (a :class:`CheckpointError`
    when they cannot be)."""
    set_native_rng(native_from_portable(state))


# ---- save / load ----------------------------------------------------------------------------

# What torch.load(weights_only=True) reconstructs. Anything else in a state fails at load time.
_LEAVES = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.device,
           torch.Size)


def _check_loadable(obj: Any, where: str) -> None:
    if isinstance(obj, _LEAVES):
        return
    if isinstance(obj, (dict, collections.OrderedDict)):
        for key, value in obj.items():
            if not isinstance(key, (str, int, float, bool, type(None))):
                raise CheckpointError(f"{where} has a key of type {type(key).__name__}; "
                                      "weights_only loading only accepts plain keys")
            _check_loadable(value, f"{where}[{key!r}]")
        return
    if isinstance(obj, (list, tuple, set)):
        for i, value in enumerate(obj):
            _check_loadable(value, f"{where}[{i}]")
        return
    raise CheckpointError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which "
        "torch.load(weights_only=True) cannot read back; keep checkpoint state to tensors, "
        "numbers, strings and containers (an LR scheduler built on a lambda, for instance, "
        "needs a picklable callable object or a built-in schedule instead)"
    )


def map_leaves(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` (dicts, OrderedDicts, lists and tuples, nested) with ``leaf`` applied to every
    other value. A container none of whose values changed is returned as it is (no copy); a
    rebuilt state dict keeps its ``_metadata`` (the modules' versions, which
    ``load_state_dict`` reads)."""
    if type(obj) in (dict, collections.OrderedDict):
        items = {k: map_leaves(v, leaf) for k, v in obj.items()}
        if all(items[k] is v for k, v in obj.items()):
            return obj
        out = type(obj)(items)
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    if type(obj) in (list, tuple):
        items = [map_leaves(v, leaf) for v in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else type(obj)(items)
    return leaf(obj)


def _own_storage(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor) and \
            obj.untyped_storage().nbytes() > obj.numel() * obj.element_size():
        return obj.clone()
    return obj


def _compact(obj: Any) -> Any:
    """``obj`` with every tensor that views a larger storage cloned: torch.save writes a
    view's whole storage, and a fused model's weights (retiarii.optim.fusion) are views of
    the K models' stacked tensors; a trial's checkpoint holds its own values only."""
    return map_leaves(obj, _own_storage)


def save(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Write ``state`` atomically to ``path`` (a temporary file, then rename).

    A crash of the process at any moment leaves the previous file or the new one, never a torn
    one. There is no fsync (as the store's WAL with ``synchronous=NORMAL``): it costs more than
    a trivial trial's training, and only a power loss, not a crash, can then lose the newest
    checkpoint; an unreadable one is reported naming the file.

    Example::

        save("runs/ckpt/t1-3.pt", {"step": 3, "model": model.state_dict(), "rng": capture_rng()})

    Args:
        path: where the checkpoint goes; its directory is created when missing.
        state: a dict of tensors, numbers, strings and containers (checked before writing).
    """
    path = os.fspath(path)
    _check_loadable(state, "checkpoint state")
    state = _compact(state)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save({"format": FORMAT, "version": VERSION, "state": state}, f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(path: str | os.PathLike, map_location: str | torch.device | None = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by :func:`save` with ``torch.load(weights_only=True)``.

    Example::

        state = load("runs/ckpt/t1-3.pt"); model.load_state_dict(state["model"])

    Args:
        path: the checkpoint file.
        map_location: device the tensors land on (``"cpu"`` by default).

    Raises:
        CheckpointError: the file is missing, truncated or corrupt, or not a retiarii checkpoint;
            the message names the file.
        OSError: the file could not be read (permissions, an I/O error): the environment's
            failure, not the checkpoint's.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist; was it deleted, or written "
                              "on another machine's disk?")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except OSError:
        raise  # the disk's problem (permissions, I/O), not the file's: retried, never "corrupt"
    except Exception as err:  # zip errors, unpickling errors, EOF: all mean "unreadable"
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not a torch file ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); delete it and resume the trial "
            "from an earlier checkpoint"
        ) from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is a torch file but not a retiarii checkpoint")
    if payload.get("version", 0) > VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {payload['version']}, newer "
                              f"than this retiarii reads ({VERSION}); upgrade retiarii")
    return payload["state"]
