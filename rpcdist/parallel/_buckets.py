"""DDP's bucket plan: which parameters share one all-reduce, in which order.

Pure: no arrays, no collectives. The plan is a function of the parameters'
sizes, kinds (dtype and device) and order alone, so every rank of a group
computes the same plan from the same model, which the construction-time
model check guarantees.

Gradients become ready roughly in reverse order of ``parameters()`` (the
last layer's first), so the plan walks the parameters backwards and fills
one open bucket per kind, closing a bucket once it holds ``cap`` bytes.
The first bucket of the plan gets a small cap (1 MiB, as PyTorch does) so
the first all-reduce starts early in the backward pass; the others get
``bucket_cap_mb``. Buckets are numbered in the order they close, which is
the order they are reduced in on every rank.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["FIRST_BUCKET_BYTES", "BucketPlan", "ParamSpec", "plan_buckets"]

#: Cap of the first bucket: small, so that communication starts early.
FIRST_BUCKET_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """What the plan needs to know about one parameter.

    Attributes:
        numel: Number of elements.
        itemsize: Bytes per element.
        kind: Parameters of different kinds (dtype, device) never share a bucket.
    """

    numel: int
    itemsize: int
    kind: Hashable


@dataclass(frozen=True, slots=True)
class BucketPlan:
    """One bucket: parameter indices (into the planned sequence) and their offsets.

    Attributes:
        params: Indices of its parameters, in the order they expect gradients.
        offsets: Element offset of each parameter in the bucket's flat buffer.
        numel: Elements in the flat buffer.
        kind: The parameters' common kind.
    """

    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    kind: Hashable


def plan_buckets(
    specs: Sequence[ParamSpec],
    cap_bytes: int,
    first_cap_bytes: int = FIRST_BUCKET_BYTES,
) -> list[BucketPlan]:
    """Group parameters into buckets (see the module docstring).

    Args:
        specs: The parameters in ``parameters()`` order.
        cap_bytes: Bytes after which a bucket is closed (``bucket_cap_mb``).
        first_cap_bytes: The same for the first bucket (capped by ``cap_bytes``).

    Returns:
        The buckets in reduction order; every parameter is in exactly one.

    Raises:
        ValueError: a cap is not positive.
    """
    if cap_bytes <= 0 or first_cap_bytes <= 0:
        raise ValueError(f"bucket caps must be positive, got {cap_bytes} and {first_cap_bytes}")
    first_cap = min(first_cap_bytes, cap_bytes)
    open_: dict[Hashable, list[int]] = {}
    filled: dict[Hashable, int] = {}
    closed: list[list[int]] = []

    def cap() -> int:
        return first_cap if not closed else cap_bytes

    for i in reversed(range(len(specs))):
        s = specs[i]
        members = open_.setdefault(s.kind, [])
        members.append(i)
        filled[s.kind] = filled.get(s.kind, 0) + s.numel * s.itemsize
        if filled[s.kind] >= cap():
            closed.append(members)
            del open_[s.kind]
            del filled[s.kind]
    # Still-open buckets close at the end, the one whose first member is
    # expected first going first.
    closed.extend(sorted(open_.values(), key=lambda m: -m[0]))
    plans = []
    for members in closed:
        offsets, n = [], 0
        for i in members:
            offsets.append(n)
            n += specs[i].numel
        plans.append(BucketPlan(tuple(members), tuple(offsets), n, specs[members[0]].kind))
    return plans
