"""The dashboard's web server: the standard library's ``ThreadingHTTPServer`` with a fixed
table of routes (HTML pages, their JSON data, CSV downloads, the model's files and the static
scripts); any other path is a 404.

Every request opens its own read-only connection (:func:`.store_view.connect`), so the server
never holds the store open between requests, never writes, never takes the driver's lock.

Example::

    server = Dashboard("runs/demo.db", port=0)     # port 0: any free port
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(server.url)
"""
from __future__ import annotations

import csv
import hmac
import http.server
import io
import json
import math
import os
import secrets
import socket
import sys
import urllib.parse

from . import analysis, model_view, pages, store_view
from .store_view import NotInStore, StoreUnavailable

__all__ = ["Dashboard", "LOOPBACK", "PAGES"]

LOOPBACK = ("127.0.0.1", "localhost", "::1")
COOKIE = "retiarii_dashboard"
STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
# page -> the data it draws: f(db, experiment id, query, dashboard)
PAGES = {
    "experiments": lambda db, e, q, d: store_view.experiment_list(db),
    "overview": lambda db, e, q, d: store_view.overview(db, e),
    "trials": lambda db, e, q, d: store_view.trials(db, e),
    "trial": lambda db, e, q, d: store_view.trial(db, e, _arg(q, "id"), d.checkpoint_dir),
    "space": lambda db, e, q, d: _space(db, e),
    "model": lambda db, e, q, d: model_view.model(db, e, _int(q, "id"), d.checkpoint_dir,
                                                  _int(q, "vs", None)),
    "engine": lambda db, e, q, d: analysis.engine(db, e),
    "pareto": lambda db, e, q, d: analysis.pareto(db, e),
    "compare": lambda db, e, q, d: store_view.compare(db, _int(q, "a"), _int(q, "b")),
}


class BadRequest(Exception):
    """A query parameter missing or malformed: a 400 naming it."""


def _arg(query: dict, name: str) -> str:
    if name not in query:
        raise BadRequest(f"this page needs ?{name}=...")
    return query[name]


def _int(query: dict, name: str, default=BadRequest):
    if name not in query:
        if default is BadRequest:
            raise BadRequest(f"this page needs ?{name}=N")
        return default
    try:
        return int(query[name])
    except ValueError:
        raise BadRequest(f"?{name}={query[name]!r}: give a whole number") from None


def _space(db, exp_id: int) -> dict:
    out = analysis.search_space(db, exp_id)
    source = analysis.lineage_dot(out["lineage"], out["mode"])
    out["lineage_svg"], out["lineage_note"] = (model_view.render_svg(source) if source
                                               else (None, "no model has a parent: the strategy "
                                                     "drew every model afresh"))
    return out


