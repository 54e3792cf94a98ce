"""retiarii: exploratory training of neural-network model spaces.

The public API: trace a PyTorch model into the graph IR, define a space with mutators, pick a
strategy, run an experiment. See README.md and docs/.
"""
from .graph import Graph, GraphError, Node, Operation
from .modspec import leaf
from .trace import TraceError, trace

__version__ = "0.1.0"

__all__ = ["Graph", "GraphError", "Node", "Operation", "TraceError", "leaf", "trace"]
