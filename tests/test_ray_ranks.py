"""Mixed-parallel segments on Ray: K rank actors in one placement group
(retiarii.engine.executors.ray_ranks) give what K local processes give, bit for bit on CPU;
a failing rank is named and nothing is left behind; an unplaceable group is a clear error.

One Ray instance for the file, started (and shut down) by the module's executor, ``ex``; its
2 logical CPUs hold the executor's worker actor and 2 ranks of 0.25 CPU each.
"""
from __future__ import annotations

import functools
import os
import sys
import time

import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'retiarii[ray]')")

import retiarii as rt  # noqa: E402
from retiarii.engine.jobs.job import Job, JobFailed, JobStarted, TrialTask  # noqa: E402
from retiarii.engine.executors.local import LocalExecutor  # noqa: E402
from retiarii.engine.executors.ray import RayExecutor  # noqa: E402
from retiarii.engine.executors.ray_ranks import (  # noqa: E402
    PlacementError, RankLost, remove_groups, run_segment_on_actors,
)
from retiarii.engine.worker_side.one_shot_segment import strategy_spec  # noqa: E402
from retiarii.engine.executors.local_ranks import RankError, run_segment_on_ranks  # noqa: E402
from test_one_shot_ranks import build_spos  # noqa: E402

RANK_CPUS = 0.25
WORLD = 2


@pytest.fixture(scope="module")
def ex():
    executor = RayExecutor(num_workers=1, num_cpus=RANK_CPUS, threads_per_worker=1)
    assert executor.wait_ready(timeout=300)
    yield executor
    executor.close()
    assert not ray.is_initialized()


def _equal(a, b, where="state"):
    """Nested dicts/lists/tensors equal bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _rank_processes() -> list[int]:
    """Live processes of rank actors: Ray titles an actor's process ``ray::_RankActor...``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::_RankActor"):
                        pids.append(int(entry))
            except OSError:
                continue  # gone meanwhile
    return pids


def _left_behind(prefix: str) -> tuple[list, list]:
    """(live placement groups named with ``prefix``, live rank actor processes)."""
    groups = [g for g in ray.util.placement_group_table().values()
              if (g.get("name") or "").startswith(prefix) and g.get("state") != "REMOVED"]
    return groups, _rank_processes()


def _nothing_left(prefix: str, timeout: float = 30.0) -> None:
    """No placement group of ``prefix``, no rank actor, and every CPU the ranks held free
    again (the module executor's worker aside), within ``timeout`` s: Ray frees an actor's
    resources a moment after ``ray.kill``."""
    deadline = time.monotonic() + timeout
    while True:
        groups, actors = _left_behind(prefix)
        used = ray.cluster_resources()["CPU"] - ray.available_resources().get("CPU", 0.0)
        if not groups and not actors and used <= RANK_CPUS + 1e-6:
            return
        assert time.monotonic() < deadline, (groups, actors, used)
        time.sleep(0.5)


def build_dying():
    """build_spos(0) whose rank 1's process exits without a word in its segment."""
    strategy, ctx = build_spos(0)
    run = strategy.run_segment

    def run_segment(c):
        if c.rank == 1:
            os._exit(3)
        return run(c)

    strategy.run_segment = run_segment
    return strategy, ctx


def build_failing():
    """build_spos(0) whose rank 1 raises in its segment (the others then lose their peer)."""
    strategy, ctx = build_spos(0)
    run = strategy.run_segment

    def run_segment(c):
        if c.rank == 1:
            raise ValueError("rank one broke on purpose")
        return run(c)

    strategy.run_segment = run_segment
    return strategy, ctx


@pytest.mark.slow  # rank actors and forked ranks: ~20 s on 2 busy cores
def test_actors_equal_local_ranks_bit_for_bit(ex):
    build = functools.partial(build_spos, 0)
    on_actors = run_segment_on_actors(build, None, WORLD, num_cpus=RANK_CPUS,
                                      sys_path=list(sys.path), timeout=300,
                                      group_prefix="t-equal-")
    on_ranks = run_segment_on_ranks(build, None, WORLD, timeout=300)
    (result_a, state_a), (result_r, state_r) = on_actors, on_ranks
    _equal(state_a, state_r)
    assert result_a.metrics == result_r.metrics
    assert [(m.sample, m.metrics) for m in result_a.models] == \
        [(m.sample, m.metrics) for m in result_r.models]
    _nothing_left("t-equal-")


@pytest.mark.slow  # two rank actors, and the grace the others get to report: ~14 s
def test_a_rank_that_raises_is_named_and_nothing_is_left(ex):
    with pytest.raises(RankError, match="rank 1 of 2 failed") as info:
        run_segment_on_actors(build_failing, None, WORLD, num_cpus=RANK_CPUS,
                              sys_path=list(sys.path), timeout=300, group_prefix="t-fail-")
    assert info.value.rank == 1 and "rank one broke on purpose" in info.value.traceback
    _nothing_left("t-fail-")


