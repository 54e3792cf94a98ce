"""The compact parts of a strategy's saved state: interned traces and the generator's words.

A strategy's state is saved after every model, so what grows with the search is kept small:
a :class:`TraceTable` stores each candidate list and each trace once (many models share them)
and only ever appends, and :func:`rng_to_json` writes a ``random.Random`` as base64 words, a
tenth of the time and size of a JSON list of them, exactly.

Example::

    table = TraceTable()
    i = table.intern([("op", ["conv", "pool"])])        # 0; the same trace again: 0 again
    table.expand(i)                                     # [("op", ["conv", "pool"])]
    TraceTable(table.candidate_lists, table.traces).intern([("op", ["conv", "pool"])])  # 0
"""
from __future__ import annotations

import array
import base64
import json
import random
import sys

__all__ = ["TraceTable", "rng_from_json", "rng_to_json"]


class TraceTable:
    """Traces (``[(label, candidates), ...]``) numbered in first-seen order, each kept as
    ``[label, candidate list id]`` pairs over a table of distinct candidate lists.

    Args:
        candidate_lists, traces: a saved table's two lists (``state_dict``'s), or none for an
            empty table.
    """

    def __init__(self, candidate_lists: list | None = None, traces: list | None = None):
        self.candidate_lists: list[list] = [list(c) for c in candidate_lists or []]
        self.traces: list[list[list]] = [[[label, c] for label, c in t] for t in traces or []]
        self._candidate_ids = {json.dumps(c): i for i, c in enumerate(self.candidate_lists)}
        self._trace_ids = {json.dumps(t): i for i, t in enumerate(self.traces)}

    def intern(self, trace: list[tuple[str, list]] | None) -> int | None:
        """The number of ``trace`` (added if new); None for an unknown trace."""
        if trace is None:
            return None
        compact = []
        for label, candidates in trace:
            text = json.dumps(candidates)
            if text not in self._candidate_ids:
                self._candidate_ids[text] = len(self.candidate_lists)
                self.candidate_lists.append(list(candidates))
            compact.append([label, self._candidate_ids[text]])
        text = json.dumps(compact)
        if text not in self._trace_ids:
            self._trace_ids[text] = len(self.traces)
            self.traces.append(compact)
        return self._trace_ids[text]

    def expand(self, index: int) -> list[tuple[str, list]]:
        """The trace numbered ``index``, with its candidate lists."""
        return [(label, self.candidate_lists[c]) for label, c in self.traces[index]]


def rng_to_json(rng: random.Random) -> list:
    """``[version, base64 of the 625 state words (uint32, little-endian), gauss]``: exact, and
    a tenth of the time and size of the words as a JSON list (it is saved after every model)."""
    version, internal, gauss = rng.getstate()
    words = array.array("I", internal)  # Mersenne Twister words and position: all < 2**32
    if sys.byteorder == "big":
        words.byteswap()
    return [version, base64.b64encode(words.tobytes()).decode("ascii"), gauss]


def rng_from_json(rng: random.Random, state: list) -> None:
    """Put :func:`rng_to_json`'s ``state`` back into ``rng``."""
    words = array.array("I")
    words.frombytes(base64.b64decode(state[1]))
    if sys.byteorder == "big":
        words.byteswap()
    rng.setstate((state[0], tuple(words), state[2]))
