"""Cost models: map a batch shape to a step time. See base.py for the interface."""

from lab.costmodel.base import BatchShape, CostModel

__all__ = ["BatchShape", "CostModel"]
