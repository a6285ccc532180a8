"""The data unit that flows between workers: `SequenceSample`, and how it is cut.

A `SequenceSample` holds a batch of *items*. An item has a unique string id and, per key,
one or more sequences (in RL an item is one prompt carrying its `group_size` answers).
Each key's data is one packed 1-D (plus trailing dims) tensor: the concatenation of all
sequences of all items, in item order. `seqlens[key][i]` lists the lengths of item i's
sequences for that key, so `data[key].shape[0] == sum of all of them`.

A sample may be *metadata only* (`data is None`): the master worker moves these around,
decides where items go, and model workers move the tensors.

Micro-batches are cut by `split(MicroBatchSpec(n_mbs, max_tokens_per_mb))`:
first-fit-decreasing over per-item token counts, never cutting an item.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from realhf.base import datapack

RL_TASKS = ["math", "code", "rlhf", "stem"]

# Default per-sequence lengths of the standard keys, as a function of the sequence
# length L of `packed_input_ids`. Shifted keys (one entry per predicted token) have L-1.
_ONE_PER_SEQUENCE_KEYS = frozenset(
    {
        "rewards",
        "rm_rewards",
        "seq_no_eos_mask",
        "task_ids",
        "version_start",
        "version_end",
        "birth_time",
    }
)
_FULL_LENGTH_KEYS = frozenset({"packed_input_ids", "prompt_mask", "values", "packed_prompts"})
_SHIFTED_KEYS = frozenset(
    {
        "packed_logprobs",
        "packed_ref_logprobs",
        "proximal_logprobs",
        "old_logp",
        "ref_logp",
        "advantages",
        "returns",
        "ppo_loss_mask",
        "kl_rewards",
        "dense_rewards",
    }
)
DEFAULT_KEYS = _ONE_PER_SEQUENCE_KEYS | _FULL_LENGTH_KEYS | _SHIFTED_KEYS


def default_seqlens(key: str, base_seqlens: list[list[int]]) -> list[list[int]]:
    """Per-item sequence lengths of a standard key, given the lengths L of the sequences.

    `rewards`, `rm_rewards`, `seq_no_eos_mask`, `task_ids`, versions and `birth_time`: 1 per
    sequence.
    `packed_input_ids`, `prompt_mask`, `values`, `packed_prompts`: L.
    Logprob-like keys (`packed_logprobs`, `advantages`, `returns`, ...): L - 1.
    """
    if key in _ONE_PER_SEQUENCE_KEYS:
        return [[1] * len(lens) for lens in base_seqlens]
    if key in _FULL_LENGTH_KEYS:
        return [list(lens) for lens in base_seqlens]
    if key in _SHIFTED_KEYS:
        for lens in base_seqlens:
            if any(l < 1 for l in lens):
                raise ValueError(
                    f"key {key!r} has L-1 entries per sequence, so every sequence needs "
                    f"L >= 1; got lengths {lens}"
                )
        return [[l - 1 for l in lens] for lens in base_seqlens]
    raise ValueError(
        f"no default length rule for key {key!r}; known keys: {sorted(DEFAULT_KEYS)}. "
        "Build the SequenceSample with explicit seqlens for it."
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MicroBatchSpec:
    """How to cut a batch into micro-batches.

    Attributes:
        n_mbs: minimum number of micro-batches (fewer only if there are fewer items).
        max_tokens_per_mb: token budget per micro-batch; more micro-batches are made
            when the items do not fit in `n_mbs`. One item is never cut, so it must fit.
    """

    n_mbs: int = 1
    max_tokens_per_mb: int = int(1e12)

    def __post_init__(self):
        if not isinstance(self.n_mbs, int) or isinstance(self.n_mbs, bool) or self.n_mbs < 1:
            raise ValueError(f"MicroBatchSpec.n_mbs must be an integer >= 1, got {self.n_mbs!r}")
        if (
            not isinstance(self.max_tokens_per_mb, int)
            or isinstance(self.max_tokens_per_mb, bool)
            or self.max_tokens_per_mb < 1
        ):
            raise ValueError(
                "MicroBatchSpec.max_tokens_per_mb must be an integer >= 1, got "
                f"{self.max_tokens_per_mb!r}; it is a token count, e.g. 8192"
            )


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r} in a SequenceSample JSON form")
    return dtype


@dataclasses.dataclass
class SequenceSample:
    """A batch of items with packed per-key data. See the module docstring.

    Attributes:
        keys: the data keys.
        trailing_shapes: per key, the shape after the packed (token) dimension.
        dtypes: per key, the torch dtype (None only for metadata-only keys).
        ids: one unique string id per item.
        seqlens: per key, a list per item of the lengths of that item's sequences.
        data: per key, a tensor of shape (sum of seqlens[key], *trailing_shapes[key]),
            or None for a metadata-only key; None altogether for a metadata-only sample.
        metadata: per-item lists of anything JSON-compatible (e.g. scores, versions).
    """

    keys: set[str]
    trailing_shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype | None]
    ids: list[str]
    seqlens: dict[str, list[list[int]]]
    data: dict[str, torch.Tensor | None] | None = None
    metadata: dict[str, list[Any]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.keys = set(self.keys)
        self.ids = list(self.ids)
        self.trailing_shapes = {
            k: tuple(int(x) for x in v) for k, v in self.trailing_shapes.items()
        }
        self.dtypes = dict(self.dtypes)
        self.metadata = {k: list(v) for k, v in (self.metadata or {}).items()}
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self):
        n = len(self.ids)
        for name in ("seqlens", "trailing_shapes", "dtypes"):
            given = set(getattr(self, name))
            for key in sorted(self.keys - given):
                raise ValueError(f"SequenceSample: key {key!r} is in keys but missing from {name}")
            for key in sorted(given - self.keys):
                raise ValueError(
                    f"SequenceSample: key {key!r} is in {name} but not in keys {sorted(self.keys)}"
                )
        first_seen: dict[str, int] = {}
        for i, id_ in enumerate(self.ids):
            if not isinstance(id_, str):
                raise ValueError(
                    f"SequenceSample: id of item {i} must be a str, got {type(id_).__name__} "
                    f"{id_!r}"
                )
            if id_ in first_seen:
                raise ValueError(
                    f"SequenceSample: duplicate id {id_!r} at items {first_seen[id_]} and {i}; "
                    "ids must be unique"
                )
            first_seen[id_] = i
        for key in sorted(self.keys):
            self.seqlens[key] = self._checked_seqlens(key, self.seqlens[key])
        if self.data is not None:
            if set(self.data) != self.keys:
                extra = sorted(set(self.data) ^ self.keys)
                raise ValueError(
                    f"SequenceSample: data keys {sorted(self.data)} differ from keys "
                    f"{sorted(self.keys)} (key {extra[0]!r})"
                )
            for key in sorted(self.keys):
                self._check_data(key)
        for mkey, values in self.metadata.items():
            if len(values) != n:
                raise ValueError(
                    f"SequenceSample: metadata {mkey!r} has {len(values)} entries for {n} items"
                )

    def _checked_seqlens(self, key: str, per_item) -> list[list[int]]:
        if len(per_item) != len(self.ids):
            raise ValueError(
                f"SequenceSample: key {key!r} has seqlens for {len(per_item)} items but there "
                f"are {len(self.ids)} ids"
            )
        out = []
        for id_, lens in zip(self.ids, per_item):
            if not isinstance(lens, (list, tuple)) or not all(
                isinstance(l, (int, np.integer)) and not isinstance(l, bool) and l >= 0
                for l in lens
            ):
                raise ValueError(
                    f"SequenceSample: key {key!r}, item {id_!r}: seqlens must be a list of "
                    f"non-negative ints (one per sequence of the item), got {lens!r}"
                )
            out.append([int(l) for l in lens])
        return out

    def _check_data(self, key: str):
        x = self.data[key]
        if x is None:
            return
        if not isinstance(x, torch.Tensor):
            raise ValueError(
                f"SequenceSample: data of key {key!r} must be a torch.Tensor or None, got "
                f"{type(x).__name__}"
            )
        totals = [sum(l) for l in self.seqlens[key]]
        if x.dim() == 0 or x.shape[0] != sum(totals):
            detail = ", ".join(f"{i!r}: {t}" for i, t in list(zip(self.ids, totals))[:8])
            raise ValueError(
                f"SequenceSample: key {key!r} has data of shape {tuple(x.shape)} but its "
                f"seqlens sum to {sum(totals)} (per item "
                f"{detail}{', ...' if len(totals) > 8 else ''})"
            )
        if tuple(x.shape[1:]) != self.trailing_shapes[key]:
            raise ValueError(
                f"SequenceSample: key {key!r} has data of shape {tuple(x.shape)}, trailing "
                f"shape should be {self.trailing_shapes[key]}"
            )
        if self.dtypes[key] is not None and x.dtype != self.dtypes[key]:
            raise ValueError(
                f"SequenceSample: key {key!r} has data of dtype {x.dtype}, dtypes says "
                f"{self.dtypes[key]}"
            )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_default(
        cls,
        ids: Sequence[str],
        seqlens: Sequence[int] | Sequence[Sequence[int]],
        data: dict[str, torch.Tensor],
        metadata: dict[str, list[Any]] | None = None,
    ) -> "SequenceSample":
        """Build a sample whose keys follow the default length rules (`default_seqlens`).

        `seqlens` are the lengths L of each item's sequences (a list of ints per item, or
        one int per item for single-sequence items). Trailing shapes and dtypes are taken
        from the tensors.
        """
        base = [
            [int(s)] if isinstance(s, (int, np.integer)) else [int(x) for x in s] for s in seqlens
        ]
        if len(base) != len(ids):
            raise ValueError(f"SequenceSample.from_default: {len(base)} seqlens for {len(ids)} ids")
        return cls(
            keys=set(data),
            trailing_shapes={k: tuple(v.shape[1:]) for k, v in data.items()},
            dtypes={k: v.dtype for k, v in data.items()},
            ids=list(ids),
            seqlens={k: default_seqlens(k, base) for k in data},
            data=dict(data),
            metadata=metadata or {},
        )

    @classmethod
    def gather(
        cls, samples: Sequence["SequenceSample"], keys: Iterable[str] | None = None
    ) -> "SequenceSample":
        """Concatenate samples item-wise (ids must stay unique), optionally keeping only `keys`."""
        if not samples:
            raise ValueError("SequenceSample.gather needs at least one sample")
        keys = set(samples[0].keys if keys is None else keys)
        for j, s in enumerate(samples):
            for key in sorted(keys - s.keys):
                raise ValueError(
                    f"SequenceSample.gather: sample {j} lacks key {key!r} (has {sorted(s.keys)})"
                )
            if set(s.metadata) != set(samples[0].metadata):
                raise ValueError(
                    f"SequenceSample.gather: sample {j} has metadata keys {sorted(s.metadata)}, "
                    f"sample 0 has {sorted(samples[0].metadata)}"
                )
        data: dict[str, torch.Tensor | None] = {}
        for key in sorted(keys):
            for j, s in enumerate(samples):
                if (
                    s.trailing_shapes[key] != samples[0].trailing_shapes[key]
                    or s.dtypes[key] != samples[0].dtypes[key]
                ):
                    raise ValueError(
                        f"SequenceSample.gather: key {key!r} of sample {j} is "
                        f"{s.dtypes[key]}{list(s.trailing_shapes[key])}, "
                        "sample 0 has "
                        f"{samples[0].dtypes[key]}{list(samples[0].trailing_shapes[key])}"
                    )
            parts = [None if s.data is None else s.data[key] for s in samples]
            if all(p is None for p in parts):
                data[key] = None
            elif any(p is None for p in parts):
                j = next(j for j, p in enumerate(parts) if p is None)
                raise ValueError(
                    f"SequenceSample.gather: key {key!r} has data in some samples but not in "
                    f"sample {j}"
                )
            else:
                data[key] = torch.cat(parts, dim=0)
        has_data = any(v is not None for v in data.values())
        return cls(
            keys=keys,
            trailing_shapes={k: samples[0].trailing_shapes[k] for k in keys},
            dtypes={k: samples[0].dtypes[k] for k in keys},
            ids=[i for s in samples for i in s.ids],
            seqlens={k: [l for s in samples for l in s.seqlens[k]] for k in keys},
            data=data if has_data else None,
            metadata={m: [v for s in samples for v in s.metadata[m]] for m in samples[0].metadata},
        )

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self.ids)

    @property
    def bs(self) -> int:
        """Number of items."""
        return len(self.ids)

    def item_tokens(self, key: str) -> list[int]:
        """Per item, the total length of its sequences for `key`."""
        self._require_key(key)
        return [sum(l) for l in self.seqlens[key]]

    def flat_seqlens(self, key: str) -> list[int]:
        """All sequence lengths of `key`, item after item."""
        self._require_key(key)
        return [l for lens in self.seqlens[key] for l in lens]

    def cu_seqlens(self, key: str, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """Cumulative sequence lengths of `key` with a leading 0: shape [n_sequences + 1]."""
        lens = torch.tensor(self.flat_seqlens(key), dtype=torch.int64)
        return torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(dtype)

    def _require_key(self, key: str):
        if key not in self.keys:
            raise KeyError(f"SequenceSample has no key {key!r}; keys are {sorted(self.keys)}")

    def _largest_key(self) -> str:
        if not self.keys:
            raise ValueError("SequenceSample has no keys to measure tokens on")
        # sorted() first: set order depends on the per-process hash seed, and
        # on a tie every data-parallel rank must pick the same key to count.
        return max(sorted(self.keys), key=lambda k: sum(self.item_tokens(k)))

    # ------------------------------------------------------------------ item selection
    def select_items(self, indices: Sequence[int]) -> "SequenceSample":
        """A new sample with the items at `indices`, in that order.

        Data of a contiguous ascending selection are views; otherwise they are copied.
        """
        indices = [int(i) for i in indices]
        for i in indices:
            if not 0 <= i < len(self):
                raise IndexError(
                    f"SequenceSample.select_items: index {i} out of range for {len(self)} items"
                )
        data = None
        if self.data is not None:
            data = {}
            for key, x in self.data.items():
                if x is None:
                    data[key] = None
                    continue
                offsets = np.concatenate([[0], np.cumsum(self.item_tokens(key))])
                if indices and indices == list(range(indices[0], indices[0] + len(indices))):
                    data[key] = x[offsets[indices[0]] : offsets[indices[-1] + 1]]
                else:
                    parts = [x[offsets[i] : offsets[i + 1]] for i in indices]
                    data[key] = torch.cat(parts, 0) if parts else x[:0]
        return SequenceSample(
            keys=set(self.keys),
            trailing_shapes=dict(self.trailing_shapes),
            dtypes=dict(self.dtypes),
            ids=[self.ids[i] for i in indices],
            seqlens={k: [list(v[i]) for i in indices] for k, v in self.seqlens.items()},
            data=data,
            metadata={m: [v[i] for i in indices] for m, v in self.metadata.items()},
        )

    def unpack(self) -> list["SequenceSample"]:
        """One single-item sample per item (data are views)."""
        per_key = {}
        if self.data is not None:
            for key, x in self.data.items():
                per_key[key] = None if x is None else torch.split(x, self.item_tokens(key), dim=0)
        out = []
        for i, id_ in enumerate(self.ids):
            out.append(
                SequenceSample(
                    keys=set(self.keys),
                    trailing_shapes=dict(self.trailing_shapes),
                    dtypes=dict(self.dtypes),
                    ids=[id_],
                    seqlens={k: [list(v[i])] for k, v in self.seqlens.items()},
                    data=(
                        None
                        if self.data is None
                        else {k: None if p is None else p[i] for k, p in per_key.items()}
                    ),
                    metadata={m: [v[i]] for m, v in self.metadata.items()},
                )
            )
        return out

    def shuffled(self, seed: int) -> "SequenceSample":
        """The items in a random order fixed by `seed`."""
        return self.select_items(np.random.default_rng(seed).permutation(len(self)).tolist())

    # ------------------------------------------------------------------ micro-batches
    def split(self, mb_spec: MicroBatchSpec) -> tuple[list["SequenceSample"], list[int], list[int]]:
        """Cut into micro-batches by first-fit-decreasing on per-item token counts.

        Tokens are counted on the key with the most tokens. See `datapack.ffd_allocate`.

        Returns:
            (micro_batches, forward_indices, backward_indices): `forward_indices` lists the
            original item indices in micro-batch order (so `gather(micro_batches)` equals
            `select_items(forward_indices)`); `backward_indices[i]` is where original item
            i sits in that order, so `gathered.select_items(backward_indices)` restores the
            original order of per-item outputs.
        """
        if not isinstance(mb_spec, MicroBatchSpec):
            raise TypeError(f"split expects a MicroBatchSpec, got {type(mb_spec).__name__}")
        key = self._largest_key()
        tokens = self.item_tokens(key)
        for id_, t in zip(self.ids, tokens):
            if t > mb_spec.max_tokens_per_mb:
                raise ValueError(
                    f"SequenceSample.split: item {id_!r} has {t} tokens of key {key!r}, more "
                    f"than max_tokens_per_mb={mb_spec.max_tokens_per_mb}; raise max_tokens_per_mb "
                    f"to at least {t} (an item is never cut)"
                )
        groups = datapack.ffd_allocate(tokens, mb_spec.max_tokens_per_mb, mb_spec.n_mbs)
        forward = [i for g in groups for i in g]
        # The inverse permutation of `forward`.
        backward = np.argsort(np.asarray(forward, dtype=np.int64), kind="stable").tolist()
        return [self.select_items(g) for g in groups], forward, backward

    def synced_data_parallel_split(
        self, mb_spec: MicroBatchSpec, group=None
    ) -> tuple[list["SequenceSample"], list[int], list[int]]:
        """`split`, with the same number of micro-batches on every rank of `group`.

        Every rank of the (data-parallel) process group must call it. The ranks agree on
        the largest count (all-reduce MAX) and re-split with `n_mbs` set to it, repeating
        until all counts agree. Without an initialised torch.distributed it is `split`.
        Raises on every rank if some rank has fewer items than the agreed count.
        """
        import torch.distributed as dist

        from realhf.base.distributed import dist_util

        # Ranks that run different numbers of micro-batches fall out of step
        # in every collective issued per micro-batch, which hangs rather than
        # failing.  n_mbs is only a minimum, so a rank whose token budget
        # forces extra micro-batches can push the maximum up again: repeat
        # until all agree (each round only raises the count, so it ends).
        result = self.split(mb_spec)
        if not (dist.is_available() and dist.is_initialized()):
            return result
        while True:
            n = len(result[0])
            # One MAX collective yields max and min (max of the negated values)
            # of the count, and the fewest items of any rank.
            t = torch.tensor([n, -n, -len(self)], dtype=torch.int64)
            dist_util.all_reduce_(t, dist.ReduceOp.MAX, group)
            hi, lo, fewest_items = int(t[0]), -int(t[1]), -int(t[2])
            if hi == lo:
                return result
            if fewest_items < hi:
                raise ValueError(
                    f"synced_data_parallel_split: the data-parallel ranks need {hi} "
                    f"micro-batches but one rank has only {fewest_items} items (this rank: "
                    f"{len(self)}); give every rank at least {hi} items or raise "
                    f"max_tokens_per_mb (now {mb_spec.max_tokens_per_mb})"
                )
            mb_spec = dataclasses.replace(mb_spec, n_mbs=hi)
            result = self.split(mb_spec)

    # ------------------------------------------------------------------ keys
    def select(self, keys: Iterable[str]) -> "SequenceSample":
        """A sample with only `keys` (data shared, not copied)."""
        keys = set(keys)
        for key in sorted(keys - self.keys):
            raise KeyError(f"SequenceSample.select: no key {key!r}; keys are {sorted(self.keys)}")
        return SequenceSample(
            keys=keys,
            trailing_shapes={k: self.trailing_shapes[k] for k in keys},
            dtypes={k: self.dtypes[k] for k in keys},
            ids=list(self.ids),
            seqlens={k: copy.deepcopy(self.seqlens[k]) for k in keys},
            data=None if self.data is None else {k: self.data[k] for k in keys},
            metadata=copy.deepcopy(self.metadata),
        )

    def update_(self, other: "SequenceSample") -> None:
        """Merge the keys and metadata of `other` into this sample, in place.

        `other` must hold the same ids (in any order); its keys overwrite ours.
        """
        if other.ids != self.ids:
            if set(other.ids) != set(self.ids) or len(other.ids) != len(self.ids):
                missing = sorted(set(self.ids) ^ set(other.ids))
                raise ValueError(
                    f"SequenceSample.update_: ids differ (e.g. {missing[:3]}); update_ merges "
                    "keys of the same items"
                )
            pos = {id_: i for i, id_ in enumerate(other.ids)}
            other = other.select_items([pos[id_] for id_ in self.ids])
        if self.data is None and other.data is not None:
            self.data = {k: None for k in self.keys}
        for key in other.keys:
            self.keys.add(key)
            self.trailing_shapes[key] = other.trailing_shapes[key]
            self.dtypes[key] = other.dtypes[key]
            self.seqlens[key] = copy.deepcopy(other.seqlens[key])
            if self.data is not None:
                self.data[key] = None if other.data is None else other.data[key]
        self.metadata.update(copy.deepcopy(other.metadata))
        self._validate()

    def remap_keys_(self, mapping: dict[str, str]) -> None:
        """Rename keys in place (`{old: new}`); the renamed set must not collide."""
        for old in mapping:
            self._require_key(old)
        new_keys = [mapping.get(k, k) for k in self.keys]
        if len(set(new_keys)) != len(new_keys):
            dup = next(k for k in new_keys if new_keys.count(k) > 1)
            raise ValueError(f"SequenceSample.remap_keys_: {mapping} maps two keys onto {dup!r}")
        rename = lambda d: {mapping.get(k, k): v for k, v in d.items()}  # noqa: E731
        self.keys = set(new_keys)
        self.trailing_shapes = rename(self.trailing_shapes)
        self.dtypes = rename(self.dtypes)
        self.seqlens = rename(self.seqlens)
        if self.data is not None:
            self.data = rename(self.data)

    # ------------------------------------------------------------------ metadata forms
    def meta(self) -> "SequenceSample":
        """A copy without data (metadata only)."""
        return SequenceSample(
            keys=set(self.keys),
            trailing_shapes=dict(self.trailing_shapes),
            dtypes=dict(self.dtypes),
            ids=list(self.ids),
            seqlens=copy.deepcopy(self.seqlens),
            data=None,
            metadata=copy.deepcopy(self.metadata),
        )

    def as_json_compatible(self) -> dict:
        """Metadata as plain lists/dicts/strings (no tensors), for sending over the wire."""
        keys = sorted(self.keys)
        return {
            "keys": keys,
            "trailing_shapes": {k: list(self.trailing_shapes[k]) for k in keys},
            "dtypes": {k: _dtype_name(self.dtypes[k]) for k in keys},
            "ids": list(self.ids),
            "seqlens": {k: copy.deepcopy(self.seqlens[k]) for k in keys},
            "metadata": copy.deepcopy(self.metadata),
        }

    @classmethod
    def from_json_compatible(cls, d: dict) -> "SequenceSample":
        """The inverse of `as_json_compatible`: a metadata-only sample."""
        expected = {"keys", "trailing_shapes", "dtypes", "ids", "seqlens", "metadata"}
        if set(d) != expected:
            raise ValueError(
                f"SequenceSample.from_json_compatible: fields {sorted(d)} differ from "
                f"{sorted(expected)}"
            )
        return cls(
            keys=set(d["keys"]),
            trailing_shapes={k: tuple(v) for k, v in d["trailing_shapes"].items()},
            dtypes={k: _dtype_from_name(v) for k, v in d["dtypes"].items()},
            ids=list(d["ids"]),
            seqlens=copy.deepcopy(d["seqlens"]),
            data=None,
            metadata=copy.deepcopy(d["metadata"]),
        )

    def __repr__(self) -> str:
        tokens = {k: sum(self.item_tokens(k)) for k in sorted(self.keys)}
        kind = "meta" if self.data is None else "data"
        meta = sorted(self.metadata)
        return f"SequenceSample(bs={len(self)}, {kind}, tokens={tokens}, metadata={meta})"


# ---------------------------------------------------------------------------- images
# Images in a batch: the tensors a vision-language model takes, and the keys that hold them.
#
# A SequenceSample item with images carries two keys (IMAGE_KEYS), one "sequence" each per
# item, whatever number of answers the item has (the images belong to its prompt):
# ``pixel_values`` [patches, patch_dim] float32, the HF image processor's output for all the
# item's images, and ``image_grid_thw`` [images, 3] int64, each image's patch grid.  An item
# without images has zero rows in both.  vision_inputs_of turns a (micro-)batch into the
# model's VisionInputs: an item's images serve each of its sequences (a GRPO group of
# answers shares its prompt's images), and an image is stored, and encoded, once.

#: the SequenceSample keys of an item's images
IMAGE_KEYS = ("pixel_values", "image_grid_thw")


@dataclasses.dataclass
class VisionInputs:
    """The images of a packed batch, in the order of their placeholders.

    Each image is stored once: a prompt's images read by each of a group's answers (or the
    same image in several prompts) are one entry that ``index`` names several times, so the
    vision tower runs once per distinct image.

    Attributes:
        pixel_values: ``[N, patch_dim]`` the patches of every distinct image, back to back.
        grid_thw: ``LongTensor[n_distinct, 3]``: each distinct image's patch grid (t, h, w);
            image ``i`` holds ``t * h * w`` rows of ``pixel_values`` and fills
            ``t * h * w / spatial_merge_size**2`` placeholders.
        index: ``LongTensor[n_images]``: for each image of the batch (each run of
            placeholders, in order), which distinct image it is; None: the distinct images
            in order, once each.
        seq_images: per sequence of the batch, the distinct images it reads, in order (set
            by :func:`vision_inputs_of`): sequences whose prompts are shared must share
            their images too (:class:`~realhf.impl.model.modules.shared_prefix.SharedPrefix`).
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    index: Optional[torch.Tensor] = None
    seq_images: Optional[List[Tuple[int, ...]]] = None

    def __post_init__(self):
        if self.pixel_values.dim() != 2:
            raise ValueError(
                f"pixel_values must be [patches, patch_dim], got {tuple(self.pixel_values.shape)}"
            )
        if self.grid_thw.dim() != 2 or self.grid_thw.shape[-1] != 3:
            raise ValueError(f"grid_thw must be [images, 3], got {tuple(self.grid_thw.shape)}")
        n = int(self.grid_thw.prod(-1).sum()) if self.grid_thw.numel() else 0
        if n != self.pixel_values.shape[0]:
            raise ValueError(
                f"grid_thw describes {n} patches but pixel_values has "
                f"{self.pixel_values.shape[0]} rows"
            )
        if (
            self.index is not None
            and self.index.numel()
            and (int(self.index.min()) < 0 or int(self.index.max()) >= self.grid_thw.shape[0])
        ):
            raise ValueError(f"index names images outside the {self.grid_thw.shape[0]} given")

    @property
    def n_images(self) -> int:
        """Images in the batch (placeholder runs), repeats included."""
        return self.grid_thw.shape[0] if self.index is None else self.index.numel()

    @property
    def slot_grids(self) -> torch.Tensor:
        """``[n_images, 3]``: the grid of each image of the batch, in placeholder order."""
        return self.grid_thw if self.index is None else self.grid_thw[self.index.to("cpu")]

    def to(self, device) -> "VisionInputs":
        """A copy on ``device`` (``index`` stays where it is: it is read on the host)."""
        return dataclasses.replace(
            self, pixel_values=self.pixel_values.to(device), grid_thw=self.grid_thw.to(device)
        )

    def select(self, slots: Sequence[int]) -> "VisionInputs":
        """Only the batch's images ``slots`` (positions in placeholder order), in order."""
        full = torch.arange(self.grid_thw.shape[0]) if self.index is None else self.index.cpu()
        return VisionInputs(self.pixel_values, self.grid_thw, full[list(slots)])

    @staticmethod
    def concat(parts: Sequence["VisionInputs"]) -> "VisionInputs":
        """The images of ``parts`` one after the other, repeats kept as repeats."""
        index, n = [], 0
        for p in parts:
            local = torch.arange(p.grid_thw.shape[0]) if p.index is None else p.index.cpu()
            index.append(local + n)
            n += p.grid_thw.shape[0]
        return VisionInputs(
            torch.cat([p.pixel_values for p in parts]),
            torch.cat([p.grid_thw for p in parts]),
            torch.cat(index) if any(p.index is not None for p in parts) else None,
        )


