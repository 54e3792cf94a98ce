"""``retiarii dashboard``: its JSON endpoints against the store they read (no browser: these
run everywhere), its CSV downloads, its routes, its token, and what it shows of a store it
cannot read. The pages in a real browser: tests/test_dashboard_browser.py."""
from __future__ import annotations

import csv
import http.client
import io
import json
import os
import sqlite3
import threading
import urllib.parse

import pytest

import retiarii as rt
from engine_helpers import InProcessExecutor
from exp_space import failing_space, space, trainer
from retiarii.cli import main
from retiarii.dashboard import Dashboard
from retiarii.dashboard.analysis import importance
from retiarii.engine.storage.lock import StoreLock
from retiarii.engine.storage.store import Store


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """Two experiments: an evolution of 10 models on a space where some models fail (NaN
    loss), then a random search of 3."""
    db = str(tmp_path_factory.mktemp("dash") / "d.db")
    rt.Experiment(failing_space, rt.strategies.RegularizedEvolution(population_size=4,
                                                                    sample_size=2, seed=0),
                  trainer, store=db, seed=0, executor=InProcessExecutor(), max_models=10,
                  optimize=False).run()
    rt.Experiment(space, rt.strategies.Random(seed=1), trainer, store=db, seed=1,
                  executor=InProcessExecutor(), max_models=3, optimize=False).run()
    return db


@pytest.fixture
def serve():
    """serve(db, **kw) -> a running Dashboard on a free loopback port (shut down after)."""
    servers = []

    def start(db, **kw):
        server = Dashboard(db, port=0, **kw)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def get(server, path, headers=None):
    """(status, headers, body text) of GET ``path``."""
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=60)
    conn.request("GET", path, headers=headers or {})
    res = conn.getresponse()
    body = res.read().decode(errors="replace")
    conn.close()
    return res.status, dict(res.getheaders()), body


def api(server, page, **query):
    status, _, body = get(server, f"/api/{page}?" + urllib.parse.urlencode(query))
    assert status == 200, body
    return json.loads(body)


def test_pages_show_what_the_store_holds(store, serve):
    server = serve(store)
    with Store(store) as s:
        s.use_experiment(1)
        best = s.best_models("val_acc", "max", 1)[0]
        counts = s.counts_by_state()
        models = s.models()
        trial_ids = [t["id"] for t in s.trials()]
        curve = s.learning_curve(trial_ids[0], "val_acc")
        ir = s.get_model(best["model_id"])["graph"]
    o = api(server, "overview", exp=1)
    assert o["best"]["model_id"] == best["model_id"] and o["best"]["value"] == best["value"]
    assert o["trials_by_state"] == counts and o["budget"]["models"] == len(models)
    failed = [m for m in models if m["status"] == "failed"]
    assert failed, "the fixture's space has models that fail"
    errors = o["tables"]["errors"]["rows"]
    assert sorted(r[0] for r in errors) == sorted(m["id"] for m in failed)
    assert all("not a finite number" in r[2] or "nan" in r[2].lower() for r in errors), errors
    # best so far never gets worse, and ends at the best model's value
    assert o["best_so_far"]["best"] == sorted(o["best_so_far"]["best"])
    assert o["best_so_far"]["best"][-1] == best["value"]
    t = api(server, "trials", exp=1)
    assert [r[0] for r in t["tables"]["trials"]["rows"]] == trial_ids
    assert [tuple(p) for p in t["curves"][trial_ids[0]]] == [tuple(p) for p in curve]
    one = api(server, "trial", exp=1, id=trial_ids[0])
    assert [tuple(p) for p in one["curves"]["val_acc"]] == [tuple(p) for p in curve]
    m = api(server, "model", exp=1, id=best["model_id"])
    assert len(m["tables"]["nodes"]["rows"]) == len(ir["nodes"])
    assert sorted(map(tuple, m["tables"]["edges"]["rows"])) == sorted(map(tuple, ir["edges"]))
    assert m["svg"].count('class="node"') == len(ir["nodes"])  # drawn by Graphviz
    space_page = api(server, "space", exp=1)
    parents = sorted([mm["parent"], mm["id"]] for mm in models if mm["parent"] is not None)
    assert parents, "an evolution's children name their parent"
    assert sorted(space_page["lineage"]["edges"]) == parents
    assert space_page["lineage_svg"].count('class="node"') == len({x for e in parents for x in e})
    assert api(server, "engine", exp=1)["tables"]["jobs"]["rows"] == []  # optimize=False
    exps = api(server, "experiments")["tables"]["experiments"]["rows"]
    assert [r[0] for r in exps] == [1, 2] and [r[6] for r in exps] == [len(models), 3]
    cmp = api(server, "compare", a=1, b=2)
    assert [s["experiment"] for s in cmp["series"]] == [1, 2]
    assert cmp["series"][0]["best"][-1] == best["value"]
    # the default experiment is the store's latest
    assert api(server, "overview")["experiment"] == 2


