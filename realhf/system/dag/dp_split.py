"""The data-parallel split: which items of one MFC call each data-parallel replica runs.

The master cuts the ids of a call (in buffer order) into one contiguous group per replica;
every rank of a replica gets the replica's group (:mod:`realhf.system.dag.transfer` then
brings each rank the data of its group).  Two rules, chosen by the MFC's kind:

* **equal token loads** (inference, train_step): a replica's step time grows with the
  tokens it processes, and the call finishes when its slowest replica does, so the split
  minimises the largest token sum — exactly, over all contiguous splits
  (``datapack.partition_balanced``), not greedily;
* **equal item counts** (generate): its cost grows with the answers it will write, which
  are not known yet, not with the prompt tokens that are, so balancing prompt tokens would
  balance the wrong thing.

Groups are contiguous so that items one worker loaded together stay on that worker when
possible (fewer transfers) and each group keeps the call's item order.
"""

from __future__ import annotations

from typing import List, Sequence

from realhf.base import datapack

__all__ = ["partition_for_dp"]


def partition_for_dp(
    ids: Sequence[str], tokens: Sequence[int], n_ranks: int, by_count: bool
) -> List[List[str]]:
    """Cut ``ids`` (in order) into ``n_ranks`` contiguous, non-empty groups.

    ``by_count``: sizes differ by at most one (the first groups get the extra item);
    otherwise the largest group token sum is minimal (``tokens[j]`` belongs to ``ids[j]``).
    Contiguity keeps items that one worker loaded together on that worker when possible.
    """
    ids = list(ids)
    if len(tokens) != len(ids):
        raise ValueError(f"partition_for_dp: {len(tokens)} token counts for {len(ids)} ids")
    if not isinstance(n_ranks, int) or n_ranks < 1:
        raise ValueError(f"partition_for_dp: n_ranks must be an int >= 1, got {n_ranks!r}")
    if len(ids) < n_ranks:
        raise ValueError(
            f"partition_for_dp: {len(ids)} items cannot be split over {n_ranks} data-parallel "
            "ranks (every rank needs one); raise the MFC's n_seqs / train_batch_size"
        )
    if by_count:
        base, extra = divmod(len(ids), n_ranks)
        bounds, start = [], 0
        for r in range(n_ranks):
            end = start + base + (1 if r < extra else 0)
            bounds.append((start, end))
            start = end
    else:
        bounds = datapack.partition_balanced(list(tokens), n_ranks)
    return [ids[s:e] for s, e in bounds]
