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