@pytest.mark.slow  # two rank actors, and the grace the others get to report: ~14 s
def test_a_rank_whose_actor_dies_is_named_and_retried_as_the_environment_s_fault(ex):
    from retiarii.engine.jobs.job import FailureKind
    from retiarii.engine.worker_side.worker import classify_error

    with pytest.raises(RankLost, match="rank 1 of 2 failed") as info:
        run_segment_on_actors(build_dying, None, WORLD, num_cpus=RANK_CPUS,
                              sys_path=list(sys.path), timeout=300, group_prefix="t-dies-")
    assert info.value.rank == 1 and "actor died" in info.value.traceback
    assert classify_error(info.value) is FailureKind.ENVIRONMENT
    _nothing_left("t-dies-")


def test_a_group_the_cluster_cannot_place_is_a_clear_error(ex):
    started = time.monotonic()
    with pytest.raises(PlacementError, match=r"could not place 2 ranks of \{'CPU': 64\}.*"
                                             r"within 2 s; the cluster has CPU: 2 in all"):
        run_segment_on_actors(build_spos, None, WORLD, num_cpus=64, sys_path=list(sys.path),
                              placement_timeout=2, group_prefix="t-big-")
    assert time.monotonic() - started < 60  # the timeout, not a hang
    from retiarii.engine.jobs.job import FailureKind
    from retiarii.engine.worker_side.worker import classify_error

    with pytest.raises(PlacementError) as info:  # the environment's fault: retried
        run_segment_on_actors(build_spos, None, WORLD, num_cpus=64, placement_timeout=0.5)
    assert classify_error(info.value) is FailureKind.ENVIRONMENT
    _nothing_left("t-big-")


def test_bad_arguments_are_refused_before_anything_starts(ex, monkeypatch):
    with pytest.raises(ValueError, match="world >= 1 ranks, got 0"):
        run_segment_on_actors(build_spos, None, 0)
    with pytest.raises(ValueError, match="backend='nccl' needs a whole GPU per rank"):
        run_segment_on_actors(build_spos, None, WORLD, backend="nccl", num_gpus=0.5)
    with pytest.raises(ValueError, match="num_cpus or num_gpus > 0"):
        run_segment_on_actors(build_spos, None, WORLD, num_cpus=0)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="needs a connected Ray"):
        run_segment_on_actors(build_spos, None, WORLD)


def test_remove_groups_removes_only_its_prefix(ex):
    from ray.util.placement_group import placement_group, remove_placement_group

    mine = placement_group([{"CPU": 0.01}], name="t-orphan-1")
    other = placement_group([{"CPU": 0.01}], name="t-keep-1")
    assert mine.wait(timeout_seconds=60) and other.wait(timeout_seconds=60)
    assert remove_groups("t-orphan-") == 1
    assert remove_groups() == 0
    assert not _left_behind("t-orphan-")[0] and len(_left_behind("t-keep-")[0]) == 1
    remove_placement_group(other)


def _spos_search(path, executor) -> rt.Experiment:
    from one_shot_helpers import space, trainer

    spos = rt.strategies.SPOS(train_segments=1, search_population=2, search_generations=1,
                              seed=1)
    return rt.Experiment(space, spos, trainer, store=str(path), seed=0, executor=executor,
                         ranks=WORLD)


@pytest.mark.slow  # two ranked searches, one of them on rank actors: ~60 s on 2 busy cores
def test_a_ranked_search_on_ray_equals_the_same_on_local_processes(ex, tmp_path):
    from test_one_shot_engine import _outcome

    with LocalExecutor(1, devices=[], threads_per_worker=1) as local:
        _spos_search(tmp_path / "local.db", local).run()
    with RayExecutor(1, num_cpus=RANK_CPUS, threads_per_worker=1) as on_ray:
        _spos_search(tmp_path / "ray.db", on_ray).run()
    want, got = _outcome(tmp_path / "local.db"), _outcome(tmp_path / "ray.db")
    assert want["status"] == "done" and want["models"], want
    assert got["status"] == "done", got
    assert got["result"] == want["result"]  # the same selected architecture
    assert got["models"] == want["models"] and got["segments"] == want["segments"]
    _equal(got["weights"], want["weights"], "final unit's weights")
    _nothing_left("retiarii-ranks-")


