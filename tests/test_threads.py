"""retiarii.threads.one_thread, and the driver's shape checks running under it (a one-sample
shape check on a loaded machine otherwise waits for cores the workers hold)."""
import pytest
import torch

import retiarii as rt
import retiarii.space
from exp_space import space, trainer
from retiarii.engine.executors.simulated import SimulatedExecutor
from retiarii.threads import one_thread


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_one_thread_sets_one_and_restores_the_count(two_threads):
    with one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(KeyError), one_thread():
        raise KeyError("the block fails")
    assert torch.get_num_threads() == 2  # restored on the way out of a failure too


def test_the_driver_checks_shapes_on_one_thread(tmp_path, monkeypatch, two_threads):
    seen = []
    propagate = retiarii.space.propagate

    def recording(model, example):
        seen.append(torch.get_num_threads())
        return propagate(model, example)

    monkeypatch.setattr(retiarii.space, "propagate", recording)
    exp = rt.Experiment(space, rt.strategies.Random(seed=0), trainer,
                        store=str(tmp_path / "threads.db"),
                        executor=SimulatedExecutor(2, lambda spec, step: {"val_acc": 0.5}))
    exp.run(max_models=4)
    assert len(seen) >= 4 and set(seen) == {1}  # every proposal's check, one thread each
    assert torch.get_num_threads() == 2  # the driver's own setting is back


def test_idle_cores_leaves_out_the_cores_other_processes_keep_busy(monkeypatch):
    import retiarii.threads as threads

    for load, cores, idle in ((0.0, 4, 4), (1.2, 4, 3), (8.6, 2, 1), (3.0, 2, 1), (0.4, 1, 1)):
        monkeypatch.setattr(threads.os, "getloadavg", lambda load=load: (load, load, load))
        assert threads.idle_cores(cores) == idle, (load, cores)

    def unsupported():
        raise OSError("no load average here")

    monkeypatch.setattr(threads.os, "getloadavg", unsupported)
    assert threads.idle_cores(3) == 3  # unknown load: all of them


def test_a_local_worker_on_a_loaded_machine_gets_one_thread(monkeypatch):
    """The oneshot row's one worker took 2 threads on a 2-core machine at load 9 and ran
    5-40x slower than on one (retiarii/threads.py): the default now counts busy cores."""
    import retiarii.threads as threads
    from retiarii.engine.executors.local import LocalExecutor

    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    with LocalExecutor(1, devices=[]) as loaded:
        assert loaded.threads == 1
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    with LocalExecutor(1, devices=[]) as idle:
        assert idle.threads == 4  # an idle machine: every core, as before
    with LocalExecutor(2, devices=[]) as shared:
        assert shared.threads == 2
