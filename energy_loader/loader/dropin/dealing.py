"""How the rest of a ``DistributedSampler``'s epoch goes to the ranks of a drop-in job.

The drop-in loader under a ``DistributedSampler``: the job's position is how far the epoch's
permutation was consumed, and a restore on any world size or batch size deals the rest
(:class:`Dealing`). Pure: tested directly against torch's own ``DistributedSampler``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


@attrs.frozen
class Dealing:
    """How the rest of one epoch of a ``DistributedSampler``'s permutation goes to the ranks.

    Positions ``offset`` to ``end`` (the length or the ``drop_last`` cut) padded as the sampler
    pads, rank ``r`` taking every ``world``-th from ``r``; ``offset=0`` is the sampler's own
    dealing. A restore onto another world or batch size deals again (docs/dropin.md).
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
