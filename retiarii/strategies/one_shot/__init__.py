"""One-shot (weight-sharing) strategies, their interface and their training machinery.

The package keeps the name of the module that held the interface before: ``from
retiarii.strategies.one_shot import OneShot`` and stored references such as
``retiarii.strategies.one_shot:OneShot`` still resolve."""
from .base import EvaluatedModel, OneShot, SegmentContext, SegmentResult

__all__ = ["EvaluatedModel", "OneShot", "SegmentContext", "SegmentResult"]
