"""A distributed sampler that survives a change of world size mid-epoch.

An epoch's order is one permutation of the dataset's indices, the same on
every rank for one seed and epoch. The ranks of a *segment* (a stretch of
the epoch at one world size) deal that order out round-robin: rank ``r`` of
``W`` takes positions ``start + r``, ``start + r + W``, ... When every rank
has taken ``n`` samples, exactly the positions ``start .. start + n * W``
have been seen, whoever saw them. So when the world changes after ``n``
samples per rank, the new segment starts at ``start + n * W`` and deals the
rest of the order to the new ranks: within an epoch no sample is lost and
none is seen twice (padding aside, which only ever repeats from the front
of the order to even out the last round, as PyTorch's sampler pads).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import numpy as np

from .._errors import ConfigError

__all__ = ["DistributedSampler"]


def _world_from_env(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    def env(name: str) -> int:
        text = os.environ.get(name)
        if text is None:
            raise ConfigError(
                f"DistributedSampler: pass num_replicas and rank, or run under the launcher "
                f"(the environment has no {name})"
            )
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"DistributedSampler: {name}={text!r} is not an integer") from None

    world = num_replicas if num_replicas is not None else env("WORLD_SIZE")
    me = rank if rank is not None else env("RANK")
    return world, me


def _check_world(num_replicas: int, rank: int) -> None:
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ConfigError(f"DistributedSampler: num_replicas must be >= 1, got {num_replicas!r}")
    if not isinstance(rank, int) or not 0 <= rank < num_replicas:
        raise ConfigError(
            f"DistributedSampler: rank must be in [0, {num_replicas - 1}], got {rank!r}"
        )


class DistributedSampler:
    """The indices of ``dataset`` this rank visits in an epoch.

    PyTorch's ``DistributedSampler`` semantics: every rank gets the same
    number of samples; without ``drop_last`` the order is padded by wrapping
    around to its front, with it the tail that does not divide evenly is
    dropped; with ``shuffle`` the order is a permutation seeded by
    ``seed + epoch`` (call :meth:`set_epoch` before each epoch), the same on
    every rank. The order itself comes from NumPy's PCG64 generator, so it
    differs from PyTorch's for the same seed.

    Beyond PyTorch's: :meth:`reshard` moves the sampler to a new world size
    or rank mid-epoch, dealing out only the samples no rank has seen yet, and
    :meth:`state_dict`/:meth:`load_state_dict` carry the position to a
    replacement rank.

    Args:
        dataset: Anything with ``len()``, or the number of samples.
        num_replicas: The world size (default: ``WORLD_SIZE`` from the
            environment, as the launcher sets it).
        rank: This rank (default: ``RANK`` from the environment).
        shuffle: Permute the indices each epoch.
        seed: The permutation's seed; the same on every rank.
        drop_last: Drop the uneven tail instead of padding.

    Raises:
        ConfigError: a bad rank, world size or dataset.
    """

    def __init__(
        self,
        dataset: Sized | int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if isinstance(dataset, bool) or not isinstance(dataset, int | Sized):
            raise ConfigError(
                "DistributedSampler: dataset must have len() or be an int, "
                f"got {type(dataset).__name__}"
            )
        size = dataset if isinstance(dataset, int) else len(dataset)
        if size < 0:
            raise ConfigError(f"DistributedSampler: a dataset of {size} samples")
        world, me = _world_from_env(num_replicas, rank)
        _check_world(world, me)
        self.dataset_size = size
        self.num_replicas = world
        self.rank = me
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        #: Positions of the epoch's order seen before the current segment.
        self._start = 0
        #: Samples per rank this segment's iteration starts after (a resume point).
        self._resume = 0
        #: Samples this rank has taken in the current segment.
        self._taken = 0

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new order (when shuffling), from its beginning."""
        self.epoch = int(epoch)
        self._start = self._resume = self._taken = 0

    # -- the order and this rank's share --------------------------------------------

    def _order(self) -> np.ndarray:
        if self.shuffle:
            rng = np.random.Generator(np.random.PCG64(self.seed + self.epoch))
            return rng.permutation(self.dataset_size)
        return np.arange(self.dataset_size)

    def _per_rank(self) -> int:
        """Samples each rank takes in the current segment."""
        left = max(self.dataset_size - self._start, 0)
        if self.drop_last:
            return left // self.num_replicas
        return math.ceil(left / self.num_replicas)

    def _indices(self) -> np.ndarray:
        """This rank's whole share of the current segment."""
        rest = self._order()[self._start :]
        total = self._per_rank() * self.num_replicas
        if total > len(rest) and len(rest):  # pad by wrapping around (PyTorch's way)
            rest = np.resize(rest, total)
        return rest[self.rank : total : self.num_replicas]

    def __len__(self) -> int:
        return self._per_rank() - self._resume

    def __iter__(self) -> Iterator[int]:
        _check_world(self.num_replicas, self.rank)
        share = self._indices()
        self._taken = self._resume
        for index in share[self._resume :]:
            self._taken += 1
            yield int(index)

    # -- a changing world -----------------------------------------------------------

    def reshard(self, num_replicas: int, rank: int, consumed: int | None = None) -> None:
        """Go on at a new world size (or rank) from the samples not yet seen.

        Every rank of the old world must have taken the same number of
        samples, ``consumed`` (by default the number this sampler's iterator
        has yielded in the segment); the new world's ranks call this with
        the same ``consumed`` and their new rank. The next iteration yields
        this rank's share of the samples after those.

        Raises:
            ConfigError: a bad rank or world size, or ``consumed`` out of range.
        """
        _check_world(num_replicas, rank)
        taken = self._taken if consumed is None else int(consumed)
        if not 0 <= taken <= self._per_rank():
            raise ConfigError(
                f"DistributedSampler.reshard: consumed={taken} is outside this segment's "
                f"0..{self._per_rank()} samples per rank"
            )
        self._start = min(self._start + taken * self.num_replicas, self.dataset_size)
        self.num_replicas, self.rank = num_replicas, rank
        self._resume = self._taken = 0

    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch, to give a replacement rank (plain ints)."""
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "dataset_size": self.dataset_size,
            "start": self._start,
            "num_replicas": self.num_replicas,
            "taken": self._taken,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume where ``state`` (another rank's :meth:`state_dict`) left off,
        at that state's world size and this sampler's rank. A replacement
        whose rank lies outside that world calls :meth:`reshard` next, to go
        on at the new world size.

        Raises:
            ConfigError: the state is for another dataset size or seed, or
                this rank is outside its world.
        """
        for key, mine in (("dataset_size", self.dataset_size), ("seed", self.seed)):
            if int(state[key]) != mine:
                raise ConfigError(
                    f"DistributedSampler.load_state_dict: the state's {key} is "
                    f"{state[key]}, this sampler's {mine}"
                )
        world = int(state["num_replicas"])
        _check_world(world, 0)
        self.epoch = int(state["epoch"])
        self._start = int(state["start"])
        self.num_replicas = world
        self._resume = self._taken = int(state["taken"])
