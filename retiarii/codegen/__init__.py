"""Graph IR -> runnable ``nn.Module`` (through torch.fx) and -> standalone source (through libcst).

Two backends, one file each: :mod:`.fx_backend` (:func:`to_module`) and :mod:`.source_backend`
(:func:`to_source`); ``retiarii.codegen`` keeps both names.

``to_module`` installs one module per module attribute path (creating the intermediate
containers, so state-dict keys equal the traced model's), then emits an ``fx.Graph`` with the
nodes in the graph's topological order, which for a traced graph is the original execution
order: outputs are bit-identical to the original model's on CPU.

``to_source`` writes the same model as one readable class that imports only torch; the source
of the user's own leaf modules (and what they use) is copied in before it (``inline.py``).
"""
from .fx_backend import to_module

__all__ = ["to_module", "to_source"]


def to_source(*args, **kwargs) -> str:
    """:func:`.source_backend.to_source`, imported on first use: libcst costs 0.3-0.7 s to
    import, which every worker process and every ``import retiarii`` paid though only an
    export writes source (issue #26 item 4, fixed costs)."""
    from .source_backend import to_source as emit

    return emit(*args, **kwargs)
