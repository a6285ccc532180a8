"""``quickstart EXP --dry-run``: what a run would do, without doing any of it.

    python -m realhf.apps.quickstart ppo-math --dry-run                    # text
    python -m realhf.apps.quickstart ppo-math --dry-run --format mermaid   # for markdown

Prints the compiled dataflow graph (every MFC, and which MFC's outputs feed which), each
MFC's model, interface, type and parallel layout, the worker processes the launcher would
start (GPUs per process where CUDA is present), the memory each would need
(:mod:`realhf.apps.memory_plan`) and the resolved config as YAML.

Building an experiment only reads the model and dataset files to check them, so a dry run
launches nothing and writes nothing: no run directory, no ``config.yaml``, no name-resolve
entry.  With ``--format mermaid`` the whole output is one Mermaid document, pasteable into a
```` ```mermaid ```` block: the flowchart, then everything else as ``%%`` comments.
"""

from __future__ import annotations

import os
from typing import List, Sequence

from realhf.api.cli_parser import to_yaml
from realhf.api.core.allocation import parse_allocation_mode
from realhf.api.core.dfg import DataFlowGraph, build_graph
from realhf.api.core.system_api import ExperimentConfig
from realhf.apps import memory_plan
from realhf.base import constants

FORMATS = ("text", "mermaid")

#: an interface argument whose repr is longer than this shows as its type name
SHORT_ARG = 40

#: what each worker type does, for the placement table
WORKER_ROLES = {
    "generation_server": "generation server",
    "gserver_manager": "routes rollouts to the servers, pushes new weights to them",
    "rollout_worker": "agent + environment: rolls out prompts, streams trajectories",
    "model_worker": "trainer",
    "master_worker": "runs the dataflow graph, one step after another",
}

_STREAM_NOTE = [
    "generation runs on the generation servers, outside the graph: its 'dataset' keys are",
    "the trajectories the rollout workers stream to the trainer",
]


def describe(
    name: str, cfg, exp: ExperimentConfig, fmt: str = "text", chosen: Sequence[str] = ()
) -> str:
    """The dry-run report of quickstart experiment ``name``: ``cfg`` compiled into ``exp``
    (``chosen``: what :func:`~realhf.apps.memory_plan.choose_unset` set)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; use one of {FORMATS}")
    master = exp.workers["master_worker"][0]
    graph = build_graph(master.mfcs)
    details = [
        *_mfc_table(master),
        "",
        *_placement(name, cfg, exp),
        "",
        *memory_plan.report(memory_plan.estimate(cfg, exp), memory_plan.available_memory()),
        *(f"  chosen: {note}" for note in chosen),
        "",
        "# resolved config (config.yaml)",
        *to_yaml(cfg).rstrip().splitlines(),
    ]
    note = _STREAM_NOTE if "rollout_worker" in exp.workers else []
    if fmt == "mermaid":
        return "\n".join([graph.to_mermaid(), *(f"%% {line}".rstrip() for line in note + details)])
    head = [f"{name}: dry run: nothing is launched or written", "", *_graph(graph), *note]
    return "\n".join(head + [""] + details)


def _graph(graph: DataFlowGraph) -> List[str]:
    """The edges (``parent -> child (keys)``), then the graph's own listing by level."""
    edges = [(f"{p} -> {c}", f"({', '.join(keys)})") for (p, c), keys in graph.edges.items()]
    head = f"dataflow graph: {len(graph.mfcs)} MFC(s), {len(edges)} edge(s)"
    return [head, *(_table(edges) if edges else []), *graph.to_text().splitlines()]


def _mfc_table(master) -> List[str]:
    """One row per MFC: model, call type, parallel layout, interface."""
    base, places = master.layout, master.placements
    rows = [("MFC", "model", "type", "layout", "interface")]
    for m in master.mfcs:
        layout = str(places.of_mfc(m.name, base))
        if m.name in places.weightless:
            layout += " (no weights)"
        elif places.on_replica(m, base):
            layout += f" (replica; home {places.home(m.role, base)})"
        impl = m.interface_impl
        args = ", ".join(f"{k}={_short(v)}" for k, v in impl.args.items())
        rows.append(
            (m.name, str(m.model_name), m.interface_type.value, layout, f"{impl.type_}({args})")
        )
    return ["model function calls:", *_table(rows)]


def _placement(name: str, cfg, exp: ExperimentConfig) -> List[str]:
    """The processes the launcher would start, GPUs each, and where the run would write."""
    import torch

    alloc = parse_allocation_mode(cfg.allocation_mode)
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    where = (
        f"{alloc.world_size} of {cuda} CUDA device(s)" if cuda else "no CUDA: every process on CPU"
    )
    rows = [("worker", "processes", "GPUs each", "role")]
    for t in exp.ordered_types:
        workers = exp.workers[t]
        role = WORKER_ROLES.get(t, "")
        if t == "model_worker":
            role += f", layout {workers[0].layout}"
        if t == "generation_server":
            backend = getattr(workers[0].backend, "value", workers[0].backend)
            role += f" ({backend} engine, layout {alloc.gen_backend}.{alloc.gen})"
        rows.append((t, str(len(workers)), str(exp.scheduling_of(t).gpu), role))
    rows.append(("controller", "1", "0", "configures, starts and watches the workers"))
    fileroot = os.path.abspath(os.path.expanduser(cfg.fileroot or constants.get_fileroot()))
    run_dir = os.path.join(fileroot, cfg.experiment_name or name, cfg.trial_name)
    return [
        f"workers: allocation_mode={cfg.allocation_mode}, mode={cfg.mode}, {where}",
        *_table(rows),
        f"{len(exp.worker_names()) + 1} processes; run dir {run_dir} (not created)",
    ]


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= SHORT_ARG else f"{type(v).__name__}(...)"


def _table(rows: Sequence[Sequence[str]]) -> List[str]:
    """Rows as left-aligned columns, indented by two spaces."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
