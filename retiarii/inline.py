"""The source of the user's own classes and functions, written into an exported model file.

An exported model (``codegen.to_source``) should run where only torch is installed. Its
``@rt.leaf`` modules are the user's own classes, usually in the space file; instead of
importing that file (which builds the whole space, needs retiarii, and may not exist on the
machine the model goes to), the export copies their source in, with what it needs::

    # the space file                      # the exported file
    import retiarii as rt                 import torch
    from torch import nn                  import torch.nn as nn
    WIDTH = 32                            from torch import nn   (what Block's code names)
                                          WIDTH = 32
    @rt.leaf                              class Block(nn.Module):
    class Block(nn.Module):                   ...
        ...                               class Model1(nn.Module): ...  # uses Block(32)

What a copied class or function names at module level is written out too: torch, ``math`` and
``operator`` (and their members) as imports, other classes and functions of the user's file
(copied in turn), and constants (numbers, strings, tuples of them). retiarii's decorators are
dropped (``@rt.leaf`` only records constructor arguments for the search). Anything else
(another library, a retiarii object used in the code, a tensor) makes :class:`Inliner` give
up on that object with :class:`InlineError`, and the export imports it instead (saying so in
its header). A few of retiarii's own layers that users put into models (``FrozenBatchNorm``,
from ``rt.freeze``) are copied the same way.
"""
from __future__ import annotations

import ast
import inspect
import symtable
import sys
import textwrap
import types
from typing import Any

from .refs import FILE_MODULE_PREFIX, SCRIPT_MODULES, active_rule

_STANDARD = ("torch", "math", "operator", "_operator")

# retiarii's own layers that a traced model may hold (rt.freeze puts FrozenBatchNorm into a
# user's backbone): their source is copied into an export like the user's own, so the
# exported file still needs only torch. Each is written to need nothing but torch.
_LIBRARY_LAYERS = {("retiarii.frozen", "FrozenBatchNorm")}


class InlineError(ValueError):
    """An object whose source cannot be copied into an exported file on its own."""


def _standard(module_name: str) -> bool:
    return module_name.split(".")[0] in _STANDARD


def _retiarii(module_name: str) -> bool:
    return module_name == "retiarii" or module_name.startswith("retiarii.")


def is_user_module(module_name: str) -> bool:
    """True for the user's own code: a script, a file loaded as a module, or (while a store's
    trust rule is active) a module of the space's package."""
    if module_name in SCRIPT_MODULES or module_name.startswith(FILE_MODULE_PREFIX):
        return True
    rule = active_rule()
    return rule is not None and rule.user_module(module_name)


def _global_names(source: str) -> set[str]:
    """Names the code reads from its module's globals (builtins included)."""
    names: set[str] = set()

    def walk(table) -> None:
        for symbol in table.get_symbols():
            if symbol.is_referenced() and (symbol.is_global() or table.get_type() == "module"):
                names.add(symbol.get_name())
        for child in table.get_children():
            walk(child)

    walk(symtable.symtable(source, "<inlined>", "exec"))
    return names


def _lookup(module: types.ModuleType, expr: ast.expr) -> Any:
    """The object a dotted name (``rt.leaf``) denotes in ``module``, or None."""
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    obj = module.__dict__.get(expr.id)
    for part in reversed(parts):
        obj = getattr(obj, part, None)
    return obj


def _import_line(name: str, value: Any) -> str | None:
    """How the exported file binds ``name`` to a standard module or one of its members."""
    if isinstance(value, types.ModuleType):
        full = value.__name__
        if not _standard(full):
            return None
        if full == name:
            return f"import {full}"
        parent, _, last = full.rpartition(".")
        return f"from {parent} import {last}" if parent and last == name else \
            f"import {full} as {name}"
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if not module or not qualname or not _standard(module) or "." in qualname:
        return None
    # C functions report odd modules (torch._C._nn): import through the reference that resolves
    from .refs import ref_of

    where, _, attr = ref_of(value).rpartition(":")
    if "." in attr:
        return None
    return f"from {where} import {attr}" + ("" if attr == name else f" as {name}")


def _literal(value: Any) -> str | None:
    if isinstance(value, (bool, int, float, str, type(None), tuple)):
        text = repr(value)
        try:
            if ast.literal_eval(text) == value:
                return text
        except (ValueError, SyntaxError):
            return None
    return None


