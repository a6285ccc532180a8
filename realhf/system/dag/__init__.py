"""The dataflow-graph executor: master worker and step runner, model workers, the data buffer,
transfer plans between data-parallel ranks, and the run's outputs."""
