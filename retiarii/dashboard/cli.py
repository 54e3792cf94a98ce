"""``retiarii dashboard DB``: serve the live dashboard of a store until Ctrl-C."""
from __future__ import annotations

import sys

__all__ = ["add_watch_parsers", "cmd_dashboard"]


def add_watch_parsers(sub, run, resume) -> None:
    """The ``dashboard`` command, and ``--tensorboard`` of ``run`` and ``resume``: the ways
    to watch a search."""
    from ..tensorboard_log import add_tensorboard_flag

    add_tensorboard_flag(run)
    add_tensorboard_flag(resume)
    p = sub.add_parser("dashboard", help="a live web dashboard of a store (read-only)")
    p.add_argument("db", help="the SQLite file of a run (it may not exist yet: the pages say so "
                              "until the search creates it)")
    p.add_argument("--experiment", type=int, default=None, metavar="N",
                   help="the experiment shown by default (default: the store's latest; the "
                        "experiments page lists them all)")
    p.add_argument("--port", type=int, default=8050, help="the port to listen on (default 8050; "
                                                          "0: any free port)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default 127.0.0.1: this machine only); any "
                        "other needs the token printed at start")
    p.set_defaults(fn=cmd_dashboard)


def cmd_dashboard(args) -> int:
    from ..cli_common import CliError
    from .server import LOOPBACK, Dashboard

    if not 0 <= args.port <= 65535:
        raise CliError(f"--port {args.port}: give a port from 0 to 65535")
    token = None
    if args.host not in LOOPBACK:
        token = Dashboard.new_token()
        print(f"warning: --host {args.host} makes the dashboard reachable from other machines; "
              f"every request needs the token in the URL below (or its cookie)", file=sys.stderr)
    try:
        server = Dashboard(args.db, args.experiment, host=args.host, port=args.port, token=token)
    except OSError as err:
        raise CliError(f"cannot listen on {args.host}:{args.port} ({err.strerror}): pick "
                       f"another --port (0: any free one)") from None
    print(f"retiarii dashboard of {args.db}: {server.url}   (Ctrl-C stops it)", flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        print("\ndashboard stopped", file=sys.stderr)
    finally:
        server.server_close()
    return 0
