"""Cost models: map a batch shape (lab/core/batch.py) to a step time. See base.py for the interface."""

from lab.costmodel.base import CostModel, CostModelBase

__all__ = ["CostModel", "CostModelBase"]
