"""A user's script that starts a search at import time, without ``if __name__ == "__main__":``.

Each worker process imports the script again (forkserver and spawn do), so every worker fails
at start; the search must stop saying so and naming the fix, not only "check that retiarii
imports" (found by writing a search in a script the way a new user does)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))


def test_a_script_without_the_main_guard_is_told_the_fix(tmp_path):
    script = tmp_path / "my_search.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {HERE!r})
        import retiarii as rt
        from exp_space import mlp_space
        trainer = rt.Trainer(dataset="digits", epochs=1, batch_size=128)
        rt.Experiment(mlp_space, rt.strategies.Random(seed=0), trainer,
                      store={str(tmp_path / "s.db")!r}, workers=1, max_models=1).run()
    """))
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "failed to start 3 times" in last
    assert 'my_search.py starts the search under `if __name__ == "__main__":`' in last
