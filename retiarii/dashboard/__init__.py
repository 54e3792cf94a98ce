"""A live web dashboard over a run's store (``retiarii dashboard DB``): read-only, standard
library server, Plotly charts, Graphviz drawings; docs/dashboard.md describes every page."""
from .server import Dashboard

__all__ = ["Dashboard"]
