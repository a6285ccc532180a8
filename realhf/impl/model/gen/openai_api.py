"""OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions`` over the engine.

Bodies are validated like the native API: unknown fields and unsupported
features (streaming, ``echo``, string ``stop`` sequences, penalties) are
:class:`InvalidRequestError` (HTTP 400). Besides OpenAI's fields, SGLang's
extra sampling fields are accepted (``top_k``, ``min_tokens``,
``stop_token_ids``, ``ignore_eos``), e.g. through the ``openai`` client's
``extra_body``. Finish reasons are ``stop``, ``length`` or ``abort`` (as SGLang).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

from realhf.api.core.gen_api import GenerateOutput, InvalidRequestError, SamplingParams, new_rid

_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "stream",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "top_k",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
}
_COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
_CHAT_FIELDS = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
# Accepted only at these neutral values.
_NEUTRAL = {
    "stop": (None, [], ""),
    "stream": (None, False),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "suffix": (None, ""),
    "skip_special_tokens": (None, True),
}


def _check_fields(body: Any, allowed: set) -> Dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    for k, v in body.items():
        if k not in allowed:
            raise InvalidRequestError(
                f"{k}={v!r} is invalid: unknown field; accepted: {sorted(allowed)}"
            )
        if k in _NEUTRAL and v not in _NEUTRAL[k]:
            raise InvalidRequestError(
                f"{k}={v!r} is invalid: not supported by the built-in engine "
                "(use stop_token_ids instead of stop strings; no streaming)"
            )
    return body


def _sampling(body: Dict[str, Any], max_tokens: Optional[int]) -> SamplingParams:
    fields = {
        "max_new_tokens": max_tokens,
        "min_new_tokens": body.get("min_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "n": body.get("n"),
        "stop_token_ids": body.get("stop_token_ids"),
        "ignore_eos": body.get("ignore_eos"),
        "sampling_seed": body.get("seed"),
    }
    return SamplingParams.from_dict({k: v for k, v in fields.items() if v is not None})


def completion_prompts(body: Any, tokenizer) -> Tuple[List[List[int]], SamplingParams, bool]:
    """Parse a ``/v1/completions`` body into token prompts, sampling params and ``logprobs``."""
    body = _check_fields(body, _COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequestError(
            f"prompt={prompt!r} is invalid: use a string, token ids or a list of them"
        )
    if all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    elif all(isinstance(p, list) for p in prompt):
        prompts = prompt
    elif all(isinstance(p, str) for p in prompt):
        if tokenizer is None:
            raise InvalidRequestError(
                "text prompts need a tokenizer; this server has none (send token ids)"
            )
        prompts = [tokenizer.encode(p) for p in prompt]
    else:
        raise InvalidRequestError("prompt mixes strings and token ids")
    sp = _sampling(body, body.get("max_tokens", 16))  # 16: OpenAI's completions default
    best_of = body.get("best_of")
    if best_of not in (None, sp.n):
        raise InvalidRequestError(f"best_of={best_of!r} is invalid: only best_of == n is supported")
    lp = body.get("logprobs")
    if lp not in (None, 0, 1) and not (isinstance(lp, int) and lp >= 0):
        raise InvalidRequestError(f"logprobs={lp!r} is invalid: use an integer >= 0")
    return prompts, sp, lp is not None


def _message_images(msgs: List[Dict[str, Any]]) -> List[str]:
    """The image URLs of the messages' content parts, in order; checks every part.

    A content is a string or a list of parts ``{"type": "text", "text": ...}`` /
    ``{"type": "image_url", "image_url": {"url": ...}}`` (OpenAI's form).
    """
    urls: List[str] = []
    for m in msgs:
        content = m.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list) or not content:
            raise InvalidRequestError(
                "a message's content must be a string or a non-empty list of parts"
            )
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                continue
            url = part.get("image_url") if kind == "image_url" else None
            url = url.get("url") if isinstance(url, dict) else None
            if not isinstance(url, str):
                raise InvalidRequestError(
                    'content parts are {"type": "text", "text": str} or {"type": '
                    '"image_url", "image_url": {"url": "data:image/png;base64,..."}}'
                )
            urls.append(url)
    return urls


def chat_prompt(body: Any, tokenizer) -> Tuple[List[int], SamplingParams, bool, List[str]]:
    """Parse a ``/v1/chat/completions`` body; the prompt comes from the chat template.

    Returns the prompt ids, sampling, whether log-probs are wanted, and the image URLs of
    the messages in order (the chat template writes one image placeholder per image part).
    """
    body = _check_fields(body, _CHAT_FIELDS)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "chat completions need a tokenizer with a chat template; this server has none"
        )
    msgs = body.get("messages")
    if (
        not isinstance(msgs, list)
        or not msgs
        or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), (str, list))
            for m in msgs
        )
    ):
        raise InvalidRequestError(
            "messages must be a non-empty list of {role, content} (a string, or a list of "
            "text and image_url parts)"
        )
    images = _message_images(msgs)
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    # The template writes every special token the model expects (BOS where it has one);
    # encode must not add its own on top.
    ids = tokenizer.encode(text, add_special_tokens=False)
    if body.get("top_logprobs") not in (None, 0):
        raise InvalidRequestError("top_logprobs > 0 is not supported")
    # max_completion_tokens replaced the deprecated max_tokens in OpenAI's chat API.
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return ids, _sampling(body, max_tokens), bool(body.get("logprobs")), images


def _usage(outs: List[GenerateOutput], prompt_lens: List[int]) -> Dict[str, int]:
    """Prompt tokens count once per prompt, completion tokens once per sample."""
    p = sum(prompt_lens)
    c = sum(len(o.output_ids) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _tokens(tokenizer, ids) -> List[str]:
    if tokenizer is None:
        return [str(t) for t in ids]
    return [tokenizer.decode([t]) for t in ids]


def _text(tokenizer, ids) -> str:
    return "" if tokenizer is None else tokenizer.decode(list(ids), skip_special_tokens=True)


def completion_response(
    outs: List[List[GenerateOutput]], model: str, tokenizer, logprobs: bool
) -> Dict[str, Any]:
    """OpenAI ``text_completion`` object; ``outs[i][j]`` is sample j of prompt i."""
    choices = []
    flat = [o for per_prompt in outs for o in per_prompt]
    for idx, o in enumerate(flat):
        lp = None
        if logprobs:
            toks = _tokens(tokenizer, o.output_ids)
            # Legacy completions logprobs: text_offset is each token's character offset in
            # the concatenated token strings; only the sampled token's log-prob is known,
            # so top_logprobs holds that one entry per position.
            offsets, pos = [], 0
            for t in toks:
                offsets.append(pos)
                pos += len(t)
            lp = {
                "tokens": toks,
                "token_logprobs": list(o.output_logprobs),
                "top_logprobs": [{t: l} for t, l in zip(toks, o.output_logprobs)],
                "text_offset": offsets,
            }
        choices.append(
            {
                "index": idx,
                "text": _text(tokenizer, o.output_ids),
                "logprobs": lp,
                "finish_reason": o.finish_reason.type,
                "matched_stop": o.finish_reason.matched,
            }
        )
    return {
        "id": f"cmpl-{new_rid()}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(flat, [per_prompt[0].prompt_len for per_prompt in outs]),
    }


def chat_response(
    outs: List[GenerateOutput], model: str, tokenizer, logprobs: bool
) -> Dict[str, Any]:
    """OpenAI ``chat.completion`` object for the samples of one conversation."""
    choices = []
    for idx, o in enumerate(outs):
        lp = None
        if logprobs:
            toks = _tokens(tokenizer, o.output_ids)
            lp = {
                "content": [
                    {"token": t, "logprob": l, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, l in zip(toks, o.output_logprobs)
                ]
            }
        choices.append(
            {
                "index": idx,
                "message": {"role": "assistant", "content": _text(tokenizer, o.output_ids)},
                "logprobs": lp,
                "finish_reason": o.finish_reason.type,
                "matched_stop": o.finish_reason.matched,
            }
        )
    return {
        "id": f"chatcmpl-{new_rid()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(outs, [outs[0].prompt_len]),
    }
