"""The examples of docs/engine.md's "When a trial fails" and "Names and arguments" run and
print what the docs say."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _blocks():
    text = (ROOT / "docs" / "engine.md").read_text()
    return [b for b in re.findall(r"```python\n(.*?)```", text, re.S)
            if "rt.SearchFailed" in b or "registry.strategy_names()" in b]


def _block(page: str, marker: str) -> str:
    """The one ```python block of docs/``page`` that holds ``marker``."""
    text = (ROOT / "docs" / page).read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if marker in b]
    return block


def _run_file(tmp_path, name: str, code: str) -> str:
    """Runs ``code`` as the script ``name`` (a file: workers import its space); its stdout."""
    script = tmp_path / name
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow  # worker processes train ten models (~45 s); tests/test_pbt_one_model.py is the quick check
def test_the_pbt_example_tunes_one_architectures_learning_rate(tmp_path):
    """docs/engine.md "Population-based training": runs with the default dedup and prints a
    lineage whose child names its initiator."""
    lines = _run_file(tmp_path, "pbt.py", _block("engine.md", "rt.strategies.PBT(")).splitlines()
    assert len(lines) == 2  # two generations: a root, then its child
    root, child = (line.split() for line in lines)
    assert root[1:5] == ["parent", "None", "initiator", "None"]
    assert child[2] == root[0] and child[4].startswith("pbt-")


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


def test_the_fixed_arch_example_builds_a_plain_module(tmp_path):
    """docs/weight_sharing.md "Retraining the selection"."""
    out = _run_file(tmp_path, "fixed.py", _block("weight_sharing.md", 'rt.fixed_arch(space, {"width": 32'))
    assert out.strip() == "GeneratedModel torch.Size([4, 10])"


def test_the_multi_objective_docs_example_runs(tmp_path):
    """docs/multi_objective.md: its Python example, then the CLI commands on its store."""
    text = (ROOT / "docs" / "multi_objective.md").read_text()
    script = tmp_path / "multi.py"
    script.write_text(re.findall(r"```python\n(.*?)```", text, re.S)[0])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "on the front:" in out.stdout and "True" in out.stdout
    commands = re.findall(r"```bash\n(.*?)```", text, re.S)[0].replace("\\\n", " ")
    for line in commands.splitlines()[1:]:  # the run: done above, from Python
        args = line.split("#")[0].split()[1:]
        out = subprocess.run([sys.executable, "-m", "retiarii.cli", *args], capture_output=True,
                             text=True, timeout=120, cwd=tmp_path)
        assert out.returncode == 0, (line, out.stderr[-2000:])
        if args[0] == "status":
            assert "Pareto front of val_acc (max), params (min)" in out.stdout
            assert "constraints: latency_ms <= 50" in out.stdout
    assert list((tmp_path / "front").glob("model_*.json")) and (tmp_path / "multi.png").exists()


def test_the_one_shot_export_example_reproduces_the_supernet(tmp_path):
    """docs/weight_sharing.md "Export": DARTS' exported weights in a plain module compute what
    the supernet computes for the selected architecture; the trainer says digits / 16."""
    out = _run_file(tmp_path, "export.py", _block("weight_sharing.md", "s.relaxation.fix(best)"))
    assert out.strip() == "True scikit-learn's 8x8 digits (sklearn.datas"
