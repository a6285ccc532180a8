"""Generate answers for a batch of prompts with the built-in engine, in process.

Sync PPO generates with the actor's live weights: the engine runs over the very ReaLModel
the trainer updates (no copy, no HTTP) and is closed after the call, so its KV cache does
not hold memory during training. Each answer is sampled with a seed derived from
``(seed, version, prompt id, answer index)``, so the result does not depend on how the
prompts were split over data-parallel ranks or batched inside the engine.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from realhf.api.core.data_api import SequenceSample, VisionInputs, item_images
from realhf.api.core.gen_api import GenerateOutput, GenerateRequest
from realhf.api.core.model_api import GenerationHyperparameters
from realhf.impl.model.gen.engine import GenerationEngine
from realhf.impl.model.gen.engine_config import EngineConfig
from realhf.impl.model.gen.kv_cache import PAGE_SIZE, pages_for, tokens_to_hold
from realhf.impl.model.gen.sequence import prompt_key
from realhf.impl.model.interface.helpers import require_keys, stable_seed

__all__ = ["generate_offline", "outputs_to_sample"]

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _token_id(tokenizer, name: str) -> Optional[int]:
    v = getattr(tokenizer, name, None) if tokenizer is not None else None
    return None if v is None else int(v)


def generate_offline(
    model: torch.nn.Module,
    prompts: SequenceSample,
    gconfig: GenerationHyperparameters,
    tokenizer=None,
    *,
    seed: int = 1,
    version: int = 0,
    max_running_requests: int = 64,
    timeout_s: float = 3600.0,
) -> SequenceSample:
    """Sample ``gconfig.n`` answers for each prompt of ``prompts`` (key ``packed_prompts``).

    Args:
        model: a ReaLModel (used in place, under ``torch.inference_mode``).
        prompts: one prompt sequence per item.
        gconfig: sampling settings; answers stop at the tokenizer's EOS/pad token, at
            ``gconfig.stop_token_ids``, or after ``max_new_tokens`` (capped so that prompt +
            answer fits the model's context).
        tokenizer: provides ``eos_token_id`` / ``pad_token_id`` (optional).
        seed, version: make sampling reproducible (see the module docstring).
        max_running_requests: sequences decoded together.
        timeout_s: most seconds the whole call may take.

    Returns:
        See :func:`outputs_to_sample`.
    """
    require_keys(prompts, ["packed_prompts"], "generate")
    per_item = prompts.seqlens["packed_prompts"]
    if any(len(lens) != 1 for lens in per_item):
        raise ValueError("generate expects one prompt sequence per item in packed_prompts")
    flat = prompts.data["packed_prompts"].tolist()
    context = model.config.n_positions
    requests: List[GenerateRequest] = []
    offset = 0
    base = gconfig.to_sampling_params(vocab_size=model.config.vocab_size)
    images = _item_images(prompts)
    for item_id, (plen,), prompt_images in zip(prompts.ids, per_item, images):
        prompt = flat[offset : offset + plen]
        offset += plen
        if plen < 1 or plen >= context:
            raise ValueError(
                f"prompt {item_id!r} has {plen} tokens; the model's context is {context} tokens, "
                f"so a prompt needs 1..{context - 1} tokens (shorten prompts or filter them in the "
                "dataset)"
            )
        # One seed per prompt; for_sample(j) derives answer j's from it, so an answer's
        # tokens do not depend on which rank or engine batch it landed in.
        sp = dataclasses.replace(
            base,
            max_new_tokens=min(gconfig.max_new_tokens, context - plen),
            min_new_tokens=min(gconfig.min_new_tokens, context - plen),
            sampling_seed=stable_seed(seed, version, item_id),
        )
        for j in range(gconfig.n):
            requests.append(
                GenerateRequest(
                    input_ids=prompt,
                    sampling=sp.for_sample(j),
                    rid=f"{item_id}@{j}",
                    images=prompt_images,  # (one object: the engine prefills the prompt once)
                )
            )

    longest = max(len(r.input_ids) + r.sampling.max_new_tokens for r in requests)
    running = max(1, min(max_running_requests, len(requests)))
    # The cache holds every request at once (a group's prompt once), or the longest
    # `running` of them, whichever is smaller.
    kv_tokens = min(
        tokens_to_hold(
            (prompt_key(r), len(r.input_ids), r.sampling.max_new_tokens) for r in requests
        ),
        running * pages_for(longest) * PAGE_SIZE,
    )
    cfg = EngineConfig(
        max_running_requests=running,
        context_length=max(2, min(context, longest)),
        kv_cache_tokens=max(2, kv_tokens),
        max_prefill_tokens=max(4096, max(len(r.input_ids) for r in requests)),
        dtype=_DTYPE_NAMES[model.flat_params.dtype],
        device=str(model.flat_params.device),
        request_timeout_s=timeout_s,
    )
    eos = _token_id(tokenizer, "eos_token_id")
    engine = GenerationEngine(
        model,
        cfg,
        eos_token_ids=[] if eos is None else [eos],
        pad_token_id=_token_id(tokenizer, "pad_token_id"),
    )
    was_training = model.training
    model.eval()
    # All queued before the first step, so the engine admits them at once: tensor-parallel
    # ranks then run the same batches in the same order (their forwards are collectives).
    # They run on this thread (see GenerationEngine.run_until_idle for why not its own).
    futures = engine.submit_all(requests)
    try:
        engine.run_until_idle(timeout_s)
        outputs = engine.collect(requests, futures, timeout=1.0)  # resolved by now
    finally:
        # Closing frees the KV cache before training needs the memory.
        engine.close()
        model.train(was_training)
    out = outputs_to_sample(prompts.ids, gconfig.n, requests, outputs, version)
    # The prompts' metadata (e.g. reference solutions) travels on to the reward interface.
    out.metadata = {k: list(v) for k, v in prompts.metadata.items()}
    return out


def _item_images(prompts: SequenceSample) -> List[Optional[VisionInputs]]:
    """Each item's images (None for an item without, or a sample without image keys)."""
    items = item_images(prompts)
    if items is None:
        return [None] * len(prompts)
    return [VisionInputs(p, g) if g.shape[0] else None for p, g in items]


def outputs_to_sample(
    item_ids: List[str],
    n: int,
    requests: List[GenerateRequest],
    outputs: List[GenerateOutput],
    version: int,
) -> SequenceSample:
    """Pack engine outputs, ``n`` consecutive answers per prompt, into a SequenceSample.

    Keys (per sequence of length L = prompt + answer): ``packed_input_ids`` [L],
    ``prompt_mask`` [L] bool, ``packed_logprobs`` [L-1] float32 (the sampler's log-prob of
    each generated token, 0 over the prompt), ``seq_no_eos_mask`` [1] bool (True when the
    answer was cut by the length limit or aborted), ``version_start`` / ``version_end``
    [1] int64 (the weight version that generated it).
    """
    ids, pmask, logps, lens, no_eos = [], [], [], [], []
    for req, out in zip(requests, outputs):
        plen, ans = len(req.input_ids), list(out.output_ids)
        if len(out.output_logprobs) != len(ans):
            raise RuntimeError(
                f"request {req.rid}: the engine returned {len(out.output_logprobs)} logprobs for "
                f"{len(ans)} tokens"
            )
        ids.extend(req.input_ids)
        ids.extend(ans)
        pmask.extend([True] * plen + [False] * len(ans))
        # Shifted: entry t belongs to token t+1. The first plen-1 entries predict prompt
        # tokens (no behaviour log-prob: 0); the rest are the answer's, in order.
        logps.extend([0.0] * (plen - 1) + list(out.output_logprobs))
        lens.append(plen + len(ans))
        no_eos.append(out.finish_reason.type != "stop")  # cut by the length limit or aborted
    n_seqs = len(lens)
    per_item = [lens[i * n : (i + 1) * n] for i in range(len(item_ids))]
    return SequenceSample.from_default(
        ids=item_ids,
        seqlens=per_item,
        data={
            "packed_input_ids": torch.tensor(ids, dtype=torch.long),
            "prompt_mask": torch.tensor(pmask, dtype=torch.bool),
            "packed_logprobs": torch.tensor(logps, dtype=torch.float32),
            "seq_no_eos_mask": torch.tensor(no_eos, dtype=torch.bool),
            "version_start": torch.full((n_seqs,), version, dtype=torch.long),
            "version_end": torch.full((n_seqs,), version, dtype=torch.long),
        },
    )
