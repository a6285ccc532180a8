"""Asynchronous RL's generation side: generation servers, the gserver manager (admission under
the staleness bound, routing, weight pushes), rollout workers and the trajectory stream."""
