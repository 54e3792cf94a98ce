"""Imports sqlite_utils for the store without the pandas import it would start (a fixed cost).

sqlite_utils imports pandas when it can, only to map ``pandas.Timestamp`` columns to TEXT:
about 0.7 s of CPU on a quiet 2-core machine (2 s loaded), paid by every ``run()`` when the
store opens, and by every ``retiarii`` command that reads a store. The store never writes a
pandas object, so it imports sqlite_utils with pandas hidden, unless pandas is imported
already (then sqlite_utils takes it, as it would anyway). A program that imports pandas later
gets the real pandas: only sqlite_utils's own ``pd`` stays None.

Example::

    sqlite_utils = import_sqlite_utils()
    db = sqlite_utils.Database("runs/exp.db")
"""
from __future__ import annotations

import sys
import threading
from types import ModuleType

__all__ = ["import_sqlite_utils"]

_LOCK = threading.Lock()


def import_sqlite_utils() -> ModuleType:
    """The sqlite_utils module, imported without pandas when pandas is not imported yet."""
    module = sys.modules.get("sqlite_utils")
    if module is not None:
        return module
    with _LOCK:
        hidden = "pandas" not in sys.modules
        if hidden:
            sys.modules["pandas"] = None  # type: ignore[assignment]  # import pandas: ImportError
        try:
            import sqlite_utils
        finally:
            if hidden and sys.modules.get("pandas", 0) is None:
                del sys.modules["pandas"]
    return sqlite_utils
