"""Training-step throughput: ReaLModel on a packed batch vs HuggingFace on the
same sequences padded into a batch.

RL answers vary a lot in length, so a padded batch wastes compute on padding
(and on attention across it); ReaLModel runs the packed tokens only.  Both
models hold the same weights (a random qwen2-architecture model, the family of
the embedded default) and compute the same next-token cross-entropy, forward
and backward.  Lengths are drawn uniformly from 10%-100% of ``--max-len``.
The defaults (answers up to 1,024 tokens on a 256-wide model) keep the ratio of
sequence length to model width close to RL on real models (answers of several
thousand tokens on 2-4k-wide models), so attention weighs about as much as it
does there, while a step stays a few seconds on a CPU.

Also timed: the attention op alone on the batch's lengths, per-sequence SDPA
(the CPU default) vs one SDPA call with a block-diagonal causal mask.

Run (about 1-2 minutes on a 2-core CPU):

    python benchmark/train_step.py

The last line printed is one JSON object with the figures, including
``train_speedup_vs_hf_padded``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
import transformers

from realhf.impl.model import ReaLModel
from realhf.impl.model.modules.attention import packed_causal_attention

# tiny random HF models (no downloads) are test scaffolding, kept in tests/helpers/
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "helpers")
)
from tiny_models import make_tiny_hf_model  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-seqs", type=int, default=8)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--iters", type=int, default=5, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads; 1 keeps timings stable on a shared machine, where "
        "a multi-threaded op stalls whenever another process takes one of its cores",
    )
    return p.parse_args()


def make_batch(n_seqs, max_len, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(1, max_len // 10), max_len + 1, (n_seqs,), generator=g).tolist()
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lens]
    return lens, seqs


def packed_loss(model, ids, cu):
    """Next-token cross-entropy summed over every sequence of the pack.

    Labels are the tokens shifted by one inside each sequence; a sequence's
    last position has no label (ignored), so the logits are never copied.
    """
    logits = model(ids, cu)
    labels = torch.roll(ids, -1)
    labels[cu[1:].long() - 1] = -100
    return F.cross_entropy(logits, labels, reduction="sum")


def padded_loss(hf, input_ids, attn_mask):
    """The same loss on a right-padded batch (padding and last positions ignored)."""
    logits = hf(input_ids=input_ids, attention_mask=attn_mask).logits
    labels = torch.roll(input_ids, -1, dims=1)
    labels = labels.masked_fill(torch.roll(attn_mask, -1, dims=1) == 0, -100)
    labels[:, -1] = -100
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), reduction="sum")


def time_interleaved(steps, iters, warmup):
    """Seconds of each timed ``step()`` in ``steps`` (name -> callable): lists.

    Steps alternate within every round so that load from other processes on a
    shared machine hits all contenders alike.
    """
    times = {name: [] for name in steps}
    for i in range(warmup + iters):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def time_attention(lens, heads, kv_heads, head_dim, iters, seed):
    """Forward+backward seconds of the two CPU attention implementations alone
    on the batch's lengths: per-sequence SDPA vs one block-diagonal mask."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    qkv = [
        torch.randn(T, h, head_dim, generator=g, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    ]

    def step_of(impl):
        return lambda: packed_causal_attention(*qkv, cu, impl=impl).sum().backward()

    times = time_interleaved(
        {"sdpa_per_seq": step_of("sdpa_per_seq"), "sdpa_masked": step_of("sdpa_masked")}, iters, 1
    )
    return {name: statistics.median(ts) for name, ts in times.items()}


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    heads = max(1, args.hidden // 64)
    with tempfile.TemporaryDirectory() as d:
        make_tiny_hf_model(
            "qwen2",
            d,
            seed=args.seed,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
            head_dim=args.hidden // heads,
            intermediate_size=args.hidden * 2,
            vocab_size=args.vocab,
            max_position_embeddings=args.max_len,
            tie_word_embeddings=True,
        )
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).train()
        ours = ReaLModel.from_hf(d).train()

    lens, seqs = make_batch(args.n_seqs, args.max_len, args.vocab, args.seed)
    ids = torch.cat(seqs)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    L = max(lens)
    padded = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = s
        mask[i, : len(s)] = 1
    n_tokens = sum(lens)

    # Same weights, same loss: check before timing anything.
    with torch.no_grad():
        l_ours = packed_loss(ours, ids, cu).item()
        l_hf = padded_loss(hf, padded, mask).item()
    rel = abs(l_ours - l_hf) / abs(l_hf)
    if rel > 1e-4:
        raise RuntimeError(f"losses differ: ours {l_ours} vs HF {l_hf} (relative {rel:.2e})")

    def step_of(model, loss_fn):
        def step():
            loss_fn().backward()
            model.zero_grad(set_to_none=True)

        return step

    t = time_interleaved(
        {
            "hf": step_of(hf, lambda: padded_loss(hf, padded, mask)),
            "ours": step_of(ours, lambda: packed_loss(ours, ids, cu)),
        },
        args.iters,
        args.warmup,
    )
    t_hf, t_ours = statistics.median(t["hf"]), statistics.median(t["ours"])
    # Median of per-round ratios: robust to load that changes between rounds.
    speedup = statistics.median(h / o for h, o in zip(t["hf"], t["ours"]))
    kv_heads = ours.config.n_kv_heads
    ta = time_attention(lens, heads, kv_heads, ours.config.head_dim, args.iters, args.seed)

    result = {
        "benchmark": "train_step",
        "date": datetime.date.today().isoformat(),
        "threads": torch.get_num_threads(),
        "model": (
            f"qwen2 hidden={args.hidden} layers={args.layers} heads={heads} vocab={args.vocab}"
        ),
        "n_seqs": args.n_seqs,
        "max_len": args.max_len,
        "real_tokens": n_tokens,
        "padded_tokens": len(seqs) * L,
        "padding_fraction": round(1 - n_tokens / (len(seqs) * L), 3),
        "loss_rel_diff": rel,
        "hf_padded_step_s": round(t_hf, 4),
        "ours_packed_step_s": round(t_ours, 4),
        "hf_padded_tokens_per_s": round(n_tokens / t_hf, 1),
        "ours_tokens_per_s": round(n_tokens / t_ours, 1),
        "hf_step_s_all": [round(x, 3) for x in t["hf"]],
        "ours_step_s_all": [round(x, 3) for x in t["ours"]],
        "train_speedup_vs_hf_padded": round(speedup, 3),
        "attn_per_seq_fwd_bwd_s": round(ta["sdpa_per_seq"], 4),
        "attn_masked_fwd_bwd_s": round(ta["sdpa_masked"], 4),
        "attn_per_seq_speedup_vs_masked": round(ta["sdpa_masked"] / ta["sdpa_per_seq"], 3),
    }
    print(f"{n_tokens} real tokens in {len(seqs)} sequences (padded batch {len(seqs)}x{L})")
    print(f"HF padded          : {t_hf:.3f} s/step  {n_tokens / t_hf:9.1f} tokens/s")
    print(f"ReaLModel packed   : {t_ours:.3f} s/step  {n_tokens / t_ours:9.1f} tokens/s")
    print(
        f"attention alone (fwd+bwd, {heads} q / {kv_heads} kv heads): per-sequence SDPA "
        f"{ta['sdpa_per_seq']:.3f} s, block-diagonal mask {ta['sdpa_masked']:.3f} s"
    )
    print(f"speedup vs HF padded (median of per-round ratios): {speedup:.2f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
