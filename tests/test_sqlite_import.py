"""The store opens without importing pandas (a search's fixed cost), and pandas still works."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, check=True, timeout=300)
    return done.stdout.strip()


def test_store_opens_without_pandas_and_pandas_imports_after(tmp_path):
    out = _run(f"""
import sys
from retiarii.engine.storage.store import Store
store = Store({str(tmp_path / 'a.db')!r})
store.close()
print('pandas' in sys.modules, sys.modules['sqlite_utils.db'].pd is None)
import pandas
print(pandas.DataFrame({{'x': [1, 2]}}).x.sum())
""")
    assert out.splitlines() == ["False True", "3"]


def test_pandas_imported_first_is_sqlite_utils_own(tmp_path):
    out = _run(f"""
import sys, pandas
from retiarii.engine.storage.store import Store
Store({str(tmp_path / 'b.db')!r}).close()
print(sys.modules['sqlite_utils.db'].pd is pandas)
""")
    assert out == "True"