class Inliner:
    """Collects the source of user objects (and what they need) for one exported file.

    Example::

        inliner = Inliner()
        name = inliner.add(Block)        # "Block"; inliner.blocks holds its source
        header = inliner.imports         # {"from torch import nn"}

    ``add`` returns None for an object that is not the user's own code (torch, a library)
    and raises :class:`InlineError` when its source cannot be copied.
    """

    def __init__(self, given: dict[str, str] | None = None) -> None:
        """``given``: the names the file binds anyway (``{"nn": "module:torch.nn"}``)."""
        self.given = dict(given or {})
        self.imports: set[str] = set()
        self.blocks: list[str] = []  # in dependency order
        self._bound = dict(self.given)  # name in the file -> what it holds (a description)
        self._done: dict[int, str] = {}  # id(object) -> its name in the file
        self._busy: set[int] = set()

    def add(self, obj: Any) -> str | None:
        module_name = getattr(obj, "__module__", None)
        library = (module_name, getattr(obj, "__qualname__", None)) in _LIBRARY_LAYERS
        if not module_name or not (is_user_module(module_name) or library):
            return None
        if id(obj) in self._done:
            return self._done[id(obj)]
        # All or nothing: a failure leaves no half-copied dependencies behind.
        saved = (set(self.imports), list(self.blocks), dict(self._bound), dict(self._done))
        try:
            return self._add(obj)
        except InlineError:
            self.imports, self.blocks, self._bound, self._done = saved
            self._busy.clear()
            raise

    def bind(self, name: str, what: str) -> None:
        """Reserve ``name`` for ``what`` (a module ``"module:torch.nn"``, a reference, a
        constant); binding it to something else raises :class:`InlineError`."""
        if self._bound.get(name, what) != what:
            raise InlineError(f"the name {name!r} stands for two things in the exported file "
                              f"({self._bound[name]} and {what})")
        self._bound[name] = what

    def _add(self, obj: Any) -> str:
        if not isinstance(obj, (type, types.FunctionType)):
            raise InlineError(f"{obj!r} is neither a class nor a function")
        name, qualname = obj.__name__, obj.__qualname__
        if name != qualname:
            raise InlineError(f"{qualname} is not defined at module level")
        module = sys.modules.get(obj.__module__)
        if module is None:
            raise InlineError(f"the module of {qualname} is not loaded")
        if id(obj) in self._busy:  # a cycle (mutually recursive functions): bound below
            return name
        self._busy.add(id(obj))
        try:
            source = textwrap.dedent(inspect.getsource(obj))
        except (OSError, TypeError) as e:
            raise InlineError(f"the source of {qualname} is not available ({e})") from None
        tree = ast.parse(source)
        node = tree.body[0]
        # Drop retiarii's decorators (@rt.leaf records constructor arguments for the search).
        lines = source.splitlines()
        dropped: set[int] = set()
        for deco in node.decorator_list:
            target = _lookup(module, deco.func if isinstance(deco, ast.Call) else deco)
            if _retiarii(getattr(target, "__module__", "") or ""):
                dropped.update(range(deco.lineno - 1, deco.end_lineno))  # 0-based lines
        source = "\n".join(line for i, line in enumerate(lines) if i not in dropped) + "\n"
        for global_name in sorted(_global_names(source) - {name}):
            if global_name not in module.__dict__:
                continue  # a builtin
            self._dependency(global_name, module.__dict__[global_name], qualname)
        self.bind(name, f"{obj.__module__}:{qualname}")
        self.blocks.append(source)
        self._done[id(obj)] = name
        self._busy.discard(id(obj))
        return name

    def _dependency(self, name: str, value: Any, user: str) -> None:
        line = _import_line(name, value)
        if line is not None:
            what = (f"module:{value.__name__}" if isinstance(value, types.ModuleType)
                    else line.split()[1] + ":" + line.split()[3])
            self.bind(name, what)
            if name not in self.given:
                self.imports.add(line)
            return
        module_name = getattr(value, "__module__", None)
        if isinstance(value, (type, types.FunctionType)) and module_name \
                and is_user_module(module_name):
            if value.__name__ != name:
                raise InlineError(f"{user} names {value.__qualname__} as {name!r}")
            self._add(value)
            return
        literal = _literal(value)
        if literal is not None:
            if self._bound.get(name) != f"constant:{literal}":
                self.bind(name, f"constant:{literal}")
                self.blocks.append(f"{name} = {literal}\n")
            return
        origin = f" of {module_name}" if module_name else ""
        raise InlineError(f"{user} uses {name!r}, a {type(value).__name__}{origin} that an "
                          f"exported file cannot hold without importing it")


__all__ = ["InlineError", "Inliner", "is_user_module"]
