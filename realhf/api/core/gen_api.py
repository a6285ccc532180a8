"""Generation protocol: sampling parameters, requests and outputs.

These types are shared by the built-in generation engine
(:mod:`realhf.impl.model.gen`), its HTTP server and every client of a generation
server (the rollout code, the gserver manager), so the server and the clients
agree on one parser for SGLang's ``/generate`` protocol.

Field names follow SGLang's native API (checked against the ``sgl-project/sglang``
sources of the v0.4.6 – v0.5.x line: ``GenerateReqInput`` in
``srt/managers/io_struct.py``, ``SamplingParams`` in
``srt/sampling/sampling_params.py``, ``meta_info`` in
``srt/managers/tokenizer_manager.py``, finish reasons in
``srt/managers/schedule_batch.py``):

- request: ``text`` | ``input_ids`` (one prompt or a list of prompts),
  ``sampling_params`` (``n``, ``temperature``, ``top_p``, ``top_k``,
  ``max_new_tokens``, ``min_new_tokens``, ``stop_token_ids``, ``ignore_eos``,
  ``sampling_seed``), ``return_logprob``, ``rid``, ``stream`` (false only);
- response: ``{"text", "output_ids", "meta_info": {"id", "finish_reason",
  "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency",
  "output_token_logprobs"}}``, one object per prompt and sample (a list when
  ``n > 1`` or when the input was a list, grouped by prompt). SGLang sends
  ``text`` when it has a tokenizer and ``output_ids`` when it was started with
  ``skip_tokenizer_init``; the built-in server always sends ``output_ids`` and
  adds ``text`` when it has a tokenizer, and :func:`parse_sglang_output` reads
  either;
- ``output_token_logprobs`` entries are ``[logprob, token_id, None]``
  (SGLang's form with ``return_text_in_logprobs`` false; the third item is the
  token text when it is true);
- ``finish_reason``: ``{"type": "stop", "matched": token_id}``,
  ``{"type": "length", "length": n}`` or ``{"type": "abort", "message": str}``.

Semantics that matter to RL (all as in SGLang):

- ``temperature == 0`` (below 1e-6) or ``top_k == 1`` means greedy decoding;
- logprobs are those of the sampled tokens under ``log_softmax(logits / T)``
  (``T = 1`` for greedy), *before* top-p/top-k truncation and *after* the
  ``min_new_tokens`` mask, i.e. of the distribution the sampler starts from;
- the default stop tokens are the model's EOS and pad ids (dropped with
  ``ignore_eos``); ``stop_token_ids`` add to them; a stop token is kept as the
  last output token;
- ``min_new_tokens`` masks every stop token until that many tokens exist.

Unknown request fields are errors (:class:`InvalidRequestError`); SGLang fields
that the built-in engine does not implement are accepted only at their neutral
default value, otherwise they are errors that name the field.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import os
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

from realhf.api.core.data_api import VisionInputs

GREEDY_EPS = 1e-6


class FinishType(enum.StrEnum):
    """SGLang's ``finish_reason.type``: why a sequence (or one chunk of it) ended."""

    #: a stop token: the answer is done
    STOP = "stop"
    #: the token budget: a caller generating in chunks goes on if its own budget is left
    LENGTH = "length"
    #: aborted or paused (e.g. for a weight update): resubmit what was generated so far
    ABORT = "abort"


FINISH_TYPES = tuple(t.value for t in FinishType)


class InvalidRequestError(ValueError):
    """A generation request is malformed; the message names the field and the fix.

    Servers answer it with HTTP 400 and keep serving.
    """


def _bad(field: str, value: Any, fix: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}={value!r} is invalid: {fix}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _as_float(x: Any) -> float:
    """``x`` as a float; NaN for what is no number (or an integer too large for a float)."""
    if not _is_num(x):
        return float("nan")
    try:
        return float(x)
    except OverflowError:
        return float("nan")


#: Integers the engine puts into int64 tensors and generators must fit 64 bits; a larger one
#: (JSON has no bound) would fail the engine's step, and with it the other requests of the step.
_INT64_MAX = 2**63 - 1