def _changed(child_graph: dict, reference_graph: dict) -> list[str]:
    """The names of the child's nodes that differ from (or are missing in) the reference,
    computed here from the two graphs."""
    before = {n["name"]: n["op"] for n in reference_graph["nodes"]}
    return sorted(n["name"] for n in child_graph["nodes"]
                  if n["name"] not in before or json.dumps(before[n["name"]], sort_keys=True)
                  != json.dumps(n["op"], sort_keys=True))


def _marked(m: dict) -> list[str]:
    cols = m["tables"]["nodes"]["columns"]
    return sorted(r[cols.index("name")] for r in m["tables"]["nodes"]["rows"]
                  if r[cols.index("diff")] != "same")


def test_a_changed_node_is_marked_against_the_base_or_the_parent(store, serve):
    server = serve(store)
    with Store(store) as s:
        s.use_experiment(1)
        child = next(m for m in s.models() if m["parent"] is not None and m["graph"])
        parent = s.get_model(child["parent"])
    # by default against the base model the mutators started from, as the store keeps it
    base = failing_space.bases[0][0].to_data()
    m = api(server, "model", exp=1, id=child["id"])
    assert m["reference"] is None and m["reference_is_base"]
    assert _marked(m) == _changed(child["graph"], base) and _marked(m)
    # against the parent on request (what an evolution mutated)
    m = api(server, "model", exp=1, id=child["id"], vs=parent["id"])
    assert m["reference"] == parent["id"] and not m["reference_is_base"]
    assert _marked(m) == _changed(child["graph"], parent["graph"])
    if child["hash"] != parent["hash"]:  # another architecture: something is marked
        assert _marked(m) or m["removed"]


def test_a_file_without_base_graphs_compares_with_the_parent(store, serve, tmp_path):
    old = str(tmp_path / "old.db")
    with sqlite3.connect(store) as src, sqlite3.connect(old) as dst:
        src.backup(dst)
    with sqlite3.connect(old) as db:
        db.execute("DELETE FROM base_graphs")  # as a file written before schema 10
    with Store(old) as s:
        s.use_experiment(1)
        child = next(m for m in s.models() if m["parent"] is not None and m["graph"])
    m = api(serve(old), "model", exp=1, id=child["id"])
    assert m["reference"] == child["parent"] and not m["reference_is_base"]


def test_every_table_downloads_as_csv(store, serve):
    server = serve(store)
    with Store(store) as s:
        s.use_experiment(1)
        trial_id, model_id = s.trials()[0]["id"], s.models()[0]["id"]
    pages = {"experiments": {}, "overview": {}, "trials": {}, "trial": {"id": trial_id},
             "space": {}, "model": {"id": model_id}, "engine": {}, "pareto": {},
             "compare": {"a": 1, "b": 2}}
    seen = 0
    for page, query in pages.items():
        data = api(server, page, exp=1, **query)
        for name, tbl in data.get("tables", {}).items():
            q = urllib.parse.urlencode({"exp": 1, "table": name, **query})
            status, headers, body = get(server, f"/api/{page}.csv?{q}")
            assert status == 200 and headers["Content-Type"].startswith("text/csv")
            assert "attachment" in headers["Content-Disposition"]
            rows = list(csv.reader(io.StringIO(body)))
            assert rows[0] == tbl["columns"] and len(rows) - 1 == len(tbl["rows"]), (page, name)
            seen += 1
    assert seen >= 15
    status, _, body = get(server, "/api/trials.csv?table=nope")
    assert status == 400 and "trials" in json.loads(body)["error"]


