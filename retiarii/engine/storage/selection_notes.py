"""Whether a one-shot search's selection means anything: better than chance, and not one of a
tie. ``retiarii run``/``status`` print what :func:`selection_warnings` says (a Once-for-All run
whose 24 candidates all scored 0.0919 on digits, below the 0.1 of guessing, picked one in
silence); the experiment's summary keeps it under ``one_shot["warnings"]``.

Example::

    >>> best = [{"sample": {"k": 3}, "value": 0.0919}, {"sample": {"k": 5}, "value": 0.0919}]
    >>> chance = {"metric": "val_acc", "value": 0.1, "n": 360, "how": "one class of 10"}
    >>> [w.split(":")[0] for w in selection_warnings(best, 0.0919, chance, "val_acc", "max")]
    ['not better than chance', 'a tie']
"""
from __future__ import annotations

import math

from ...enums import Mode

__all__ = ["TIE_TOLERANCE", "selection_warnings"]

# Values within this much of the best (times max(1, |best|)) tie: far below one example of a
# validation set of thousands (1/5000 = 2e-4), so only genuinely equal scores are flagged.
TIE_TOLERANCE = 1e-4


def _chance_threshold(chance: dict) -> tuple[float, float]:
    """(chance, the value an accuracy must pass to be better than it): two binomial standard
    errors above chance on ``n`` validation examples (a coin's luck on that many)."""
    p, n = float(chance["value"]), chance.get("n")
    se = math.sqrt(p * (1 - p) / n) if n and 0 <= p <= 1 else 0.0
    return p, p + 2 * se


def selection_warnings(candidates: list[dict], selected_value: float | None,
                       chance: dict | None, metric: str, mode: Mode | str) -> list[str]:
    """What is wrong with a selection, in words (empty: nothing).

    Args:
        candidates: every architecture evaluated, once each (``{"sample", "value"}``; see
            :meth:`~.segments.SegmentTable.best`), best first.
        selected_value: the selected architecture's ``metric`` (None: not evaluated; the
            best candidate's is judged instead).
        chance: ``metric`` at chance on the validation data (:meth:`Trainer.chance_level`),
            or None when the trainer cannot say.
        metric, mode: the search's metric and which way is better.
    """
    sign = Mode.parse(mode).sign
    values = [c["value"] for c in candidates if c.get("value") is not None]
    if selected_value is None and values:
        selected_value = max(values, key=lambda v: sign * v)
    if selected_value is None:
        return []
    out = []
    if chance is not None and chance.get("metric") == metric and sign > 0:
        p, threshold = _chance_threshold(chance)
        if selected_value <= threshold:
            out.append(f"not better than chance: the selected architecture's {metric} "
                       f"{selected_value:.4f} is within two standard errors of chance "
                       f"({p:.4f}: {chance.get('how', 'guessing')}); the shared weights did "
                       f"not learn to tell architectures apart: train longer (--epochs), "
                       f"change the learning rate, or check the data")
    best = max(values, key=lambda v: sign * v)
    tolerance = TIE_TOLERANCE * max(1.0, abs(best))
    tied = [v for v in values if abs(v - best) <= tolerance]
    if len(tied) > 1 and abs(selected_value - best) <= tolerance:
        out.append(f"a tie: {len(tied)} of the {len(values)} architectures evaluated score "
                   f"{metric} {best:.4f} (within {tolerance:g}), so the one selected is "
                   f"arbitrary among them: evaluate on more validation batches or train "
                   f"longer to separate them")
    return out
