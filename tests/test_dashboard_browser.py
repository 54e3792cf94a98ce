"""The dashboard in a real browser: headless Chromium (Debian's ``chromium``, driven by
Playwright at ``executable_path``: its own browser download fails offline) opens every page
against a store made by a real demo search, checks what it shows against the store, sorts and
filters a table, saves a screenshot of each page, and watches a live search gain results
without a reload. Skips when Playwright or Chromium is missing (CI installs both)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import pytest

from retiarii.dashboard import Dashboard
from retiarii.engine.storage.store import Store

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover (the dashboard extra is not installed)
    sync_playwright = None

pytestmark = [
    pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed: pip "
                       "install -e .[dashboard]"),
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="no chromium: apt-get install "
                       "chromium (Playwright drives the system browser)"),
]


def _cli(*args, wait=True):
    cmd = [sys.executable, "-m", "retiarii.cli", *args]
    env = {**os.environ, "PYTHONPATH": ROOT}
    if wait:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            cwd=ROOT)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """A small search in this process: 4 models of the engine tests' space, 2 epochs each."""
    import retiarii as rt
    from engine_helpers import InProcessExecutor
    from exp_space import space, trainer

    db = str(tmp_path_factory.mktemp("browser") / "small.db")
    rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=db, seed=0,
                  executor=InProcessExecutor(), max_models=4, optimize=False).run()
    return db


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory) -> str:
    """The README's demo search, small: 4 models of 1 epoch on 2 workers (grouped jobs)."""
    db = str(tmp_path_factory.mktemp("browser") / "demo.db")
    out = _cli("run", "demo", "--max-models", "4", "--epochs", "1", "--store", db)
    assert out.returncode == 0, out.stderr[-2000:]
    return db


@pytest.fixture(scope="module")
def browser():
    """One browser context for the module: Plotly's bundle (4.8 MB) is fetched once."""
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = b.new_context(viewport={"width": 1400, "height": 900})
        yield context
        context.close()
        b.close()


@pytest.fixture
def serve():
    servers = []

    def start(db):
        server = Dashboard(db, port=0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.url.rstrip("/")

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def _open(browser, url):
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.wait_for_selector("#app[data-loaded]", timeout=30000)
    return page, errors


def _rows(page, table):
    return page.locator(f"#{table} tbody tr")


@pytest.mark.slow
def test_every_page_of_a_demo_search(demo_store, browser, serve, tmp_path):
    """Every page against the CLI's demo search (2 workers, grouped jobs), each saved as a
    screenshot; slow: nine pages each parse Plotly's bundle."""
    store = demo_store
    base = serve(store)
    with Store(store) as s:
        s.use_experiment(1)
        trials = s.trials()
        best = s.best_models("val_acc", "max", 1)[0]
        curve = s.learning_curve(best["trial_id"], "val_acc")
        ir = s.get_model(best["model_id"])["graph"]
    pages = {"experiments": "/", "overview": "/overview", "trials": "/trials",
             "trial": f"/trial?id={best['trial_id']}", "space": "/space",
             "model": f"/model?id={best['model_id']}", "engine": "/engine",
             "pareto": "/pareto", "compare": "/compare?a=1&b=1"}
    for name, path in pages.items():
        page, errors = _open(browser, base + path)
        if name == "overview":
            assert f"{best['value']:.4g}" in page.inner_text("#kv-best")
            assert page.locator("#chart-best-models .scatterlayer .point").count() == 4
        elif name == "trials":
            assert _rows(page, "trials").count() == len(trials)
        elif name == "trial":  # the val_acc curve drawn is the store's
            drawn = page.evaluate("document.getElementById('chart-trial').data"
                                  ".filter(t => t.name === 'val_acc').map(t => [t.x, t.y])[0]")
            assert list(zip(*drawn)) == [tuple(p) for p in curve]
            checkpoint = next(t["checkpoint"] for t in trials if t["id"] == best["trial_id"])
            assert checkpoint and page.inner_text("#kv-checkpoint").endswith(checkpoint)
        elif name == "model":  # one drawn node per node of the IR
            assert page.locator("#arch-svg svg g.node").count() == len(ir["nodes"])
            assert "class Model" in page.inner_text("#source")
            assert "the base model" in page.inner_text("#kv-reference")
            assert float(page.inner_text("#kv-flops")) > 0
        elif name == "engine":
            with Store(store) as s:
                n_jobs = s.db.execute("SELECT count(*) FROM plans").fetchone()[0]
            assert _rows(page, "jobs").count() == n_jobs
        elif name == "space":
            assert page.locator("#chart-parcoords .parcoords").count() == 1
        elif name == "pareto":
            assert "one metric" in page.inner_text("#pareto-note")
        page.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)
        assert not errors, (name, errors)
        page.close()
    assert len(list(tmp_path.glob("*.png"))) == len(pages)