# SGLang sampling fields that we accept only at their neutral value: a client
# that sends the default must keep working, one that relies on the feature must
# hear that it is missing rather than get silently different samples.
_NEUTRAL_SAMPLING_FIELDS: Dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop": None,
    "stop_regex": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "custom_params": None,
    "stream_interval": None,
    "logit_bias": None,
}


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one or more continuations of a prompt (SGLang's names).

    Attributes:
        max_new_tokens: most tokens to generate; ``None`` means up to the
            server's context length.
        min_new_tokens: stop tokens are masked until this many tokens exist.
        temperature: softmax temperature; ``0`` means greedy.
        top_p: nucleus mass in ``(0, 1]``.
        top_k: keep the ``k`` most likely tokens; ``-1`` keeps all.
        n: number of samples per prompt.
        stop_token_ids: extra token ids that end a sequence.
        ignore_eos: do not stop on the default EOS/pad tokens.
        sampling_seed: makes the samples reproducible; sample ``j`` of ``n``
            uses :func:`derive_seed` ``(seed, j)``.
    """

    max_new_tokens: Optional[int] = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stop_token_ids: Tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_seed: Optional[int] = None

    def __post_init__(self):
        if self.max_new_tokens is not None and (
            not _is_int(self.max_new_tokens) or self.max_new_tokens < 0
        ):
            raise _bad("max_new_tokens", self.max_new_tokens, "use an integer >= 0 or null")
        if not _is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            raise _bad("min_new_tokens", self.min_new_tokens, "use an integer >= 0")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise _bad(
                "min_new_tokens",
                self.min_new_tokens,
                f"must not exceed max_new_tokens={self.max_new_tokens}",
            )
        # Stored as floats: an integer one (JSON has no bound) must not reach a tensor as is.
        temperature, top_p = _as_float(self.temperature), _as_float(self.top_p)
        if not 0.0 <= temperature < float("inf"):
            raise _bad("temperature", self.temperature, "use a finite number >= 0 (0 = greedy)")
        if not 0.0 < top_p <= 1.0:
            raise _bad("top_p", self.top_p, "use a number in (0, 1]")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise _bad("top_k", self.top_k, "use -1 (whole vocabulary) or an integer >= 1")
        if self.top_k > _INT64_MAX:
            raise _bad("top_k", self.top_k, "use -1 for the whole vocabulary")
        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", self.n, "use an integer >= 1")
        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise _bad("stop_token_ids", self.stop_token_ids, "use a list of token ids >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "use true or false")
        if self.sampling_seed is not None and (
            not _is_int(self.sampling_seed) or not -_INT64_MAX - 1 <= self.sampling_seed < 2**64
        ):
            raise _bad(
                "sampling_seed",
                self.sampling_seed,
                "use an integer in [-2**63, 2**64) or null",
            )

    @property
    def greedy(self) -> bool:
        """Whether this samples the argmax token (SGLang's rule)."""
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]]) -> "SamplingParams":
        """Parse SGLang's ``sampling_params`` object; unknown keys are errors.

        ``null`` values mean "default", as in SGLang.
        """
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise _bad("sampling_params", d, "use a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in d.items():
            if key in names:
                # null max_new_tokens is a value of its own (no cap below the
                # context length), not "use the default" of 128; for the seed
                # both readings agree.
                if value is not None or key in ("max_new_tokens", "sampling_seed"):
                    kwargs[key] = value
            elif key in _NEUTRAL_SAMPLING_FIELDS:
                # [] too: an empty stop (or bias) list is as neutral as none.
                if value not in (None, _NEUTRAL_SAMPLING_FIELDS[key]) and value != []:
                    raise _bad(
                        f"sampling_params.{key}",
                        value,
                        "is not supported by the built-in engine; leave it unset",
                    )
            else:
                raise _bad(
                    f"sampling_params.{key}",
                    value,
                    f"unknown field; accepted: {sorted(names)}",
                )
        return cls(**kwargs)

    def for_sample(self, j: int) -> "SamplingParams":
        """The parameters of sample ``j`` of ``n``: ``n = 1``, seed derived."""
        if self.n == 1 and j == 0:  # the common case: itself (sample 0 keeps the seed)
            return self
        seed = None if self.sampling_seed is None else derive_seed(self.sampling_seed, j)
        return dataclasses.replace(self, n=1, sampling_seed=seed)


def derive_seed(seed: int, j: int) -> int:
    """A 63-bit seed for sample ``j`` of a seeded request.

    Mixing with a large odd constant keeps ``(seed, j)`` and ``(seed + 1, j - 1)``
    apart, which a plain ``seed + j`` would not.
    """
    # Sample 0 keeps the seed itself, so an n=1 request and sample 0 of an
    # n>1 request with the same seed draw the same tokens.
    if j == 0:
        return seed
    # The 64-bit golden-ratio and SplitMix64 multipliers; the mask keeps the
    # result a non-negative value that fits a signed 64-bit seed.
    return (seed * 0x9E3779B97F4A7C15 + j * 0xBF58476D1CE4E5B9) & ((1 << 63) - 1)


# A random prefix per process and a counter: unique like uuid4, without a getrandom()
# system call per request (uuid4 was ~4 % of the generation server's event loop).
_RID_PREFIX = uuid.uuid4().hex[:16]
_RID_COUNTER = itertools.count()


def _new_rid_prefix() -> None:  # a forked child must not repeat its parent's ids
    global _RID_PREFIX, _RID_COUNTER
    _RID_PREFIX, _RID_COUNTER = uuid.uuid4().hex[:16], itertools.count()


os.register_at_fork(after_in_child=_new_rid_prefix)


def new_rid() -> str:
    """A request id unique across processes (random per-process prefix, then a counter)."""
    return f"{_RID_PREFIX}{next(_RID_COUNTER):016x}"


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One sequence to generate (``sampling.n == 1``).

    Attributes:
        rid: request id, unique among in-flight requests.
        input_ids: prompt token ids (non-empty).
        sampling: sampling parameters with ``n == 1``.
        return_logprob: whether the output carries per-token logprobs.
        images: the prompt's images (a vision-language model): one image placeholder
            run in ``input_ids`` per image, already expanded to its token count (see
            "images" in :mod:`realhf.api.core.data_api`).  Requests of one prompt may
            share the object.
    """

    input_ids: Tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    rid: str = ""
    return_logprob: bool = True
    images: Optional[VisionInputs] = None

    def __post_init__(self):
        ids = self.input_ids
        if not isinstance(ids, (list, tuple)) or not ids:
            raise _bad("input_ids", ids, "use a non-empty list of token ids")
        if not all(_is_int(t) and t >= 0 for t in ids):
            bad = next(t for t in ids if not (_is_int(t) and t >= 0))
            raise _bad("input_ids", bad, "every token id must be an integer >= 0")
        object.__setattr__(self, "input_ids", tuple(ids))
        if self.sampling.n != 1:
            raise _bad("sampling.n", self.sampling.n, "expand with SamplingParams.for_sample")
        if not self.rid:
            object.__setattr__(self, "rid", new_rid())


@dataclasses.dataclass(frozen=True)
class FinishReason:
    """Why a sequence ended: ``stop`` (a stop token), ``length`` or ``abort``."""

    type: FinishType
    matched: Optional[int] = None
    length: Optional[int] = None
    message: Optional[str] = None

    def __post_init__(self):
        if self.type not in FINISH_TYPES:
            raise ValueError(f"FinishReason.type={self.type!r} must be one of {FINISH_TYPES}")
        object.__setattr__(self, "type", FinishType(self.type))  # parsed once, here

    def to_json(self) -> Dict[str, Any]:
        """SGLang's JSON form (``FINISH_MATCHED_TOKEN``/``FINISH_LENGTH``/``FINISH_ABORT``)."""
        if self.type is FinishType.STOP:
            return {"type": "stop", "matched": self.matched}
        if self.type is FinishType.LENGTH:
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message or ""}

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "FinishReason":
        """Parse SGLang's ``finish_reason`` object."""
        return cls(
            type=d["type"],
            matched=d.get("matched"),
            length=d.get("length"),
            message=d.get("message"),
        )


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """The result of one :class:`GenerateRequest`.

    Attributes:
        rid: the request id.
        prompt_len: number of prompt tokens.
        output_ids: generated token ids (a matched stop token is included).
        output_logprobs: logprob of each generated token (empty when the
            request did not ask for logprobs).
        finish_reason: why generation ended.
        e2e_latency: seconds from submission to the final token.
    """

    rid: str
    prompt_len: int
    output_ids: Tuple[int, ...]
    output_logprobs: Tuple[float, ...]
    finish_reason: FinishReason
    e2e_latency: float = 0.0

    def to_sglang(
        self,
        *,
        text: Optional[str],
        return_logprob: bool,
        token_texts: Optional[Sequence[str]] = None,
    ) -> Dict[str, Any]:
        """The ``/generate`` response object of this output.

        ``token_texts`` (one string per output token) fills the third item of
        each ``output_token_logprobs`` entry (SGLang's ``return_text_in_logprobs``).
        """
        meta: Dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason.to_json(),
            "prompt_tokens": self.prompt_len,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": 0,
            "e2e_latency": self.e2e_latency,
        }
        if return_logprob:
            texts = token_texts if token_texts is not None else [None] * len(self.output_ids)
            meta["output_token_logprobs"] = [
                [lp, tok, t] for lp, tok, t in zip(self.output_logprobs, self.output_ids, texts)
            ]
            meta["input_token_logprobs"] = []
        out = {"output_ids": list(self.output_ids), "meta_info": meta}
        if text is not None:
            out["text"] = text
        return out


