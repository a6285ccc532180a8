"""The gserver manager: one per asynchronous run, between the rollout workers and the servers.

- :mod:`.state` — :class:`~.state.GserverManager`, the logic and its state: admission under
  the staleness bound, leases of rollout workers, held hand-offs, lost deliveries;
- :mod:`.server_pool` — the generation servers: discovery, health, load, weight updates;
- :mod:`.routing` — which server gets the next chunk (the routing policies);
- :mod:`.service` — the HTTP face of the state (FastAPI, validated wire messages);
- :mod:`.client` — what rollout workers call it with;
- :mod:`.worker` — the ``gserver_manager`` worker that runs the service and pushes weights.

The weight-update protocol the pool runs is :mod:`realhf.impl.model.gen.weight_update`.
"""
