"""Rollout workflows: the worker system's agents, run by the light API's executor."""
