"""Benchmark: does an open dashboard slow a running search? (issue #29: at most 5%).

Runs the same demo search (``retiarii run demo``, fixed seed and budget, local workers) several
times, alternately alone and with ``retiarii dashboard`` serving its store in another process
while a client polls it the way an open page does: ``/api/stamp`` once a second, and the
page's data (``/api/trials`` and ``/api/overview``) each time the stamp changed. The search's
wall time (the ``run`` process, start to exit) is compared: the ratio of the medians, with
vs without. Alternating the runs spreads the machine's other load over both. On a busy machine
that ratio is mostly noise, so the script also reports what the dashboard itself cost: the CPU
time of its server process (``/proc``: Linux) over the search's wall time, the share of one
core taken from the search at most.

Run: ``python benchmarks/dashboard_overhead.py [--pairs 3] [--models 16] [--epochs 2]``.
Measured on the shared development machine (2 cores, other engineers' jobs running):
see docs/dashboard.md, "Overhead on a running search".
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT}


def poll(url: str, stop: threading.Event, counts: dict) -> None:
    """An open page: the stamp at 1 Hz, the page's data when it changed."""
    last = None
    while not stop.is_set():
        try:
            with urllib.request.urlopen(url + "api/stamp", timeout=10) as r:
                stamp = json.load(r).get("stamp")
            counts["stamps"] += 1
            if stamp != last:
                last = stamp
                for page in ("trials", "overview"):
                    with urllib.request.urlopen(url + f"api/{page}", timeout=30) as r:
                        r.read()
                    counts["pages"] += 1
        except OSError:
            counts["errors"] += 1  # the store does not exist yet: the page would retry
        stop.wait(1.0)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def search(folder: str, i: int, args, dashboard: bool) -> tuple[float, dict]:
    store = os.path.join(folder, f"run{i}.db")
    counts = {"stamps": 0, "pages": 0, "errors": 0}
    server = stop = thread = None
    if dashboard:
        server = subprocess.Popen([sys.executable, "-m", "retiarii.cli", "dashboard", store,
                                   "--port", "0"], env=ENV, stdout=subprocess.PIPE, text=True,
                                  cwd=ROOT)
        url = server.stdout.readline().split(": ", 1)[1].split()[0]  # its printed URL
        stop = threading.Event()
        thread = threading.Thread(target=poll, args=(url, stop, counts), daemon=True)
        thread.start()
        counts["server_cpu_s"] = cpu_seconds(server.pid)  # its start-up (imports) left out
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "retiarii.cli", "run", "demo", "--max-models",
                    str(args.models), "--epochs", str(args.epochs), "--workers",
                    str(args.workers), "--seed", "0", "--store", store], env=ENV, cwd=ROOT,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    if dashboard:
        stop.set()
        thread.join()
        counts["server_cpu_s"] = cpu_seconds(server.pid) - counts["server_cpu_s"]
        server.terminate()
        server.wait()
    return seconds, counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--models", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    alone, watched, cpu = [], [], []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.pairs):
            for dashboard in ((False, True) if i % 2 == 0 else (True, False)):
                seconds, counts = search(folder, len(alone) + len(watched), args, dashboard)
                (watched if dashboard else alone).append(seconds)
                if dashboard:
                    cpu.append(counts["server_cpu_s"] / seconds)
                print(f"{'with dashboard' if dashboard else 'alone         '}: {seconds:6.2f} s"
                      + (f"  ({counts['stamps']} polls, {counts['pages']} page loads, server "
                         f"CPU {counts['server_cpu_s']:.2f} s)" if dashboard else ""),
                      flush=True)
    ratio = statistics.median(watched) / statistics.median(alone)
    print(f"\nmedian alone {statistics.median(alone):.2f} s, with a page polling at 1 Hz "
          f"{statistics.median(watched):.2f} s: ratio {ratio:.3f} (target <= 1.05)")
    print(f"the dashboard's server used {100 * statistics.median(cpu):.2f}% of one core during "
          f"the search (median): the most it can take from the search")


if __name__ == "__main__":
    main()