def test_the_model_file_and_weights_rebuild_the_trained_model(store, serve, tmp_path):
    """The standalone file and the weights the model page offers load together (strict)."""
    import importlib.util

    import torch

    server = serve(store)
    with Store(store) as s:
        s.use_experiment(1)
        model_id = s.best_models("val_acc", "max", 1)[0]["model_id"]
    host, port = server.server_address[:2]
    for ext in ("py", "pt"):
        conn = http.client.HTTPConnection(host, port, timeout=60)
        conn.request("GET", f"/download/model.{ext}?exp=1&id={model_id}")
        res = conn.getresponse()
        assert res.status == 200
        (tmp_path / f"m.{ext}").write_bytes(res.read())
    spec = importlib.util.spec_from_file_location("m", tmp_path / "m.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    net = getattr(module, f"Model{model_id}")()
    net.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    assert net(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


def test_importance_ranks_the_choice_that_decides_the_metric():
    """A hand-made space: the value is set by `op` alone; `noise` varies without effect."""
    samples = [{"op": op, "noise": n} for op in ("a", "b", "c") for n in (1, 2, 3, 4)]
    values = [{"a": 0.1, "b": 0.5, "c": 0.9}[s["op"]] for s in samples]
    ranked = importance(samples, values, ["op", "noise", "fixed"])
    assert [r[0] for r in ranked] == ["op", "noise"]  # `fixed` never varies: not ranked
    assert ranked[0][1] > 0.5 and abs(ranked[1][1]) < 0.05
    assert importance(samples[:3], values[:3], ["op"]) == []  # too few models to say


def test_it_listens_on_loopback_and_needs_a_token_beyond(store, serve):
    server = serve(store)
    assert server.socket.getsockname()[0] == "127.0.0.1"
    assert get(server, "/api/overview")[0] == 200  # loopback: no token
    with pytest.raises(ValueError, match="token"):
        Dashboard(store, host="0.0.0.0", port=0)
    open_server = serve(store, host="0.0.0.0", token="s3cret")
    status, _, body = get(open_server, "/overview")
    assert status == 403 and "token" in body and "Traceback" not in body
    assert get(open_server, "/api/overview?token=wrong")[0] == 403
    status, headers, _ = get(open_server, "/overview?token=s3cret")
    assert status == 200 and "s3cret" in headers["Set-Cookie"]
    cookie = headers["Set-Cookie"].split(";")[0]
    assert get(open_server, "/api/overview", {"Cookie": cookie})[0] == 200
    assert open_server.url.endswith("?token=s3cret")


@pytest.mark.parametrize("path", ["/etc/passwd", "/static/../server.py", "/static/server.py",
                                  "/api/nope", "/api/overview.exe", "/download/x.py",
                                  "/overview/extra"])
def test_paths_outside_its_routes_are_404(store, serve, path):
    status, _, body = get(serve(store), path)
    assert status == 404 and "Traceback" not in body


@pytest.mark.parametrize("kind", ["missing", "garbage", "other sqlite"])
def test_a_store_it_cannot_read_gives_a_clear_page(tmp_path, serve, kind):
    path = tmp_path / "x.db"
    if kind == "garbage":
        path.write_bytes(b"this is not a database" * 100)
    elif kind == "other sqlite":
        sqlite3.connect(path).execute("CREATE TABLE t (x)").connection.commit()
    server = serve(str(path))
    expected = {"missing": "does not exist", "garbage": "not a retiarii store",
                "other sqlite": "not a retiarii store"}[kind]
    for page in ("/overview", "/trials", "/model?id=1"):
        status, _, body = get(server, page)
        assert status == 503 and expected in body and "Traceback" not in body, body
    status, _, body = get(server, "/api/overview")
    assert status == 503 and expected in json.loads(body)["error"]
    assert (kind == "missing") == (not path.exists())  # nothing created


def test_unknown_ids_and_bad_parameters_are_named(store, serve):
    server = serve(store)
    status, _, body = get(server, "/api/model?exp=1&id=999")
    assert status == 404 and "model 999" in json.loads(body)["error"]
    status, _, body = get(server, "/api/overview?exp=7")
    assert status == 404 and "experiment 7" in json.loads(body)["error"]
    status, _, body = get(server, "/api/model?exp=1&id=x")
    assert status == 400 and "?id=" in json.loads(body)["error"]


def test_it_reads_beside_a_driver_without_writing(store, serve):
    """A driver holds the store's lock: every page still answers, and the file is unchanged."""
    before = open(store, "rb").read()
    server = serve(store)
    with StoreLock(store):
        for page in ("overview", "trials", "space", "engine", "experiments"):
            assert api(server, page, exp=1)
        assert get(server, "/api/stamp")[0] == 200
    assert open(store, "rb").read() == before


def test_the_stamp_changes_when_the_store_gains_a_result(tmp_path, serve):
    db = str(tmp_path / "s.db")
    rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=db, seed=0,
                  executor=InProcessExecutor(), max_models=1, optimize=False).run()
    server = serve(db)
    first = api(server, "stamp")["stamp"]
    assert api(server, "stamp")["stamp"] == first  # nothing new: the same
    rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=db, seed=0,
                  executor=InProcessExecutor(), max_models=2,
                  optimize=False).resume()
    assert api(server, "stamp")["stamp"] != first


