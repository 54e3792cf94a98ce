"""References: how one process names a Python object so that another process finds it.

The IR, trial specs and the store never pickle; wherever they need a class, a function, a
space or a trainer they hold a *reference*, a string in one of two forms::

    "package.module:Qual.name"        the module is imported by name
    "/abs/path/file.py:Qual.name"     the file is loaded as a module of its own, in which its
                                      ``if __name__ == "__main__":`` block does not run

:func:`ref_of` is the one producer and :func:`resolve_ref` the one resolver; everything that
names an object (codec, trace, mutators, the experiment, workers, the CLI) goes through them.
Objects of a script (``__main__``, or a file the CLI loaded) are named by the file's absolute
path, never by a module name that only the current process knows, so a reference made by the
driver resolves in a worker and in a later ``retiarii export``.

Example::

    >>> ref_of(torch.nn.Conv2d)
    'torch.nn.modules.conv:Conv2d'
    >>> resolve_ref("torch.nn.modules.conv:Conv2d") is torch.nn.Conv2d
    True

Code read back from a store is code: :class:`TrustedRefs` is the rule that decides which
references a stored graph may name (torch, operator, math, retiarii's own layers and the
user's own space), enforced by :func:`only_trusted` around decoding and exporting.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Any, Iterator

# Module names under which a script's objects live in this process only: the running script
# (``__mp_main__`` in spawned workers) and files loaded by :func:`load_file_module`.
SCRIPT_MODULES = ("__main__", "__mp_main__")
FILE_MODULE_PREFIX = "_retiarii_ref_"

# Namespaces searched, in order, for a callable that does not resolve from its own
# __module__/__qualname__ (C functions such as torch._C._nn.linear report odd modules).
_NAMESPACES = ("torch", "torch.nn.functional", "operator", "math", "builtins", "torch.Tensor")


class EncodeError(TypeError):
    """A value that cannot be stored in the IR as JSON (here: an object with no reference)."""


class RefError(ImportError):
    """A reference that does not resolve, or that the active trust rule refuses."""


# ---- files loaded as modules ---------------------------------------------------------------


def file_module_name(path: str) -> str:
    """The module name a file is loaded under: one per path, so two files with the same name
    do not collide and a second reference to the file reuses the loaded module."""
    return FILE_MODULE_PREFIX + hashlib.sha1(path.encode()).hexdigest()[:12]


_FRESH_LOADING: set[str] = set()  # files being loaded fresh (a file that loads itself: refuse)
# Folders holding a copy of the driver's space folder (a Ray node's unpacked working_dir):
# a file path of the driver that does not exist here is looked up in them by its name.
_SHIPPED: list[str] = []


def add_shipped_folder(folder: str) -> None:
    """Declare ``folder`` a copy of the folder of the driver's space file (Ray ships it as
    the job's ``working_dir``): a file reference whose path does not exist on this machine
    loads the file of the same name there."""
    folder = os.path.abspath(folder)
    if folder not in _SHIPPED:
        _SHIPPED.append(folder)


def _located(path: str) -> str:
    """``path``, or its copy in a shipped folder when ``path`` does not exist here."""
    if os.path.isfile(path):
        return path
    for folder in _SHIPPED:
        copy = os.path.join(folder, os.path.basename(path))
        if os.path.isfile(copy):
            return copy
    return path


def _importable_folder(path: str) -> None:
    """Make the file's folder importable, as ``python path`` does (``sys.path[0]``): a space
    file's ``from mut_space import space`` finds its sibling in the driver and every worker."""
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)


def _script_file(module) -> str | None:
    path = getattr(module, "__file__", None)
    return os.path.abspath(path) if path else None


