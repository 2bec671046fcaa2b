"""How the rest of a ``DistributedSampler``'s epoch goes to the ranks of a drop-in job.

The drop-in loader under a ``DistributedSampler``: the job's position is how far the epoch's
permutation was consumed, and a restore on any world size or batch size deals the rest
(:class:`Dealing`). Pure: tested directly against torch's own ``DistributedSampler``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

__all__ = ["Dealing"]


@attrs.frozen
class Dealing:
    """How the rest of one epoch of a ``DistributedSampler``'s permutation goes to the ranks.

    The ranks of a DDP job advance in lockstep, each taking every ``world``-th index of the
    dealt list, so after each rank took ``consumed`` indices the job has used the first
    ``consumed x world`` positions: the job's position is one number, whichever rank saved it.
    A dealing is the permutation's positions ``offset`` to ``end`` (``end``: the dataset's
    length, or the ``drop_last`` cut), padded by repeating from their start to a multiple of
    ``world`` as ``DistributedSampler`` pads, rank ``r`` taking every ``world``-th from ``r``.
    ``offset=0`` is exactly ``DistributedSampler``'s own dealing. A restore onto another world
    size or batch size continues with a new dealing from the position reached: nothing lost,
    nothing repeated but the padding.
    """

    offset: int
    end: int
    world: int

    def position(self, consumed: int) -> int:
        """The job's position in the permutation once every rank took ``consumed`` indices."""
        return min(self.offset + consumed * self.world, self.end)

    def per_rank(self) -> int:
        """How many indices each rank takes from this dealing."""
        return -(-max(0, self.end - self.offset) // self.world)

    def continued(self, consumed: int, world: int) -> Dealing:
        """The dealing of the rest over ``world`` ranks, after ``consumed`` per rank."""
        return Dealing(self.position(consumed), self.end, world)

    def indices(self, permutation: Sequence[int], rank: int) -> list[int]:
        """Rank ``rank``'s indices, in order."""
        rest = list(permutation[self.offset : self.end])
        if not rest:
            return []
        total = self.per_rank() * self.world
        padded = (rest * (total // len(rest) + 1))[:total]
        return padded[rank :: self.world]
