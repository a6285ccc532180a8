"""Weight senders that fail on purpose (``weight_sync=broadcast`` tests)."""

from __future__ import annotations

from realhf.impl.model.comm import weight_broadcast as wb


class HalfSender(wb.WeightSender):
    """A trainer that dies after the first bucket of weights (its pair is then aborted)."""

    def _send_data(self, group, snap):
        a, b = wb._buckets(snap.flat.numel(), snap.bucket_elems)[0]
        wb._bcast(group, snap.flat[a:b], self.timeout)
        raise RuntimeError("the trainer died")