def item_images(sample) -> Optional[List[Tuple[torch.Tensor, torch.Tensor]]]:
    """Per item, ``(pixel_values, grid_thw)`` of its images (views; zero rows without
    images); None when the sample has no image keys."""
    if sample.data is None or not all(k in sample.keys for k in IMAGE_KEYS):
        return None
    pix = torch.split(sample.data["pixel_values"], sample.item_tokens("pixel_values"))
    grid = torch.split(sample.data["image_grid_thw"], sample.item_tokens("image_grid_thw"))
    return [(p, g.long()) for p, g in zip(pix, grid)]


def vision_inputs_of(sample, device=None) -> Optional[VisionInputs]:
    """The images of a SequenceSample as one :class:`VisionInputs` in the order of its
    sequences (each item's images once per sequence of ``packed_input_ids``), each distinct
    image stored once; None when the sample has no image keys or no images."""
    items = item_images(sample)
    if items is None or sample.data["image_grid_thw"].shape[0] == 0:
        return None
    n_seqs = [len(lens) for lens in sample.seqlens["packed_input_ids"]]
    distinct: List[tuple] = []  # (pixels, grid) of each distinct image
    seen: dict = {}  # a cheap key of an image -> its candidates among `distinct`
    index: List[int] = []
    seq_images: List[Tuple[int, ...]] = []
    for n, (p, g) in zip(n_seqs, items):
        images = torch.split(p, g.prod(-1).tolist()) if g.shape[0] else ()
        item = [_distinct_image(x, gi, distinct, seen) for x, gi in zip(images, g)]
        index += item * n
        seq_images += [tuple(item)] * n
    out = VisionInputs(
        torch.cat([d[0] for d in distinct]),
        torch.stack([d[1] for d in distinct]),
        torch.tensor(index, dtype=torch.long),
        seq_images,
    )
    return out if device is None else out.to(device)


