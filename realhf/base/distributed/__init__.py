"""Processes working together: the data/pipe/tensor topology of a layout (:mod:`.topology`),
process groups with bounded waits (:mod:`.proc_group`) and torch.distributed helpers
(:mod:`.dist_util`)."""