def load_file_module(path: str, fresh: bool = False):
    """The module of the Python file ``path`` (absolute) in this process.

    The running script, when it is that file, is that module; otherwise the file is loaded once
    as a module of its own (its ``if __name__ == "__main__":`` block does not run). With
    ``fresh``, the file is loaded anew and not kept: what a new worker process would see.
    """
    name = file_module_name(path)
    if not fresh:
        if name + "_fresh" in sys.modules:  # the file is being loaded fresh: it names itself
            return sys.modules[name + "_fresh"]
        for script in SCRIPT_MODULES:
            module = sys.modules.get(script)
            if module is not None and _script_file(module) == path:
                return module
        if name in sys.modules:
            return sys.modules[name]
    path = _located(path)
    if not os.path.isfile(path):
        raise RefError(f"import reference names file {path}, which does not exist")
    _importable_folder(path)
    if fresh:
        if path in _FRESH_LOADING:
            raise RefError(f"{path} loads itself again while it is loaded as a module: does "
                           f"it create an Experiment outside `if __name__ == \"__main__\":`?")
        _FRESH_LOADING.add(path)
        name += "_fresh"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # during execution too: dataclasses and pickle look it up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        if fresh:
            _FRESH_LOADING.discard(path)
    if fresh:
        del sys.modules[name]
    return module


# ---- resolving -----------------------------------------------------------------------------


def split_ref(ref: str) -> tuple[str, str, bool]:
    """``(where, attr, is_file)`` of a reference; raises ValueError for a malformed one."""
    if not isinstance(ref, str) or ":" not in ref.lstrip("/"):
        raise ValueError(f"import reference {ref!r} must look like 'package.module:attr' or "
                         "'/abs/path/file.py:attr'")
    where, _, attr = ref.rpartition(":")  # rpartition: a Windows path has a colon of its own
    if not where or not attr or not all(part.isidentifier() for part in attr.split(".")):
        raise ValueError(f"import reference {ref!r}: expected 'module:Qual.name', with a "
                         f"dotted Python name after the colon")
    is_file = where.endswith(".py") or os.sep in where or "/" in where
    if is_file and not os.path.isabs(where):
        raise ValueError(f"import reference {ref!r}: a file path must be absolute, since "
                         "workers may run in another directory")
    return where, attr, is_file


def resolve_ref(ref: str, fresh: bool = False) -> Any:
    """The object an import reference names.

    Example::

        resolve_ref("retiarii.engine.trainers.trainer:ClassifierTrainer")
        resolve_ref("/home/me/project/spaces.py:SPACE")

    Args:
        ref: ``"package.module:attr"`` or ``"/absolute/path/file.py:attr"``; ``attr`` may be
            dotted (``"module:Class.attribute"``).
        fresh: resolve a file reference as a new worker process would, in a fresh load of
            the file (not the running script, whose ``__main__`` block has run).

    Raises :class:`RefError` (an ImportError) when it does not resolve or when the active trust
    rule (:func:`only_trusted`) refuses it, ValueError when it is malformed.
    """
    where, attr, is_file = split_ref(ref)
    rule = _RULE.get()
    if rule is not None:
        rule.check(ref)
    if is_file:
        obj = load_file_module(where, fresh=fresh)
    else:
        try:
            obj = importlib.import_module(where)
        except ImportError as e:
            raise RefError(f"import reference {ref!r}: cannot import {where} ({e})") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RefError(f"import reference {ref!r}: {where} has no attribute "
                           f"{attr!r}") from None
    return obj


# ---- producing -----------------------------------------------------------------------------


def _module_ref(name: str | None) -> str | None:
    """What stands for module ``name`` before the colon: its name, or its file for a script."""
    if not name:
        return None
    if name in SCRIPT_MODULES or name.startswith(FILE_MODULE_PREFIX):
        return _script_file(sys.modules.get(name))
    return name


def _variable_refs(obj: Any) -> Iterator[str]:
    """References to module-level variables bound to ``obj``: the module that made it first
    (a ModelSpace remembers it in ``defined_in``), then importable modules, then scripts."""
    home = getattr(obj, "defined_in", None)
    modules = list(sys.modules.items())
    order = ([(n, m) for n, m in modules if n == home]
             + [(n, m) for n, m in modules if n != home and _module_ref(n) == n]
             + [(n, m) for n, m in modules if n != home and _module_ref(n) != n])
    seen = set()
    for name, module in order:
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        where = _module_ref(name)
        if where is None:
            continue
        for attr, value in list(getattr(module, "__dict__", {}).items()):
            if value is obj and attr.isidentifier():
                yield f"{where}:{attr}"


