"""The workers and what connects them, one sub-package per concept (imports run downward):

- ``transport/`` — ZMQ request/reply and push/pull streams, cross-process errors, the
  torch.distributed world of the model workers.
- ``worker/`` — the worker lifecycle: base class and poll loop behind a control socket,
  the controller that configures, starts, watches and stops them.
- ``rollout/`` — asynchronous RL's generation side: generation servers (and the SGLang
  launcher), the gserver manager (admission under the staleness bound, routing, weight
  pushes) with its HTTP service and client, rollout workers, partial rollouts and the
  trajectory stream to the trainer.
- ``dag/`` — the dataflow-graph executor: the master worker and its step runner, the model
  worker, the data buffer, transfer plans, local tensor store and run outputs.
"""
