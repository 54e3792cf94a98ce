"""The health checks of :class:`~.ray.RayExecutor`: is the cluster still there, which actor is
hung, and which slot cannot start.

A search on Ray used to wait forever in three situations; each now ends in a decision:

- **The cluster has no live node** (the raylet SIGKILLed with its workers, as an out-of-memory
  kill does; the last node removed). An actor call then fails, first as
  ``ActorUnavailableError`` (the node may come back: the executor asks again) and, once the GCS
  has marked the node dead (about 15 s), as ``ActorDiedError``. Before reporting any job as
  lost, the executor asks :func:`cluster_loss`: with no live node it raises
  :class:`~retiarii.engine.errors.EnvironmentFailure` naming the lost nodes, and reports no
  job as failed, so no trial is charged a retry (the experiment stops; a resume retries them).
- **A hung actor** (alive, but neither a result nor the empty answer its ``events`` long poll
  gives every ``poll_wait`` seconds: stuck with the GIL held, stopped, its node unreachable):
  the actor is killed once it has been silent ``heartbeat_timeout`` seconds and handled as a
  lost worker (its job retried elsewhere), as LocalExecutor kills a worker whose heartbeats stop.
- **A slot that cannot start** (no live node has room for its actor, or its imports hang):
  after ``startup_timeout`` seconds, when no other slot is ready either, nothing can run and the
  executor raises ``EnvironmentFailure`` saying what a slot needs and what the cluster offers;
  while other slots work the search goes on with fewer (a warning says so) and the actor starts
  whenever the cluster has room again.

A lost GCS (the head's control service) is the one case left to Ray: its calls block, and
after its reconnect timeout (60 s) Ray ends the driver process itself, as a crash would; the
store is intact and ``retiarii resume`` continues (docs/ray.md).
"""
from __future__ import annotations

import logging
from typing import Any

import ray

from ..errors import EnvironmentFailure

__all__ = ["cluster_loss", "overdue", "next_deadline", "unplaceable"]

_log = logging.getLogger("retiarii.engine.ray")


def cluster_loss() -> str | None:
    """None while the cluster has a live node; else one line naming what was lost.

    Example::

        cluster_loss()   # after the only raylet was SIGKILLed and the GCS noticed:
        # 'the Ray cluster has no live node left (lost: 127.0.0.1, node 868abab4ac69)'
    """
    try:
        nodes = ray.nodes()
    except Exception as err:  # noqa: BLE001 (whatever the GCS client raises: it is unreachable)
        text = str(err).strip().splitlines()
        return (f"the Ray cluster's control service (GCS) cannot be reached ("
                f"{type(err).__name__}: {text[0] if text else ''})")
    if any(node.get("Alive") for node in nodes):
        return None
    lost = ", ".join(sorted({f"{n.get('NodeManagerAddress')}, node {str(n.get('NodeID'))[:12]}"
                             for n in nodes})) or "no node was ever seen"
    return f"the Ray cluster has no live node left (lost: {lost})"


def check_cluster(what: str) -> None:
    """Raise :class:`EnvironmentFailure` when the cluster has no live node; ``what`` says how
    the driver noticed (e.g. ``"worker ray-0 (pid 123) was lost"``)."""
    loss = cluster_loss()
    if loss is not None:
        raise EnvironmentFailure(f"{loss}: {what} and no worker can run; resume on a new Ray "
                                 "instance or cluster")


def _deadlines(slot: Any, heartbeat_timeout: float | None, startup_timeout: float) -> list:
    """(time, kind) pairs of ``slot`` (a ``ray._Slot``): ``"hung"`` when its ready actor has
    not answered by then, ``"start"`` when its actor is not ready by then."""
    if slot.actor is None:
        return []
    if not slot.ready:
        return [] if slot.start_warned else [(slot.beat + startup_timeout, "start")]
    if heartbeat_timeout is None:
        return []
    return [(slot.beat + heartbeat_timeout, "hung")]


def next_deadline(slots: list, heartbeat_timeout: float | None,
                  startup_timeout: float) -> float | None:
    """The earliest time at which :func:`overdue` may find something (None: never)."""
    return min((t for s in slots for t, _ in _deadlines(s, heartbeat_timeout, startup_timeout)),
               default=None)


def overdue(slots: list, now: float, heartbeat_timeout: float | None,
            startup_timeout: float) -> list[tuple[Any, str]]:
    """(slot, kind) of every slot past a deadline at ``now``, kind ``"hung"`` or ``"start"``."""
    return [(s, kind) for s in slots for t, kind in _deadlines(s, heartbeat_timeout,
                                                               startup_timeout) if now >= t]


def unplaceable(need: dict[str, float], startup_timeout: float) -> str:
    """The line of an ``EnvironmentFailure`` for slots none of which started in time: what a
    slot needs, what the live nodes offer."""
    try:
        total, free = ray.cluster_resources(), ray.available_resources()
    except Exception:  # noqa: BLE001 (the GCS is gone too: the need alone still helps)
        total, free = {}, {}
    need = {k: v for k, v in need.items() if v > 0}
    offer = {k: total.get(k, 0.0) for k in need}
    left = {k: free.get(k, 0.0) for k in need}
    return (f"no worker actor became ready within {startup_timeout:g} s (a slot needs {need}; "
            f"the live nodes have {offer} in all, {left} free): the nodes that could hold one "
            "were lost, or the actors' imports hang; resume on a cluster with room for a slot")
