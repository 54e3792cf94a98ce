"""The examples of docs/engine.md's "When a trial fails" and "Names and arguments" run and
print what the docs say."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _blocks():
    text = (ROOT / "docs" / "engine.md").read_text()
    return [b for b in re.findall(r"```python\n(.*?)```", text, re.S)
            if "rt.SearchFailed" in b or "registry.strategy_names()" in b]


def test_the_engine_docs_examples_run(tmp_path):
    failing, names = _blocks()
    script = tmp_path / "boom.py"  # a file: workers import its space
    script.write_text(failing)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "all 2 models failed, nothing was trained; most common reason (2 of 2): " \
           "ZeroDivisionError: the training step divided by zero" in out.stdout
    out = subprocess.run([sys.executable, "-c", names], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "did you mean 'evolution'?" in out.stdout and "'evolution'" in out.stdout
