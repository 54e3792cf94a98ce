"""Docs are tested: every CLI command and flag is documented; the README's examples run."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from retiarii.cli import parser

ROOT = Path(__file__).resolve().parents[1]


def _commands():
    sub = next(a for a in parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_cli_command_and_flag_is_documented(name):
    doc = (ROOT / "docs" / "cli.md").read_text()
    assert f"## `retiarii {name}`" in doc, f"docs/cli.md has no section for `retiarii {name}`"
    section = doc.split(f"## `retiarii {name}`", 1)[1].split("\n## ", 1)[0]
    for action in _commands()[name]._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                assert f"`{flag}`" in section, f"`retiarii {name} {flag}` is not in docs/cli.md"


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_cli_command_has_help(name):
    out = subprocess.run([sys.executable, "-m", "retiarii.cli", name, "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage: retiarii " + name in out.stdout


def test_readme_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["./dev demo", "./dev test"]
    assert "./dev test" in (ROOT / ".ci" / "run").read_text()


def test_readme_python_examples_run(tmp_path):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "the README has no Python example"
    space_example = blocks[0]
    out = subprocess.run([sys.executable, "-c", space_example], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "class Inception(nn.Module)" in out.stdout


def test_spaces_md_shows_every_inline_choice_in_code_that_runs():
    """docs/spaces.md has an example of each inline choice (its blocks run in
    tests/test_mutators.py) and says when to use mutators and when inline choices."""
    import retiarii.nn

    text = (ROOT / "docs" / "spaces.md").read_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
    shown = [f"rt.{name}(" for name in retiarii.nn.__all__] + [
        "rt.nn.Conv2d(", "width * 2", "distinct=False", ".base_model()", ".default_sample()",
        'initial="base"']
    missing = [s for s in shown if s not in code]
    assert not missing, f"docs/spaces.md has no runnable example of {missing}"
    assert "### Mutators or inline choices?" in text