def test_the_pages_agree_with_the_store(store, browser, serve, tmp_path):
    """Overview, trials (sorted, filtered), one trial's curve, one model's drawing."""
    base = serve(store)
    with Store(store) as s:
        s.use_experiment(1)
        best = s.best_models("val_acc", "max", 1)[0]
        curve = s.learning_curve(best["trial_id"], "val_acc")
        ir = s.get_model(best["model_id"])["graph"]
    page, errors = _open(browser, base + "/overview")
    assert f"{best['value']:.4g}" in page.inner_text("#kv-best")
    page.screenshot(path=str(tmp_path / "overview.png"), full_page=True)
    page.goto(f"{base}/trial?id={best['trial_id']}")
    page.wait_for_selector("#app[data-loaded]")
    drawn = page.evaluate("document.getElementById('chart-trial').data"
                          ".filter(t => t.name === 'val_acc').map(t => [t.x, t.y])[0]")
    assert list(zip(*drawn)) == [tuple(p) for p in curve]
    page.goto(f"{base}/model?id={best['model_id']}")
    page.wait_for_selector("#app[data-loaded]")
    assert page.locator("#arch-svg svg g.node").count() == len(ir["nodes"])
    page.screenshot(path=str(tmp_path / "model.png"), full_page=True)
    with Store(store) as s:
        s.use_experiment(1)
        values = sorted(v for _, _, v in s.final_values("val_acc"))
        first = s.trials()[0]["id"]
    page.goto(base + "/trials")
    page.wait_for_selector("#app[data-loaded]")
    assert _rows(page, "trials").count() == len(values)
    cols = page.eval_on_selector_all("#trials thead th", "ths => ths.map(t => t.dataset.col)")
    col = cols.index("val_acc")

    def column():
        return [float(t) for t in page.eval_on_selector_all(
            f"#trials tbody tr td:nth-child({col + 1})", "tds => tds.map(t => t.textContent)")]

    page.click("#trials thead th[data-col=val_acc]")
    assert column() == pytest.approx(values, rel=1e-3)
    page.click("#trials thead th[data-col=val_acc]")
    assert column() == pytest.approx(values[::-1], rel=1e-3)
    page.fill("#trials-filter", first)
    assert _rows(page, "trials").count() == 1
    assert page.inner_text("#trials tbody tr td:first-child") == first
    page.fill("#trials-filter", "")
    assert _rows(page, "trials").count() == len(values)
    page.screenshot(path=str(tmp_path / "trials.png"), full_page=True)
    assert len(list(tmp_path.glob("*.png"))) == 3
    assert not errors  # no script error on any page


def test_a_search_in_a_thread_appears_without_reload(tmp_path, browser, serve):
    """A search resumed in a thread of this process while the trials page is open: its new
    trials appear in the table without a reload."""
    import retiarii as rt

    from engine_helpers import InProcessExecutor
    from exp_space import space, trainer

    db = str(tmp_path / "thread.db")

    def search(models):
        exp = rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=db, seed=0,
                            executor=InProcessExecutor(), max_models=models, optimize=False)
        exp.resume() if os.path.exists(db) else exp.run()

    search(1)
    page, _ = _open(browser, serve(db) + "/trials")
    assert _rows(page, "trials").count() == 1
    page.evaluate("window.sameDocument = true")  # gone if the page reloads
    worker = threading.Thread(target=search, args=(4,))
    worker.start()
    page.wait_for_function("document.querySelectorAll('#trials tbody tr').length === 4",
                           timeout=120000)
    worker.join(timeout=120)
    page.wait_for_function("[...document.querySelectorAll('#trials tbody tr')].every("
                           "r => r.textContent.includes('TERMINATED'))", timeout=30000)
    assert page.evaluate("window.sameDocument") is True


@pytest.mark.slow
def test_a_live_search_appears_without_reload(tmp_path, browser, serve):
    """The dashboard is started before the search: its page says the store does not exist
    yet, then shows the trials as the search (another process) finishes them."""
    db = str(tmp_path / "live.db")
    base = serve(db)
    page = browser.new_page()
    page.goto(base + "/trials")
    assert "does not exist" in page.inner_text("#message")
    search = _cli("run", "demo", "--max-models", "4", "--epochs", "2", "--workers", "1",
                  "--store", db, wait=False)
    try:
        page.wait_for_selector("#app[data-loaded]", timeout=120000)  # the page retried
        page.evaluate("window.sameDocument = true")  # gone if the page reloads
        done_at_first = page.locator("#trials tbody tr:has-text('TERMINATED')").count()
        page.wait_for_function(
            "document.querySelectorAll('#trials tbody tr').length === 4 && [...document."
            "querySelectorAll('#trials tbody tr')].every(r => r.textContent.includes("
            "'TERMINATED'))", timeout=180000)
        assert page.evaluate("window.sameDocument") is True
        assert done_at_first < 4  # it gained results while open
        assert search.wait(timeout=120) == 0, search.stderr.read()[-2000:]
    finally:
        if search.poll() is None:
            search.kill()
            search.wait()


def test_a_one_shot_search_shows_its_segments(tmp_path, browser, serve):
    """The engine page of a one-shot search: a row and a chart point per stored segment."""
    import retiarii as rt
    from engine_helpers import InProcessExecutor
    from one_shot_helpers import space, trainer

    db = str(tmp_path / "spos.db")
    rt.Experiment(space, rt.strategies.SPOS(train_segments=2, search_population=2,
                                            search_generations=1, seed=1),
                  trainer, store=db, seed=0, executor=InProcessExecutor()).run()
    with Store(db) as s:
        segments = s.db.execute("SELECT count(*) FROM segments").fetchone()[0]
    page, errors = _open(browser, serve(db) + "/engine")
    assert segments and _rows(page, "segments").count() == segments
    assert "one-shot search" in page.inner_text("#jobs-note")
    assert page.locator("#chart-segments .scatterlayer .point").count() >= segments
    assert not errors, errors
    page.close()
