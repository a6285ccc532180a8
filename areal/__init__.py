"""The light API: one SPMD training script instead of an experiment of workers.

A script (``examples/lite/grpo_tiny.py``) holds a train engine
(:class:`areal.api.engine_api.TrainEngine`), a remote inference engine that talks to the
generation servers over HTTP (:class:`areal.engine.remote.RemoteInferenceEngine`) and a
rollout workflow (:class:`areal.api.workflow_api.RolloutWorkflow`) that a
:class:`~areal.api.workflow_api.WorkflowExecutor` keeps running in the background, under
the same exact staleness bound as the worker system.  It is launched with ``torchrun``.

``areal`` sits above ``realhf`` and imports it; ``realhf`` never imports ``areal``.  No
algorithm, staleness rule, verifier or generation client is written twice: the PPO loss is
``ppo_actor``'s, admission is :class:`realhf.system.rollout.staleness.StalenessController`,
generation is :class:`realhf.system.rollout.partial_rollout.PartialRolloutManager`, and the
workflows wrap the worker system's agents.
"""
