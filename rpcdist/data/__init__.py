"""Data loading helpers for distributed training.

``DistributedSampler`` gives each rank its share of a dataset's indices per
epoch, with PyTorch's semantics, and re-deals the samples not yet seen when
the world changes mid-epoch.
"""

from __future__ import annotations

from .._publish import publish
from ._sampler import DistributedSampler

__all__ = ["DistributedSampler"]

publish(__name__, __all__, globals())
