"""Screenshots of every dashboard page (docs/dashboard/*.png) from a real demo search.

Runs a short demo search into a temporary store (or reads ``--store``), serves the dashboard on
a free loopback port and saves one PNG per page with headless Chromium (Debian's ``chromium``,
driven by Playwright). Run: ``python tools/dashboard_screenshots.py [--store runs/demo.db]``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from retiarii.dashboard import Dashboard  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
# (file, path): one screenshot per page; the model page shows the best model
PAGES = [("experiments", "/"), ("overview", "/overview"), ("trials", "/trials"),
         ("trial", "/trial?id={trial}"), ("space", "/space"), ("model", "/model?id={model}"),
         ("engine", "/engine"), ("pareto", "/pareto"), ("compare", "/compare?a=1&b={last}")]


def demo_store(folder: str, models: int, epochs: int) -> str:
    store = os.path.join(folder, "demo.db")
    # two experiments, the compare page's two curves: the README's demo, then one of two
    # objectives (accuracy against parameter count) for the Pareto page
    for seed, extra in ((0, []), (1, ["--metric", "val_acc,params", "--mode", "max,min"])):
        subprocess.run([sys.executable, "-m", "retiarii.cli", "run", "demo", "--max-models",
                        str(models), "--epochs", str(epochs), "--store", store, "--seed",
                        str(seed), *extra], check=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    return store


def shoot(store: str, out: str, width: int = 1400) -> list[str]:
    import sqlite3

    from playwright.sync_api import sync_playwright

    db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    last = db.execute("SELECT max(id) FROM experiments").fetchone()[0]
    # the best model that an evolution derived from a parent: its changes are outlined
    model = db.execute("SELECT id FROM models WHERE experiment_id = ? AND value IS NOT NULL "
                       "ORDER BY parent IS NULL, value DESC LIMIT 1", [last]).fetchone()[0]
    trial = db.execute("SELECT id FROM trials WHERE model_id = ?", [model]).fetchone()[0]
    db.close()
    server = Dashboard(store, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    os.makedirs(out, exist_ok=True)
    written = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": width, "height": 900})
            for name, path in PAGES:
                page.goto(server.url.rstrip("/") + path.format(model=model, trial=trial,
                                                               last=last))
                page.wait_for_selector("#app[data-loaded]")
                page.wait_for_timeout(500)  # Plotly's transitions
                target = os.path.join(out, f"{name}.png")
                page.screenshot(path=target, full_page=True)
                written.append(target)
            browser.close()
    finally:
        server.shutdown()
        server.server_close()
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", help="a store to read (default: run a demo search first)")
    ap.add_argument("--models", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "dashboard"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store or demo_store(tmp, args.models, args.epochs)
        for path in shoot(store, args.out):
            print("wrote", os.path.relpath(path, ROOT))


if __name__ == "__main__":
    main()