def ref_of(obj: Any) -> str:
    """The import reference of ``obj``; it resolves back to ``obj`` (``is``).

    Classes and functions are named where they are defined (``__module__:__qualname__``);
    other objects (a space, a trainer) by a module-level variable bound to them, preferring the
    module that made them and importable modules over scripts. Raises :class:`EncodeError`
    when there is none (a lambda, a class made inside a function, a variable of a notebook).
    """
    candidates = []
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    where = _module_ref(getattr(obj, "__module__", None)) if qualname else None
    if where and isinstance(qualname, str) and "<locals>" not in qualname:
        candidates.append(f"{where}:{qualname}")
    name = getattr(obj, "__name__", None)
    if isinstance(name, str):
        candidates += [f"torch:Tensor.{name}" if ns == "torch.Tensor" else f"{ns}:{name}"
                       for ns in _NAMESPACES]
    checked = set()
    for ref in candidates:
        try:
            if resolve_ref(ref) is obj:
                return ref
        except (ImportError, ValueError):
            continue
        checked.add(ref)
    if qualname is None:  # an instance: named by a variable that holds it
        for ref in _variable_refs(obj):
            if ref not in checked:
                return ref
    raise EncodeError(
        f"{obj!r} cannot be referenced by an import path; define it at module level of a file "
        f"(not inside a function, not as a lambda, not in a notebook) so other processes can "
        f"import it")


# ---- trust: what a reference read from a store may name ------------------------------------

# Standard namespaces whose callables compute on values and touch nothing else. Everything
# that reaches files, processes, imports or arbitrary attributes (builtins' eval/open,
# operator's attrgetter/methodcaller/call, torch's load/save/hub/jit/utils/ops...) is out.
_SAFE_BUILTINS = frozenset({
    "abs", "all", "any", "bool", "complex", "dict", "divmod", "enumerate", "float", "getattr",
    "int", "isinstance", "len", "list", "max", "min", "pow", "range", "reversed", "round",
    "slice", "sorted", "sum", "tuple", "zip"})
_UNSAFE_OPERATOR = frozenset({"attrgetter", "itemgetter", "methodcaller", "call"})
_UNSAFE_TORCH = frozenset({
    "load", "save", "from_file", "compile", "hub", "jit", "package", "utils", "ops", "library",
    "classes", "export", "onnx", "distributed", "multiprocessing", "cuda", "backends",
    "serialization", "storage", "UntypedStorage", "TypedStorage", "set_default_device",
    "_dynamo", "_inductor", "_C", "_ops", "_classes", "fx", "autograd"})
_TORCH_C_OPS = frozenset({"_nn", "_fft", "_linalg", "_special", "_VariableFunctions"})
# retiarii's own modules that generated code may name (layers and merges, never the engine).
_RETIARII_OK = ("retiarii.ops", "retiarii.nn", "retiarii.choices")


def _under(path: str, folder: str) -> bool:
    return os.path.commonpath([os.path.abspath(path), folder]) == folder