def test_cli_prints_the_url_and_warns_beyond_loopback(store, monkeypatch, capsys):
    def stop(self, poll_interval=0.5):
        raise KeyboardInterrupt

    monkeypatch.setattr(Dashboard, "serve_forever", stop)
    assert main(["dashboard", store, "--port", "0"]) == 0
    out, err = capsys.readouterr()
    assert "http://127.0.0.1:" in out and "token" not in out and "warning" not in err
    assert main(["dashboard", store, "--port", "0", "--host", "0.0.0.0"]) == 0
    out, err = capsys.readouterr()
    assert "?token=" in out and "warning" in err
    assert main(["dashboard", store, "--port", "70000"]) == 2
    assert "--port 70000" in capsys.readouterr().err
    assert os.path.exists(store)


def test_the_pareto_page_marks_the_stored_front(tmp_path, serve):
    db = str(tmp_path / "p.db")
    rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=db, seed=0,
                  executor=InProcessExecutor(), max_models=5, optimize=False,
                  metric=["val_acc", "params"], mode=["max", "min"]).run()
    p = api(serve(db), "pareto")
    with Store(db) as s:
        exp = s.experiments()[-1]
        front = set(json.loads(s.db.execute("SELECT front FROM experiments WHERE id = ?",
                                             [exp["id"]]).fetchone()[0]))
        values = {r[0]: json.loads(r[1]) for r in s.db.execute(
            'SELECT id, "values" FROM models WHERE "values" IS NOT NULL')}
    assert p["objectives"] == ["val_acc", "params"] and p["note"] is None
    assert {q["model"] for q in p["points"] if q["front"]} == front and front
    for q in p["points"]:
        assert q["values"] == [values[q["model"]]["val_acc"], values[q["model"]]["params"]]


def test_the_overview_names_every_objective_and_the_front(tmp_path, serve):
    db = str(tmp_path / "o.db")
    rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=db, seed=0,
                  executor=InProcessExecutor(), max_models=4, optimize=False,
                  metric=["val_acc", "params"], mode=["max", "min"],
                  constraints=["params <= 1000000"]).run()
    o = api(serve(db), "overview")
    with Store(db) as s:
        front = json.loads(s.db.execute("SELECT front FROM experiments").fetchone()[0])
    assert o["objectives"]["metrics"] == ["val_acc", "params"]
    assert o["objectives"]["modes"] == ["max", "min"]
    assert o["objectives"]["constraints"] == ["params <= 1000000"]
    assert sorted(o["front"]) == sorted(front) and front


def test_a_one_shot_search_shows_its_segments(tmp_path, serve):
    from one_shot_helpers import space as shared_space, trainer as shared_trainer

    db = str(tmp_path / "s.db")
    rt.Experiment(shared_space, rt.strategies.SPOS(train_segments=2, search_population=2,
                                                   search_generations=1, seed=1),
                  shared_trainer, store=db, seed=0, executor=InProcessExecutor()).run()
    e = api(serve(db), "engine")
    with Store(db) as s:
        stored = s.db.execute("SELECT segment, unit, models, metrics FROM segments ORDER BY "
                              "segment").fetchall()
    t = e["tables"]["segments"]
    cols = t["columns"]
    assert [r[cols.index("segment")] for r in t["rows"]] == [r[0] for r in stored]
    assert [r[cols.index("unit")] for r in t["rows"]] == [r[1] for r in stored]
    assert [r[cols.index("models_evaluated")] for r in t["rows"]] == [r[2] for r in stored]
    for name, points in e["segments"].items():  # every numeric metric, segment by segment
        expected = [[seg, json.loads(m)[name]] for seg, _, _, m in stored
                    if name in json.loads(m or "{}")]
        assert points == expected
    assert e["segments"]


def test_the_model_page_counts_flops_without_the_space_code(store, serve):
    """FLOPs of one example, from the stored graph alone, equal torch's count on the model
    the space builds."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with Store(store) as s:
        s.use_experiment(1)
        row = next(m for m in s.models() if m["graph"] and m["status"] == "trained")
    m = api(serve(store), "model", exp=1, id=row["id"])
    arch = {k: v for k, v in row["sample"].items() if k != "lr"}  # lr: a trainer choice
    built = failing_space.instantiate(arch).to_module()
    with FlopCounterMode(display=False) as counter:
        built(torch.zeros(1, 1, 8, 8))
    assert m["flops"] == counter.get_total_flops() > 0 and m["flops_note"] is None
