"""Interfaces of the light API: engines, workflows and their configs."""