@pytest.mark.slow  # two rank actors start, then are stopped: ~10 s on 2 busy cores
def test_cancel_stops_the_rank_actors_of_a_running_segment(ex, tmp_path):
    from one_shot_helpers import PerArchitecture

    helpers = os.path.join(os.path.dirname(os.path.abspath(__file__)), "one_shot_helpers.py")
    # every rank sleeps 300 s in its segment: the job is surely running when it is cancelled
    spec = {"space": f"{helpers}:space", "trainer": f"{helpers}:trainer", "hparams": {},
            "seed": 0, "strategy": strategy_spec(PerArchitecture(epochs=1, sleep_s=300)),
            "segments": 1, "ranks": WORLD}
    task = TrialTask("ranked", spec, 0, 1, None, str(tmp_path / "unit.pt"))
    ex.submit(Job("ranked-s1", [task], meta={"one_shot": True}))
    assert isinstance(ex.next_event(timeout=120), JobStarted)
    deadline = time.monotonic() + 120
    while len(_rank_processes()) < WORLD:  # the worker actor started its rank actors
        assert time.monotonic() < deadline, "the rank actors never started"
        time.sleep(0.2)
    assert len(_left_behind("retiarii-ranks-")[0]) == 1  # their placement group
    ex.cancel("ranked-s1")
    event = ex.next_event(timeout=5)
    assert isinstance(event, JobFailed) and event.error == "cancelled"
    _nothing_left("retiarii-ranks-")
    assert ex.wait_ready(timeout=120)  # the slot has a new worker actor


@pytest.mark.slow  # a Ray instance of its own, rank actors per segment: ~45 s on 2 busy cores
def test_the_benchmark_runs_quick():
    import subprocess

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks", "ray_ranks.py")
    out = subprocess.run([sys.executable, script, "--quick"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "cpu K=2 2 segments: local ranks" in out.stdout, out.stdout
    assert "same selection: True" in out.stdout and "ray_ranks-quick.csv" in out.stdout


def test_a_private_instance_is_sized_for_each_slot_and_its_ranks(monkeypatch):
    import retiarii.engine.executors.ray as module

    asked = {}

    def start(num_cpus, num_gpus=None):
        asked["cpus"] = num_cpus
        raise RuntimeError("stop here")  # nothing is started

    monkeypatch.setattr(module, "start_local_ray", start)
    monkeypatch.setattr(module.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(module.os, "cpu_count", lambda: 1)
    with pytest.raises(RuntimeError, match="stop here"):
        RayExecutor(2, num_cpus=1, ranks=3).wait_ready(timeout=0)
    assert asked["cpus"] == 8  # 2 slots x (the worker + 3 ranks) x 1 CPU
    with pytest.raises(RuntimeError, match="stop here"):
        RayExecutor(2, num_cpus=1).wait_ready(timeout=0)
    assert asked["cpus"] == 2
    with pytest.raises(ValueError, match="ranks must be an int >= 1, got 0"):
        RayExecutor(1, ranks=0)


@pytest.mark.slow  # rank actors and forked ranks, a split super-graph: ~25 s on 2 busy cores
def test_a_split_super_graph_on_actors_equals_local_ranks(ex):
    from test_split_supergraph import LINEAR
    from test_split_supergraph import build as build_split

    build = functools.partial(build_split, 0, 3 * LINEAR)  # device_memory: a split
    on_actors = run_segment_on_actors(build, None, WORLD, num_cpus=RANK_CPUS,
                                      sys_path=list(sys.path), timeout=300,
                                      group_prefix="t-split-")
    on_ranks = run_segment_on_ranks(build, None, WORLD, timeout=300)
    (result_a, state_a), (result_r, state_r) = on_actors, on_ranks
    assert result_a.metrics == result_r.metrics and result_a.metrics["split"] == 1
    _equal(state_a, state_r)
    _nothing_left("t-split-")


@pytest.mark.slow  # two segments on two rank actors, and the same locally: ~25 s
def test_a_worker_keeps_its_rank_actors_between_the_segments_of_a_search(ex, monkeypatch):
    from retiarii.engine.executors.ray_ranks import RankGroup
    from retiarii.engine.executors.ray_worker import WorkerActor

    starts = []
    start = RankGroup._start
    monkeypatch.setattr(RankGroup, "_start", lambda self: (starts.append(1), start(self)))
    worker = WorkerActor("t-keep", 1, list(sys.path),
                         {"num_cpus": RANK_CPUS, "group_prefix": "t-kept-"})
    try:
        first = worker._run_ranks(functools.partial(build_spos, 0), None, WORLD, keep=True)
        groups, actors = _left_behind("t-kept-")
        assert len(groups) == 1 and len(actors) == WORLD  # kept for the next segment
        second = worker._run_ranks(functools.partial(build_spos, 1), first[1], WORLD,
                                   keep=False)
        assert len(starts) == 1  # the second segment ran on the kept actors
        _nothing_left("t-kept-")  # the search's last segment: closed
    finally:
        for group in worker._groups.values():
            group.close()
    local = run_segment_on_ranks(functools.partial(build_spos, 0), None, WORLD, timeout=300)
    local = run_segment_on_ranks(functools.partial(build_spos, 1), local[1], WORLD, timeout=300)
    _equal(second[1], local[1])
    assert [(m.sample, m.metrics) for m in second[0].models] == \
        [(m.sample, m.metrics) for m in local[0].models]