def _distinct_image(pixels: torch.Tensor, grid: torch.Tensor, distinct: list, seen: dict) -> int:
    """The position of the image ``(pixels, grid)`` in ``distinct``, appended if new.
    Images are compared whole (``torch.equal``) among those of the same grid and sum."""
    key = (tuple(grid.tolist()), float(pixels.sum()))
    for j in seen.get(key, ()):
        if torch.equal(distinct[j][0], pixels):
            return j
    seen.setdefault(key, []).append(len(distinct))
    distinct.append((pixels, grid))
    return len(distinct) - 1


def image_sample(ids, pixel_values, grid_thw, pixel_lens, grid_lens):
    """A SequenceSample of only the image keys: item ``i`` (id ``ids[i]``) holds
    ``pixel_lens[i]`` patch rows and ``grid_lens[i]`` images."""

    return SequenceSample(
        keys=set(IMAGE_KEYS),
        trailing_shapes={"pixel_values": tuple(pixel_values.shape[1:]), "image_grid_thw": (3,)},
        dtypes={"pixel_values": pixel_values.dtype, "image_grid_thw": torch.int64},
        ids=list(ids),
        seqlens={
            "pixel_values": [[int(n)] for n in pixel_lens],
            "image_grid_thw": [[int(n)] for n in grid_lens],
        },
        data={"pixel_values": pixel_values, "image_grid_thw": grid_thw.long()},
    )


def images_per_sequence(sample, seq_ids):
    """The image keys of ``sample`` re-cut with one item per sequence (ids ``seq_ids``, in
    the order of ``packed_input_ids``' sequences): each sequence gets its item's images.
    None when the sample has no image keys."""
    items = item_images(sample)
    if items is None:
        return None
    n_seqs = [len(lens) for lens in sample.seqlens["packed_input_ids"]]
    pixels, grids, plens, glens = [], [], [], []
    for n, (p, g) in zip(n_seqs, items):
        pixels += [p] * n
        grids += [g] * n
        plens += [p.shape[0]] * n
        glens += [g.shape[0]] * n
    return image_sample(seq_ids, torch.cat(pixels), torch.cat(grids), plens, glens)


def keys_with_images(sample, keys) -> List[str]:
    """``keys`` plus the image keys ``sample`` holds: what an interface selects for a forward
    pass (the model needs the images of the sequences it reads)."""
    return list(keys) + [k for k in IMAGE_KEYS if k in sample.keys and k not in keys]