def parse_sglang_output(d: Dict[str, Any]) -> GenerateOutput:
    """Client side: one ``/generate`` response object back into a :class:`GenerateOutput`.

    Works on SGLang's answers and ours. ``output_ids`` is taken from the
    logprob entries when the server omitted it (SGLang with a tokenizer
    returns only ``text``).
    """
    meta = d["meta_info"]
    lps = meta.get("output_token_logprobs") or []
    ids = d.get("output_ids")
    if ids is None:
        ids = [int(e[1]) for e in lps]
    return GenerateOutput(
        rid=str(meta.get("id", "")),
        prompt_len=int(meta.get("prompt_tokens", 0)),
        output_ids=tuple(int(t) for t in ids),
        output_logprobs=tuple(float(e[0]) for e in lps),
        finish_reason=FinishReason.from_json(meta["finish_reason"]),
        e2e_latency=float(meta.get("e2e_latency", 0.0)),
    )


# Top-level /generate fields; the second group is accepted at neutral values only.
_GENERATE_FIELDS = (
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "rid",
    "stream",
    "return_text_in_logprobs",
    "logprob_start_len",
    "top_logprobs_num",
    "log_metrics",
    "image_data",
)
_NEUTRAL_GENERATE_FIELDS: Dict[str, Any] = {
    "input_embeds": None,
    "lora_path": None,
    "custom_logit_processor": None,
    "return_hidden_states": False,
    "session_params": None,
    "token_ids_logprob": None,
}