class TrustedRefs:
    """The references that code read from a store may name.

    A store is code: its graphs name classes and functions that ``export`` imports and calls.
    What they may name is torch (but not what reads or writes files or runs code: ``load``,
    ``save``, ``hub``, ``jit``, ``utils``, ...), ``operator`` and ``math`` (computations only),
    a few pure builtins, retiarii's own layers, and the user's own space: the space file and the
    files of its folder, or the package of a space given as ``"pkg.module:space"``. Anything
    else is refused with a :class:`RefError` that says so.

    Example::

        rule = TrustedRefs("/home/me/proj/myspace.py:space")
        rule.check("/home/me/proj/myspace.py:Block")    # fine
        rule.check("posix:system")                      # RefError
    """

    def __init__(self, space_ref: str | None):
        self.folder: str | None = None
        self.package: str | None = None
        if space_ref:
            where, _, is_file = split_ref(space_ref)
            if is_file:
                self.folder = os.path.dirname(os.path.abspath(where))
            else:  # the space's package (retiarii's own demo: that module alone)
                self.package = where if where.startswith("retiarii.") else where.split(".")[0]
        # `retiarii nas run` searches retiarii.nas:SPACES.<row>.<preset>, spaces built from the
        # model_spaces package: their graphs name its classes
        self.also = ("model_spaces",) if self.package == "retiarii.nas" else ()

    def user_module(self, module: str) -> bool:
        """True when the importable module ``module`` belongs to the user's space. Decided
        without running any code of it (only the top-level package is located)."""
        top = module.split(".")[0]
        if self.package is not None:
            return any(module == p or module.startswith(p + ".")
                       for p in (self.package, *self.also))
        if self.folder is None:
            return False
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            return False
        origin = getattr(spec, "origin", None) if spec is not None else None
        locations = [origin] if origin and origin not in ("built-in", "frozen") else []
        locations += list(getattr(spec, "submodule_search_locations", None) or [])
        return bool(locations) and all(_under(p, self.folder) for p in locations)

    def refusal(self, ref: str) -> str | None:
        """Why ``ref`` is refused, or None when it is trusted."""
        where, attr, is_file = split_ref(ref)
        first = attr.split(".")[0]
        if any(part.startswith("__") for part in attr.split(".")):
            return "it names a private (dunder) attribute"
        if is_file:
            if self.folder is not None and _under(where, self.folder):
                return None
            return "it names a file outside the space's folder"
        top, *rest = where.split(".")
        if top == "torch":
            parts = rest + attr.split(".")
            if parts[:1] == ["_C"] and len(rest) == 2 and rest[1] in _TORCH_C_OPS:
                parts = parts[2:]  # torch's C operators (torch._C._nn:linear is F.linear)
            if any(p in _UNSAFE_TORCH for p in parts):
                return "it names a torch facility that reads or writes files or runs code"
            return None
        if where in ("operator", "_operator"):
            return None if first not in _UNSAFE_OPERATOR else "it can reach any attribute"
        if where == "math":
            return None
        if where == "builtins":
            return None if attr in _SAFE_BUILTINS else "builtins other than pure functions " \
                                                       "are not allowed"
        if any(where == ok or where.startswith(ok + ".") for ok in _RETIARII_OK):
            return None
        if self.user_module(where):
            return None
        return ("generated code may only name torch, operator, math and the classes the "
                "space's own file or package defines")

    def check(self, ref: str) -> None:
        why = self.refusal(ref)
        if why is not None:
            raise RefError(f"refusing reference {ref!r} read from a store: {why}. A store is "
                           f"code; only open stores you trust (see docs/store.md)")

    def check_attribute(self, name: Any, where: str) -> None:
        """A method or attribute name a stored graph calls or reads: no dunders."""
        if not isinstance(name, str) or name.startswith("__"):
            raise RefError(f"refusing {where} {name!r} read from a store: generated code may "
                           f"not reach private (dunder) attributes")


_RULE: contextvars.ContextVar[TrustedRefs | None] = contextvars.ContextVar("retiarii_refs_rule",
                                                                           default=None)


@contextlib.contextmanager
def only_trusted(rule: TrustedRefs) -> Iterator[TrustedRefs]:
    """Within the block, :func:`resolve_ref` refuses what ``rule`` does not trust."""
    token = _RULE.set(rule)
    try:
        yield rule
    finally:
        _RULE.reset(token)


def active_rule() -> TrustedRefs | None:
    """The rule :func:`only_trusted` set, if any."""
    return _RULE.get()


__all__ = ["EncodeError", "RefError", "TrustedRefs", "active_rule", "file_module_name",
           "load_file_module", "only_trusted", "ref_of", "resolve_ref", "split_ref",
           "SCRIPT_MODULES", "FILE_MODULE_PREFIX"]
