"""The dataflow graph of an experiment: model function calls (MFCs) linked by data keys.

An MFC is data, not code: which model (role + replica) runs which interface method
(generate / inference / train_step) on how many items, reading which keys and writing which.
:func:`build_graph` infers the edges: the MFC that writes ``packed_logprobs`` precedes every
MFC that reads it, and keys that no MFC writes come from the dataset.  Sync PPO::

    actor_gen -> {ref_inf, rew_inf, critic_inf} -> {actor_train, critic_train}

The master worker walks this graph; ``to_text`` / ``to_dot`` / ``to_mermaid`` show it.

Key remapping: ``input_keys`` / ``output_keys`` are the names in the master's data buffer.
``input_key_remap`` renames buffer keys to the names the interface expects before the call
(``{"packed_ref_logprobs": "logprobs"}``); ``output_key_remap`` renames what the interface
returns to buffer names after it (``{"logprobs": "packed_ref_logprobs"}``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from realhf.api.core.registry import InterfaceAbstraction

__all__ = ["DFGError", "ModelName", "ModelInterfaceType", "MFCDef", "DataFlowGraph", "build_graph"]


class DFGError(ValueError):
    """An invalid MFC or graph (cycle, double producer, bad names); the message says which."""


@dataclasses.dataclass(frozen=True, order=True)
class ModelName:
    """A model role (``actor``, ``critic``, ``ref``, ``reward``) and its replica id.

    Replicas of a role share weights but may run in different parallel layouts (e.g. the
    actor trains in one layout and generates in another).  Replica ids of a role are 0..k-1.
    """

    role: str
    replica_id: int = 0

    def __post_init__(self):
        if not isinstance(self.role, str) or not self.role:
            raise DFGError(f"ModelName.role must be a non-empty string, got {self.role!r}")
        if "@" in self.role:
            # '@' separates the fields of model-shard names ("actor@pp0@tp0@dp0").
            raise DFGError(f"ModelName.role {self.role!r} may not contain '@'")
        if (
            not isinstance(self.replica_id, int)
            or isinstance(self.replica_id, bool)
            or self.replica_id < 0
        ):
            raise DFGError(
                f"ModelName({self.role!r}).replica_id must be an integer >= 0, "
                f"got {self.replica_id!r}"
            )

    def __str__(self) -> str:
        return self.role if self.replica_id == 0 else f"{self.role}[{self.replica_id}]"


class ModelInterfaceType(enum.Enum):
    """Which :class:`~realhf.api.core.model_api.ModelInterface` method an MFC calls."""

    GENERATE = "generate"
    INFERENCE = "inference"
    TRAIN_STEP = "train_step"


def _mb_spec_default():
    from realhf.api.core.data_api import MicroBatchSpec

    return MicroBatchSpec()


def _key_tuple(mfc: str, field: str, keys: Any) -> Tuple[str, ...]:
    if isinstance(keys, str):
        raise DFGError(
            f"MFC {mfc!r}: {field} must be a list of keys, "
            f"got the string {keys!r}; write [{keys!r}]"
        )
    keys = tuple(keys)
    for k in keys:
        if not isinstance(k, str) or not k:
            raise DFGError(f"MFC {mfc!r}: {field} holds {k!r}; keys are non-empty strings")
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise DFGError(f"MFC {mfc!r}: {field} lists {dup} more than once")
    return keys


@dataclasses.dataclass
class MFCDef:
    """One model function call: a node of the dataflow graph.

    Attributes:
        name: unique name in the experiment, e.g. ``actor_gen``.
        model_name: the model that runs it (a string is that role's replica 0).
        interface_type: the interface method to call.
        interface_impl: the registered interface (an algorithm) and its arguments; a string
            is a name with no arguments.
        n_seqs: items per call (in RL an item is one prompt with all its answers).
        input_keys: buffer keys the call reads.
        output_keys: buffer keys the call writes.
        input_key_remap: buffer key -> interface key, applied to the input.
        output_key_remap: interface key -> buffer key, applied to the output.
        mb_spec: how to cut the call's data into micro-batches (``MicroBatchSpec``; default one
            micro-batch with no token cap).
        log_return_value: log what the interface returns (train statistics).
        drops_items: the call may return only some of its items (an inference call that
            filters, e.g. dynamic sampling's reward call dropping groups whose answers all
            agree); the others leave the step, and the master fetches new items through
            this MFC and its predecessors until the step is full again.  At most one MFC
            of a graph drops items.
    """

    name: str
    model_name: Union[ModelName, str]
    interface_type: Union[ModelInterfaceType, str]
    interface_impl: Union[InterfaceAbstraction, str]
    n_seqs: int
    input_keys: Sequence[str] = ()
    output_keys: Sequence[str] = ()
    input_key_remap: Dict[str, str] = dataclasses.field(default_factory=dict)
    output_key_remap: Dict[str, str] = dataclasses.field(default_factory=dict)
    mb_spec: Any = None
    log_return_value: bool = False
    drops_items: bool = False

    def __post_init__(self):
        # MFC names become path segments (recover's interfaces/{mfc}/), hence
        # no '/'; '@' is kept free as a field separator, as in ModelName.
        if (
            not isinstance(self.name, str)
            or not self.name
            or any(c in self.name for c in "@/ \t\n")
        ):
            raise DFGError(
                f"MFC name {self.name!r} must be a non-empty string without '@', '/' or spaces"
            )
        n = self.name
        if isinstance(self.model_name, str):
            self.model_name = ModelName(self.model_name, 0)
        if not isinstance(self.model_name, ModelName):
            raise DFGError(
                f"MFC {n!r}: model_name must be a ModelName or a role string, "
                f"got {self.model_name!r}"
            )
        if isinstance(self.interface_type, str):
            try:
                self.interface_type = ModelInterfaceType(self.interface_type)
            except ValueError:
                valid = [t.value for t in ModelInterfaceType]
                raise DFGError(
                    f"MFC {n!r}: interface_type {self.interface_type!r} is not one of {valid}"
                ) from None
        if not isinstance(self.interface_type, ModelInterfaceType):
            raise DFGError(
                f"MFC {n!r}: interface_type must be a ModelInterfaceType, "
                f"got {self.interface_type!r}"
            )
        if isinstance(self.interface_impl, str):
            self.interface_impl = InterfaceAbstraction(self.interface_impl)
        if not isinstance(self.interface_impl, InterfaceAbstraction):
            raise DFGError(
                f"MFC {n!r}: interface_impl must be an InterfaceAbstraction or a registered name, "
                f"got {self.interface_impl!r}"
            )
        if not isinstance(self.n_seqs, int) or isinstance(self.n_seqs, bool) or self.n_seqs < 1:
            raise DFGError(f"MFC {n!r}: n_seqs must be an integer >= 1, got {self.n_seqs!r}")
        self.input_keys = _key_tuple(n, "input_keys", self.input_keys)
        self.output_keys = _key_tuple(n, "output_keys", self.output_keys)
        # An in-place rewrite would give the key two producers (whoever wrote
        # it first, and this MFC), which breaks the one-producer rule edges
        # are inferred from.
        both = sorted(set(self.input_keys) & set(self.output_keys))
        if both:
            raise DFGError(
                f"MFC {n!r} reads and writes {both}; an MFC may not overwrite its own input — "
                f"write the result under a new key (use output_key_remap)"
            )
        if not self.output_keys and self.interface_type != ModelInterfaceType.TRAIN_STEP:
            raise DFGError(
                f"MFC {n!r} ({self.interface_type.value}) has no output_keys; "
                "only train_step calls may produce nothing"
            )
        self._check_remap(
            "input_key_remap", self.input_key_remap, keys_in=self.input_keys, side="keys"
        )
        self._check_remap(
            "output_key_remap", self.output_key_remap, keys_in=self.output_keys, side="values"
        )
        if self.mb_spec is None:
            self.mb_spec = _mb_spec_default()
        for f in ("n_mbs", "max_tokens_per_mb"):
            v = getattr(self.mb_spec, f, None)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise DFGError(f"MFC {n!r}: mb_spec.{f} must be an integer >= 1, got {v!r}")
        if not isinstance(self.log_return_value, bool):
            raise DFGError(
                f"MFC {n!r}: log_return_value must be true or false, got {self.log_return_value!r}"
            )
        if self.drops_items and self.interface_type == ModelInterfaceType.TRAIN_STEP:
            raise DFGError(
                f"MFC {n!r}: a train_step call cannot drop items (drops_items); "
                "let the inference call that filters drop them"
            )

    def _check_remap(self, field: str, remap: Dict[str, str], keys_in: Tuple[str, ...], side: str):
        if not isinstance(remap, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in remap.items()
        ):
            raise DFGError(f"MFC {self.name!r}: {field} must map strings to strings, got {remap!r}")
        buffer_names = remap.keys() if side == "keys" else remap.values()
        unknown = sorted(set(buffer_names) - set(keys_in))
        if unknown:
            listed = "input_keys" if field.startswith("input") else "output_keys"
            raise DFGError(
                f"MFC {self.name!r}: {field} renames buffer keys {unknown} "
                f"that are not in {listed} {list(keys_in)}"
            )

    @property
    def role(self) -> str:
        """The model role, e.g. ``actor``."""
        return self.model_name.role

    @property
    def is_train(self) -> bool:
        """Whether this call updates weights."""
        return self.interface_type == ModelInterfaceType.TRAIN_STEP


class DataFlowGraph:
    """The MFCs of an experiment with the edges their keys imply. Build with :func:`build_graph`.

    Node order everywhere (topological order, levels, lists of parents/children) follows the
    order the MFCs were given in, so outputs are deterministic.
    """

    def __init__(self, mfcs: List[MFCDef]):
        self.mfcs: Dict[str, MFCDef] = {}
        for m in mfcs:
            if not isinstance(m, MFCDef):
                raise DFGError(f"build_graph expects MFCDef objects, got {m!r}")
            if m.name in self.mfcs:
                raise DFGError(f"two MFCs are named {m.name!r}; MFC names must be unique")
            self.mfcs[m.name] = m
        self._order = {name: i for i, name in enumerate(self.mfcs)}
        self.producers: Dict[str, str] = {}
        for m in mfcs:
            for k in m.output_keys:
                if k in self.producers:
                    raise DFGError(
                        f"key {k!r} is produced by both {self.producers[k]!r} and {m.name!r}; "
                        "each key needs one producer — rename one output (output_key_remap)"
                    )
                self.producers[k] = m.name
        self.consumers: Dict[str, List[str]] = {}
        for m in mfcs:
            for k in m.input_keys:
                self.consumers.setdefault(k, []).append(m.name)
        # (parent, child) -> keys flowing along the edge, in the child's input order
        self.edges: Dict[Tuple[str, str], Tuple[str, ...]] = {}
        for m in mfcs:
            for k in m.input_keys:
                p = self.producers.get(k)
                if p is not None:
                    self.edges[(p, m.name)] = self.edges.get((p, m.name), ()) + (k,)
        self.dataset_keys: Tuple[str, ...] = tuple(
            dict.fromkeys(k for m in mfcs for k in m.input_keys if k not in self.producers)
        )
        self._check_replica_ids()
        self._topo = self._toposort()
        droppers = [m.name for m in mfcs if m.drops_items]
        if len(droppers) > 1:
            raise DFGError(
                f"MFCs {droppers} all drop items (drops_items); at most one MFC of a graph may"
            )
        #: the MFC that may drop items (None: every item of a step goes through every MFC)
        self.dropper: Optional[str] = droppers[0] if droppers else None

    @property
    def fill_phase(self) -> List[str]:
        """The MFCs a step runs again on new items to replace dropped ones: the dropper
        and its predecessors, in topological order (empty without a dropper)."""
        if self.dropper is None:
            return []
        names = set(self.predecessors(self.dropper)) | {self.dropper}
        return [n for n in self.topological_order() if n in names]

    # ------------------------------------------------------------- structure
    def _sorted(self, names) -> List[str]:
        return sorted(set(names), key=self._order.__getitem__)

    def _get(self, name: str) -> MFCDef:
        if name not in self.mfcs:
            raise DFGError(f"no MFC named {name!r}; MFCs: {list(self.mfcs)}")
        return self.mfcs[name]

    def parents(self, name: str) -> List[str]:
        """MFCs that produce a key ``name`` reads."""
        self._get(name)
        return self._sorted(p for (p, c) in self.edges if c == name)

    def children(self, name: str) -> List[str]:
        """MFCs that read a key ``name`` produces."""
        self._get(name)
        return self._sorted(c for (p, c) in self.edges if p == name)

    def successors(self, name: str) -> List[str]:
        """Every MFC reachable from ``name`` (children, their children, ...)."""
        seen, stack = set(), list(self.children(name))
        while stack:
            c = stack.pop()
            if c not in seen:
                seen.add(c)
                stack.extend(self.children(c))
        return self._sorted(seen)

    def predecessors(self, name: str) -> List[str]:
        """Every MFC that ``name`` transitively depends on."""
        seen, stack = set(), list(self.parents(name))
        while stack:
            p = stack.pop()
            if p not in seen:
                seen.add(p)
                stack.extend(self.parents(p))
        return self._sorted(seen)

    def edge_keys(self, parent: str, child: str) -> Tuple[str, ...]:
        """Keys flowing from ``parent`` to ``child`` (empty if there is no edge)."""
        return self.edges.get((parent, child), ())

    @property
    def sources(self) -> List[str]:
        """MFCs with no parents (they read dataset keys only)."""
        return [n for n in self.mfcs if not self.parents(n)]

    @property
    def sinks(self) -> List[str]:
        """MFCs with no children."""
        return [n for n in self.mfcs if not self.children(n)]

    def is_source(self, name: str) -> bool:
        """Whether ``name`` has no parents."""
        return not self.parents(name)

    def is_sink(self, name: str) -> bool:
        """Whether ``name`` has no children."""
        return not self.children(name)

    @property
    def model_names(self) -> List[ModelName]:
        """Distinct models used by the MFCs, sorted."""
        return sorted({m.model_name for m in self.mfcs.values()})

    def _check_replica_ids(self):
        by_role: Dict[str, set] = {}
        for m in self.mfcs.values():
            by_role.setdefault(m.role, set()).add(m.model_name.replica_id)
        for role, ids in by_role.items():
            if sorted(ids) != list(range(len(ids))):
                raise DFGError(
                    f"role {role!r} uses replica ids {sorted(ids)}; "
                    "replica ids of a role must be 0..k-1"
                )

    # ------------------------------------------------------------- ordering
    def _toposort(self) -> List[str]:
        # Kahn's algorithm; re-sorting the ready set by declaration order after
        # each step makes the order a function of the config alone, so every
        # process that builds the graph schedules MFCs identically.
        indeg = {n: len(self.parents(n)) for n in self.mfcs}
        ready = [n for n in self.mfcs if indeg[n] == 0]
        order = []
        while ready:
            n = ready.pop(0)
            order.append(n)
            for c in self.children(n):
                indeg[c] -= 1
                if indeg[c] == 0:
                    ready.append(c)
            ready.sort(key=self._order.__getitem__)
        if len(order) < len(self.mfcs):
            raise DFGError(
                f"the MFCs form a cycle: {self._describe_cycle(set(self.mfcs) - set(order))}"
            )
        return order

    def _describe_cycle(self, stuck: set) -> str:
        # Every node left after Kahn's algorithm has a parent that is also left: walk parents
        # until a node repeats, which closes a cycle.
        start = self._sorted(stuck)[0]
        path, node = [], start
        while node not in path:
            path.append(node)
            node = next(p for p in self.parents(node) if p in stuck)
        cycle = path[path.index(node) :][::-1] + [path[path.index(node) :][::-1][0]]
        hops = [f"{a} -[{', '.join(self.edge_keys(a, b))}]-> {b}" for a, b in zip(cycle, cycle[1:])]
        return "; ".join(hops) + " (break it by renaming one of these keys)"

    def topological_order(self) -> List[str]:
        """MFC names so that every MFC comes after all its parents."""
        return list(self._topo)

    def levels(self) -> List[List[str]]:
        """MFCs grouped by depth: level 0 are sources, level d+1 depends on something at level d."""
        depth: Dict[str, int] = {}
        for n in self._topo:
            depth[n] = 1 + max((depth[p] for p in self.parents(n)), default=-1)
        out: List[List[str]] = [[] for _ in range(1 + max(depth.values(), default=-1))]
        for n in self.mfcs:
            out[depth[n]].append(n)
        return out

    # ------------------------------------------------------------- export
    def _label(self, m: MFCDef) -> str:
        # A backslash and an "n", not a newline: DOT's line-break escape inside
        # a label, which keeps each statement of the output on one line.
        return (
            f"{m.name}\\n{m.model_name} {m.interface_type.value} "
            f"({m.interface_impl.type_}) n_seqs={m.n_seqs}"
        )

    def to_text(self) -> str:
        """A readable listing: levels, each MFC with its model, reads and writes."""
        lines = [f"dataset keys: {', '.join(self.dataset_keys) or '-'}"]
        for i, level in enumerate(self.levels()):
            lines.append(f"level {i}:")
            for n in level:
                m = self.mfcs[n]
                lines.append(
                    f"  {n}: {m.model_name} {m.interface_type.value} "
                    f"[{m.interface_impl.type_}] n_seqs={m.n_seqs}"
                )
                lines.append(f"    reads  {', '.join(m.input_keys) or '-'}")
                lines.append(f"    writes {', '.join(m.output_keys) or '-'}")
                for p in self.parents(n):
                    lines.append(f"    after  {p} ({', '.join(self.edge_keys(p, n))})")
        return "\n".join(lines)

    def to_dot(self) -> str:
        """Graphviz DOT: a ``dataset`` node feeds the sources; edges carry their keys."""
        out = ["digraph dfg {", "  rankdir=TB;", '  node [shape=box, fontname="monospace"];']
        if self.dataset_keys:
            out.append('  "dataset" [shape=cylinder];')
        for n, m in self.mfcs.items():
            out.append(f'  "{n}" [label="{self._label(m)}"];')
        for n, m in self.mfcs.items():
            ds = [k for k in m.input_keys if k in self.dataset_keys]
            if ds:
                out.append(f'  "dataset" -> "{n}" [label="{", ".join(ds)}"];')
        for (p, c), keys in self.edges.items():
            out.append(f'  "{p}" -> "{c}" [label="{", ".join(keys)}"];')
        out.append("}")
        return "\n".join(out)

    def to_mermaid(self) -> str:
        """A Mermaid flowchart (renders in GitHub markdown)."""
        out = ["flowchart TD"]
        if self.dataset_keys:
            out.append("  dataset[(dataset)]")
        for n, m in self.mfcs.items():
            label = f"{n}<br/>{m.model_name} {m.interface_type.value}"
            out.append(f'  {n}["{label}"]')
        for n, m in self.mfcs.items():
            ds = [k for k in m.input_keys if k in self.dataset_keys]
            if ds:
                out.append(f'  dataset -- "{", ".join(ds)}" --> {n}')
        for (p, c), keys in self.edges.items():
            out.append(f'  {p} -- "{", ".join(keys)}" --> {c}')
        return "\n".join(out)


def build_graph(mfcs: Sequence[MFCDef]) -> DataFlowGraph:
    """Link MFCs by their keys and check the result.

    Raises :class:`DFGError` for duplicate MFC names, a key with two producers, a cycle (the
    message lists the cycle and the keys on each hop) or replica ids that are not 0..k-1.
    """
    mfcs = list(mfcs)
    if not mfcs:
        raise DFGError("build_graph needs at least one MFC")
    return DataFlowGraph(mfcs)