@dataclasses.dataclass(frozen=True)
class GenerateBatch:
    """A parsed ``/generate`` body: prompts × samples.

    Attributes:
        prompts: token ids per prompt, or ``None`` entries when ``texts`` holds
            text that the server must tokenize.
        texts: the prompt texts when the body used ``text``.
        sampling: one :class:`SamplingParams` per prompt (``n`` may exceed 1).
        return_logprob: per prompt.
        return_text_in_logprobs: fill the token text in logprob entries.
        rid: request ids per prompt (generated when absent).
        batched: whether the body carried a list of prompts (answer is a list).
        image_data: per prompt, its images as data URLs (``data:image/png;base64,...``),
            in the order of the prompt's image placeholders; empty lists without images.
    """

    prompts: List[Optional[List[int]]]
    texts: Optional[List[str]]
    sampling: List[SamplingParams]
    return_logprob: List[bool]
    return_text_in_logprobs: bool
    rid: List[str]
    batched: bool
    image_data: Optional[List[List[str]]] = None

    @property
    def returns_list(self) -> bool:
        """SGLang answers with a list for a batch input or for ``n > 1``."""
        return self.batched or any(s.n > 1 for s in self.sampling)

    def requests(
        self, prompts: List[List[int]], images: Optional[List[Optional[VisionInputs]]] = None
    ) -> List[List[GenerateRequest]]:
        """Expand into engine requests: per prompt, one request per sample (``images``: per
        prompt, its processed images)."""
        out = []
        for i, ids in enumerate(prompts):
            sp = self.sampling[i]
            reqs = []
            for j in range(sp.n):
                rid = self.rid[i] if sp.n == 1 else f"{self.rid[i]}-{j}"
                reqs.append(
                    GenerateRequest(
                        input_ids=tuple(ids),
                        sampling=sp.for_sample(j),
                        rid=rid,
                        return_logprob=self.return_logprob[i],
                        images=None if images is None else images[i],
                    )
                )
            out.append(reqs)
        return out


