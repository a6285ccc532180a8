"""The network: addresses and free ports (:mod:`.network`), and the HTTP servers of a run —
FastAPI apps with bounded start-up, request limits and keep-alive (:mod:`.http_server`).
Name resolution (how processes find each other) is :mod:`realhf.base.name_resolve`."""
