"""The machine-wide measurement lock: a worker waits while a cost is measured, a measurement
waits for the batch in flight, and a waiting measurement keeps new batches out. Separate
``MeasureLock`` objects exclude each other as separate processes do (flock locks belong to an
open file); one test uses real processes. No wall-time assertion."""
from __future__ import annotations

import multiprocessing
import threading

from retiarii.engine.jobs.measure_lock import MeasureLock, paced


def test_a_worker_waits_while_a_cost_is_measured(tmp_path):
    measurer, worker = MeasureLock(str(tmp_path)), MeasureLock(str(tmp_path))
    assert worker.try_training() and measurer.try_measuring()
    with measurer.measuring():
        assert not worker.try_training()
    assert worker.try_training()


def test_a_measurement_waits_for_the_batch_in_flight(tmp_path):
    measurer, worker = MeasureLock(str(tmp_path)), MeasureLock(str(tmp_path))
    with worker.training():
        assert not measurer.try_measuring()
        other = MeasureLock(str(tmp_path))
        with other.training():   # workers do not exclude each other
            pass
    assert measurer.try_measuring()


def test_a_waiting_measurement_keeps_new_batches_out_and_runs_between_batches(tmp_path):
    folder = str(tmp_path)
    worker, late = MeasureLock(folder), MeasureLock(folder)
    events: list[str] = []
    measured = threading.Event()

    def measure():
        with MeasureLock(folder).measuring():
            events.append("measure")
        measured.set()

    batches = paced(iter(["b1", "b2"]), worker)
    first = next(batches)               # b1 in flight: the lock is held
    events.append(first)
    thread = threading.Thread(target=measure)
    thread.start()
    while late.try_training():          # until the measurer has closed the gate
        pass
    assert not measured.is_set()        # it waits for b1
    for batch in batches:               # asking for b2 ends b1; b2 waits for the measure
        events.append(batch)
    thread.join()
    assert events == ["b1", "measure", "b2"]


def _hold(folder, started, release):
    lock = MeasureLock(folder)
    with lock.measuring():
        started.set()
        release.wait()


def test_across_processes(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    started, release = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold, args=(str(tmp_path), started, release))
    p.start()
    try:
        assert started.wait(60)
        assert not MeasureLock(str(tmp_path)).try_training()
    finally:
        release.set()
        p.join(60)
    assert MeasureLock(str(tmp_path)).try_training()


def test_a_batch_that_waits_for_a_worker_kept_out_does_not_deadlock(tmp_path):
    """Two ranks of one job: rank A's batch waits for rank B's (a gradient exchange), and B
    arrives at the gate after a measurement closed it. A measurer waiting for A's batch to
    end waited forever (seen: two test searches and a latency measurement hung together).
    It now re-opens the gate after its patience, B enters, both batches end, and it
    measures with no batch in flight."""
    folder = str(tmp_path)
    a, b = MeasureLock(folder), MeasureLock(folder)
    b_in, events, done = threading.Event(), [], threading.Event()
    measurer = MeasureLock(folder)

    def rank_a():
        with a.training():
            events.append("a in")
            b_in.wait(30)             # the gradient exchange: needs B inside its batch
            events.append("a out")

    def rank_b():
        with b.training():
            events.append("b in")
            b_in.set()
        events.append("b out")

    def measure():
        with measurer.measuring(patience=0.05, limit=30):
            events.append("measure")
        done.set()

    ta = threading.Thread(target=rank_a)
    ta.start()
    while "a in" not in events:
        pass
    tm = threading.Thread(target=measure)
    tm.start()
    while b.try_training():           # until the measurer has closed the gate
        pass
    tb = threading.Thread(target=rank_b)
    tb.start()
    for t in (ta, tb, tm):
        t.join(60)
    assert done.is_set() and b_in.is_set(), events
    assert events.index("measure") > max(events.index("a out"), events.index("b out")), events
    assert measurer.contended == 0


def test_a_batch_that_never_ends_is_measured_beside_after_the_limit(tmp_path):
    folder = str(tmp_path)
    worker, measurer = MeasureLock(folder), MeasureLock(folder)
    with worker.training():
        with measurer.measuring(patience=0.01, limit=0.1):
            assert not worker.try_training()   # the gate is still held while it times
    assert measurer.contended == 1 and worker.try_training() and measurer.try_measuring()
