"""The dashboard's HTML: one shell per page (navigation, Plotly and the page script), a message
page for errors, and where Plotly's JavaScript comes from (the installed ``plotly`` package).

Each page is drawn in the browser by ``static/app.js`` from ``/api/<page>``; the HTML only names
the page, so every page is one request away and works the same way.
"""
from __future__ import annotations

import html
import os

__all__ = ["shell", "message", "body", "plotly_js", "NAV"]

# (page, title) of the navigation bar; the pages of one experiment keep its ?exp=
NAV = [("", "Experiments"), ("overview", "Overview"), ("trials", "Trials"),
       ("space", "Search space"), ("engine", "Engine"), ("pareto", "Pareto")]
NO_PLOTLY_JS = ("document.addEventListener('DOMContentLoaded', () => document.body.insertAdjacent"
                "HTML('afterbegin', '<p class=\"note\">Charts need the plotly Python package: pip "
                "install retiarii[dashboard]</p>'));")


def plotly_js() -> str | None:
    """The path of the ``plotly.min.js`` bundle the ``plotly`` package ships, or None."""
    try:
        import plotly
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(plotly.__file__), "package_data", "plotly.min.js")
    return path if os.path.isfile(path) else None


def shell(title: str, content: str, page: str, exp_query: str) -> str:
    """A whole HTML page: the navigation bar, then ``content``."""
    suffix = f"?{html.escape(exp_query)}" if exp_query else ""
    current = "" if page == "experiments" else page
    links = "".join(f'<a href="/{name}{suffix if name else ""}" '
                    f'class="{"on" if name == current else ""}">{label}</a>' for name, label in NAV)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)} · retiarii</title>
<link rel="stylesheet" href="/static/app.css">
<script src="/static/plotly.min.js"></script>
</head><body data-page="{html.escape(page)}">
<header><span class="brand">retiarii</span><nav>{links}</nav>
<span id="live" class="live" title="updates every second">live</span></header>
<main>{content}</main>
<script src="/static/app.js"></script>
</body></html>"""


def body(page: str) -> str:
    """The page's container; ``app.js`` fills it from ``/api/<page>``."""
    return f'<div id="app" data-page="{html.escape(page)}"><p class="note">loading…</p></div>'


def message(title: str, text: str, refresh: bool = False) -> str:
    """An error page's content: what is wrong and what to do; ``refresh``: retry every 2 s
    (a store that does not exist yet appears once the search starts)."""
    again = ('<p class="note">This page retries every 2 seconds.</p>'
             '<script>setTimeout(() => location.reload(), 2000)</script>') if refresh else ""
    return (f'<div class="card error"><h2>{html.escape(title)}</h2>'
            f'<p id="message">{html.escape(text)}</p>{again}</div>')
