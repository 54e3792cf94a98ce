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
PAGES = [("experiments", "/"), ("overview", "/overview?exp={main}"),
         ("trials", "/trials?exp={main}"), ("trial", "/trial?id={trial}&exp={main}"),
         ("space", "/space?exp={main}"), ("model", "/model?id={model}&exp={main}"),
         ("engine", "/engine?exp={main}"), ("engine_one_shot", "/engine?exp={one_shot}"),
         ("pareto", "/pareto?exp={main}"), ("compare", "/compare?a=1&b={main}")]


def demo_store(folder: str, models: int, epochs: int) -> str:
    store = os.path.join(folder, "demo.db")
    # three experiments: the README's demo and one of two objectives (accuracy against
    # parameter count), the compare page's two curves and the Pareto page; then a one-shot
    # search (ENAS) for the engine page's segments
    for seed, extra in ((0, ["--max-models", str(models), "--epochs", str(epochs)]),
                        (1, ["--max-models", str(models), "--epochs", str(epochs),
                             "--metric", "val_acc,params", "--mode", "max,min"]),
                        (2, ["--strategy", "enas", "--epochs", "4"])):
        subprocess.run([sys.executable, "-m", "retiarii.cli", "run", "demo", "--store", store,
                        "--seed", str(seed), *extra], check=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    return store


def shoot(store: str, out: str, width: int = 1400) -> list[str]:
    import sqlite3

    from playwright.sync_api import sync_playwright

    db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    # the multi-trial search of two objectives, and the one-shot search (the latest)
    main, one_shot = 2, db.execute("SELECT max(id) FROM experiments").fetchone()[0]
    # the best model that an evolution derived from a parent: its changes are outlined
    model = db.execute("SELECT id FROM models WHERE experiment_id = ? AND value IS NOT NULL "
                       "ORDER BY parent IS NULL, value DESC LIMIT 1", [main]).fetchone()[0]
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
                page.goto(server.url.rstrip("/") + path.format(
                    model=model, trial=trial, main=main, one_shot=one_shot))
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
