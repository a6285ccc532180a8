"""Weight senders that fail on purpose (``weight_sync=broadcast`` tests)."""

from __future__ import annotations

from realhf.impl.model.comm import weight_broadcast as wb


class HalfSender(wb.WeightSender):
    """A trainer that dies after the first bucket of weights (its pair is then aborted)."""

    def _send_data(self, group, snap):
        a, b = wb._buckets(snap.flat.numel(), snap.bucket_elems)[0]
        wb._bcast(group, snap.flat[a:b], self.timeout)
        raise RuntimeError("the trainer died")


class SlowTailSender(wb.WeightSender):
    """A trainer whose side of a transfer ends ``tail_s`` after the server has everything
    (a loaded host): the server's next pull is answered while it is still ending."""

    tail_s = 0.5

    def _transfer_on_pair(self, snap, req, nonce):
        super()._transfer_on_pair(snap, req, nonce)
        import time

        time.sleep(self.tail_s)