def _clean(obj):
    """JSON has no NaN or infinity: they go as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


class Dashboard(http.server.ThreadingHTTPServer):
    """The dashboard of the store ``path`` on ``host:port``.

    Args:
        path: the run's SQLite file (it may not exist yet: the pages say so until it does).
        experiment: the experiment shown by default (None: the store's latest).
        host: the address to listen on; anything but loopback needs ``token``.
        token: the secret every request must carry (``?token=`` once, then a cookie); None on
            loopback, where only this machine's users reach the server.
    """

    daemon_threads = True  # a page left open never keeps the process alive
    allow_reuse_address = True

    def __init__(self, path: str, experiment: int | None = None, host: str = "127.0.0.1",
                 port: int = 8050, token: str | None = None):
        if host not in LOOPBACK and not token:
            raise ValueError(f"host {host!r} is reachable from other machines: give a token")
        self.path, self.experiment, self.token = os.path.abspath(path), experiment, token
        self.checkpoint_dir = os.path.splitext(self.path)[0] + ".checkpoints"
        if ":" in host:  # an IPv6 address (::1)
            self.address_family = socket.AF_INET6
        super().__init__((host, port), Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}/" + (f"?token={self.token}" if self.token else "")

    @staticmethod
    def new_token() -> str:
        return secrets.token_urlsafe(18)


class Handler(http.server.BaseHTTPRequestHandler):
    server: Dashboard
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # noqa: D401 (quiet: one line per request is noise)
        pass

    # ---- responses -----------------------------------------------------------------------

    def _send(self, status: int, body: bytes, kind: str, headers: dict | None = None):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        self._send(status, json.dumps(_clean(obj)).encode(), "application/json",
                   {"Cache-Control": "no-store"})

    def _page(self, status: int, title: str, body: str, page: str = "") -> None:
        self._send(status, pages.shell(title, body, page, self._exp_query()).encode(),
                   "text/html; charset=utf-8", self._cookie())

    def _message(self, status: int, title: str, text: str, refresh: bool = False) -> None:
        self._page(status, title, pages.message(title, text, refresh))

    def _cookie(self) -> dict:
        if self.server.token and self.query.get("token") == self.server.token:
            return {"Set-Cookie": f"{COOKIE}={self.server.token}; HttpOnly; SameSite=Strict; "
                                  f"Path=/"}
        return {}

    def _exp_query(self) -> str:
        return f"exp={self.query['exp']}" if "exp" in self.query else ""

    # ---- dispatch ------------------------------------------------------------------------

    def do_HEAD(self):  # noqa: N802 (the name http.server calls)
        self.do_GET()

    def do_GET(self):  # noqa: N802
        url = urllib.parse.urlsplit(self.path)
        self.query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
        if not self._authorized():
            return self._message(403, "Token required", "This dashboard listens beyond this "
                                 "machine and needs the token it printed when it started: open "
                                 "the URL it printed (with ?token=...).")
        route = url.path.rstrip("/") or "/"
        try:
            self._route(route)
        except BadRequest as err:
            self._reply_error(route, 400, "Bad request", str(err))
        except NotInStore as err:
            self._reply_error(route, 404, "Not in this store", str(err))
        except StoreUnavailable as err:
            self._reply_error(route, 503, "Store unavailable", str(err), refresh=True)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the browser left
        except Exception as err:  # noqa: BLE001 (a page must never show a traceback)
            import traceback

            traceback.print_exc(file=sys.stderr)
            self._reply_error(route, 500, "Internal error",
                              f"{type(err).__name__}: {err} (details on the server's terminal)")

    def _reply_error(self, route: str, status: int, title: str, text: str,
                     refresh: bool = False) -> None:
        if route.startswith("/api/"):
            self._json(status, {"error": text, "title": title})
        else:
            self._message(status, title, text, refresh)

    def _authorized(self) -> bool:
        token = self.server.token
        if not token:
            return True
        given = self.query.get("token")
        if given is None:
            cookies = dict(c.strip().split("=", 1) for c in
                           (self.headers.get("Cookie") or "").split(";") if "=" in c)
            given = cookies.get(COOKIE)
        return given is not None and hmac.compare_digest(given, token)

    def _route(self, route: str) -> None:
        if route == "/":
            return self._page(200, "Experiments", pages.body("experiments"), "experiments")
        name = route[1:]
        if name in PAGES:
            return self._store_page(name)
        if route == "/api/stamp":
            with store_view.connect(self.server.path) as db:
                return self._json(200, {"stamp": store_view.stamp(db, self._experiment(db))})
        if route.startswith("/api/"):
            name, _, ext = route[5:].partition(".")
            if name in PAGES and ext in ("", "csv"):
                return self._data(name, csv_table=self.query.get("table") if ext else None,
                                  want_csv=bool(ext))
        if route in ("/download/model.py", "/download/model.pt"):
            return self._download(route.rsplit(".", 1)[-1])
        if route.startswith("/static/"):
            return self._static(route[8:])
        self._message(404, "Not found", f"{route} is not a page of this dashboard; the pages "
                      f"are listed above.")

    def _experiment(self, db) -> int:
        if "exp" in self.query:
            return _int(self.query, "exp")
        if self.server.experiment is not None:
            return self.server.experiment
        return store_view.latest_experiment(db)

    def _store_page(self, name: str) -> None:
        with store_view.connect(self.server.path) as db:  # a clear page now, if unreadable
            if name not in ("experiments", "compare"):
                store_view.experiment(db, self._experiment(db))
        self._page(200, name.capitalize(), pages.body(name), name)

    def _data(self, name: str, csv_table: str | None, want_csv: bool) -> None:
        with store_view.connect(self.server.path) as db:
            exp_id = self._experiment(db) if name not in ("experiments", "compare") else None
            data = PAGES[name](db, exp_id, self.query, self.server)
            data["experiment"] = exp_id
            data["store"] = self.server.path
        if not want_csv:
            return self._json(200, data)
        tables = data.get("tables", {})
        if csv_table not in tables:
            raise BadRequest(f"?table={csv_table!r}: this page's tables are "
                             f"{', '.join(tables) or 'none'}")
        buf = io.StringIO()
        writer = csv.writer(buf)
        writer.writerow(tables[csv_table]["columns"])
        for row in tables[csv_table]["rows"]:
            writer.writerow(["" if v is None else v for v in _clean(row)])
        filename = f"{name}-{csv_table}" + (f"-e{exp_id}" if exp_id else "") + ".csv"
        self._send(200, buf.getvalue().encode(), "text/csv; charset=utf-8",
                   {"Content-Disposition": f'attachment; filename="{filename}"'})

    def _download(self, kind: str) -> None:
        with store_view.connect(self.server.path) as db:
            exp_id = self._experiment(db)
            model_id = _int(self.query, "id")
            data = model_view.model(db, exp_id, model_id, self.server.checkpoint_dir)
            state = model_view.weights(db, model_id, self.server.checkpoint_dir) \
                if kind == "pt" else None
        if kind == "py":
            if data["source"] is None:
                raise BadRequest(f"model {model_id} has no source here: {data['source_note']}")
            body, mime = data["source"].encode(), "text/x-python; charset=utf-8"
        else:
            if state is None:
                raise BadRequest(f"model {model_id} has no readable checkpoint: its weights "
                                 f"were not kept (or it never trained)")
            body, mime = model_view.weights_bytes(state), "application/octet-stream"
        self._send(200, body, mime,
                   {"Content-Disposition": f'attachment; filename="model_{model_id}.{kind}"'})

    def _static(self, name: str) -> None:
        if name == "plotly.min.js":
            path = pages.plotly_js()
            if path is None:
                return self._send(200, pages.NO_PLOTLY_JS.encode(), "text/javascript")
        elif name in ("app.js", "app.css"):
            path = os.path.join(STATIC, name)
        else:
            return self._message(404, "Not found", f"/static/{name} is not a file of this "
                                 f"dashboard.")
        with open(path, "rb") as f:
            body = f.read()
        kind = "text/css" if name.endswith(".css") else "text/javascript"
        self._send(200, body, kind + "; charset=utf-8", {"Cache-Control": "max-age=3600"})