def _per_prompt(name: str, value: Any, n_prompts: int, batched: bool, default: Any) -> List[Any]:
    if value is None:
        return [default] * n_prompts
    if batched and isinstance(value, list):
        if len(value) != n_prompts:
            raise _bad(name, value, f"give one value per prompt ({n_prompts}) or a single value")
        return list(value)
    return [value] * n_prompts


def parse_generate_body(body: Any) -> GenerateBatch:
    """Validate a ``/generate`` JSON body (SGLang's ``GenerateReqInput``)."""
    if not isinstance(body, dict):
        raise _bad("body", type(body).__name__, "send a JSON object")
    for key, value in body.items():
        if key in _GENERATE_FIELDS:
            continue
        if key in _NEUTRAL_GENERATE_FIELDS:
            if value not in (None, _NEUTRAL_GENERATE_FIELDS[key]):
                raise _bad(key, value, "is not supported by the built-in engine; leave it unset")
            continue
        raise _bad(key, value, f"unknown field; accepted: {list(_GENERATE_FIELDS)}")
    if body.get("stream"):
        raise _bad("stream", body["stream"], "streaming is not supported; send stream=false")
    if body.get("logprob_start_len") not in (None, -1):
        raise _bad(
            "logprob_start_len",
            body["logprob_start_len"],
            "only output-token logprobs are returned; leave it unset or -1",
        )
    if body.get("top_logprobs_num") not in (None, 0):
        raise _bad("top_logprobs_num", body["top_logprobs_num"], "top logprobs are not supported")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise _bad("input_ids/text", None, "give exactly one of input_ids or text")
    texts: Optional[List[str]] = None
    if ids is not None:
        if not isinstance(ids, list) or not ids:
            raise _bad(
                "input_ids", ids, "use a non-empty list of token ids or a list of such lists"
            )
        batched = isinstance(ids[0], list)
        prompts = ids if batched else [ids]
        for p in prompts:
            if not isinstance(p, list) or not p or not all(_is_int(t) and t >= 0 for t in p):
                raise _bad(
                    "input_ids", p, "every prompt must be a non-empty list of token ids >= 0"
                )
    else:
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise _bad("text", text, "use a string or a non-empty list of strings")
        prompts = [None] * len(texts)
    n = len(prompts)
    sps = _per_prompt("sampling_params", body.get("sampling_params"), n, batched, None)
    sampling = [SamplingParams.from_dict(sp) for sp in sps]
    rlp = _per_prompt("return_logprob", body.get("return_logprob"), n, batched, False)
    for v in rlp:
        if not isinstance(v, bool):
            raise _bad("return_logprob", v, "use true or false")
    rit = body.get("return_text_in_logprobs", False)
    if not isinstance(rit, bool):
        raise _bad("return_text_in_logprobs", rit, "use true or false")
    rid = body.get("rid")
    if rid is None:
        rids = [new_rid() for _ in range(n)]
    elif isinstance(rid, str):
        # One rid for a batch: suffix it, since rids must be unique among the
        # requests in flight (abort and result routing go by rid).
        rids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
    elif isinstance(rid, list) and len(rid) == n and all(isinstance(r, str) for r in rid):
        rids = list(rid)
    else:
        raise _bad("rid", rid, "use a string or one string per prompt")
    image_data = _image_data(body.get("image_data"), n, batched)
    return GenerateBatch(
        prompts=[list(p) if p is not None else None for p in prompts],
        texts=texts,
        sampling=sampling,
        return_logprob=rlp,
        return_text_in_logprobs=rit,
        rid=rids,
        batched=batched,
        image_data=image_data,
    )


def _image_data(value: Any, n_prompts: int, batched: bool) -> Optional[List[List[str]]]:
    """SGLang's ``image_data``: for one prompt a data URL or a list of them; for a batch one
    such entry (or null) per prompt."""

    def one(v: Any) -> List[str]:
        v = [] if v is None else [v] if isinstance(v, str) else v
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise _bad(
                "image_data", v, "use a data URL (data:image/png;base64,...) or a list of them"
            )
        return list(v)

    if value is None:
        return None
    if not batched:
        return [one(value)]
    if not isinstance(value, list) or len(value) != n_prompts:
        raise _bad("image_data", value, f"give one entry (or null) per prompt ({n_prompts})")
    return [one(v) for v in value]
