"""How a worker process finds the objects a job names: references made and checked now, the
way a worker will resolve them.

A worker never receives a pickled space or trainer: it gets an import reference
(``"pkg.mod:name"`` or ``"/abs/file.py:name"``) and resolves it. :func:`object_ref` makes that
reference on the driver and refuses one a worker would resolve to something else (a name bound
only under a script's ``if __name__ == "__main__":``), naming the object and the fix.
"""
from __future__ import annotations

import os
from typing import Any

from ...refs import SCRIPT_MODULES, EncodeError, load_file_module, ref_of, resolve_ref, split_ref
from ..errors import ExperimentError

__all__ = ["object_ref"]


def object_ref(obj: Any, what: str) -> str:
    """The reference (``"pkg.mod:name"``, or ``"/abs/file.py:name"`` for a script's object) by
    which a worker process finds ``obj``, checked now the way a worker will resolve it.

    ``obj`` may be the reference itself. Raises :class:`ExperimentError` naming the object and
    the fix when workers could not find it (not at module level, or bound only under the
    script's ``if __name__ == "__main__":``).
    """
    if isinstance(obj, str):
        ref = obj
        try:
            obj = resolve_ref(ref)
        except (ImportError, ValueError) as e:
            raise ExperimentError(f"the {what} reference {ref!r} does not resolve: {e}") from None
    else:
        try:
            ref = ref_of(obj)
        except EncodeError:
            raise ExperimentError(
                f"the {what} is not a module-level variable of an importable module or script, "
                f"so worker processes cannot rebuild it. Define it at module level (e.g. `space "
                f"= ModelSpace(...)` in myspace.py) or pass its reference as a string "
                f"('/abs/path/myspace.py:space')") from None
    _check_workers_see(ref, obj, what)
    return ref


def _check_workers_see(ref: str, obj: Any, what: str) -> None:
    """Refuse now a reference a new worker process would not resolve to the same object.

    A worker loads a script as a module, where its ``if __name__ == "__main__":`` block does
    not run; so a name bound (or rebound) there is not what the worker finds. Only the running
    script is in doubt: importable modules and files loaded as modules resolve in a worker as
    they do here.
    """
    where, attr, is_file = split_ref(ref)
    if not is_file or load_file_module(where).__name__ not in SCRIPT_MODULES:
        return
    fix = (f"Bind it at module level of {os.path.basename(where)}, outside the "
           f"`if __name__ == \"__main__\":` block (or in a module the script imports); "
           f"worker processes load the script as a module, where that block does not run")
    try:
        seen = resolve_ref(ref, fresh=True)
    except ImportError as e:
        raise ExperimentError(f"the {what} is `{attr}` of the script {where}, which worker "
                              f"processes cannot see: {e}. {fix}") from None
    except Exception as e:  # noqa: BLE001 (the script fails when loaded as a module)
        raise ExperimentError(f"the {what} is `{attr}` of the script {where}, but loading the "
                              f"script as worker processes do fails ({type(e).__name__}: {e}). "
                              f"{fix}") from None
    if type(seen).__qualname__ != type(obj).__qualname__:
        raise ExperimentError(f"the {what} is `{attr}` of the script {where}, which worker "
                              f"processes see as a {type(seen).__name__}, not this "
                              f"{type(obj).__name__} (is it rebound under `if __name__ == "
                              f"\"__main__\":`?). {fix}")
