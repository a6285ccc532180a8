"""Train step of a GRPO-shaped batch: full pack vs each prompt computed once, on CPU or CUDA.

A random qwen2-family ReaLModel runs forward + backward on ``--prompts`` prompts x
``--group`` answers (prompt and answer lengths drawn uniformly from the given ranges) three
ways: per-sequence attention over the full pack (the old default), bucketed attention over
the full pack (``sdpa_bucketed``, the default), and bucketed with :class:`SharedPrefix`
(each prompt once). Before timing it checks that the three agree (logits and gradients, to
the dtype's tolerance). Rounds alternate between the variants; medians are printed.

    python benchmark/shared_prefix.py                      # embedded-task shape, CPU
    python benchmark/shared_prefix.py --device cuda --dtype bfloat16 --hidden 1024 \\
        --layers 8 --prompt-len 200,400 --answer-len 50,600

The last line is one JSON object with ``shared_over_full`` and ``bucketed_over_per_seq``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from realhf.impl.model.modules.shared_prefix import SharedPrefix  # noqa: E402
from realhf.impl.model.nn.model_config import ReaLModelConfig  # noqa: E402
from realhf.impl.model.nn.real_model import ReaLModel  # noqa: E402


def _range(s: str):
    lo, hi = (int(x) for x in s.split(","))
    return lo, hi


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=268)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=_range, default=(7, 8))
    p.add_argument("--answer-len", type=_range, default=(5, 9))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    heads = max(1, args.hidden // 64)
    cfg = ReaLModelConfig(
        family="qwen2",
        n_layers=args.layers,
        hidden_dim=args.hidden,
        n_q_heads=heads,
        n_kv_heads=max(1, heads // 2),
        head_dim=64,
        intermediate_dim=2 * args.hidden,
        vocab_size=args.vocab,
        n_positions=4096,
        use_attention_bias=True,
        tied_embedding=True,
    )
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    seqs, plens = [], []
    for _ in range(args.prompts):
        n = int(torch.randint(args.prompt_len[0], args.prompt_len[1] + 1, (1,), generator=g))
        prompt = torch.randint(0, args.vocab, (n,), generator=g).tolist()
        for _ in range(args.group):
            m = int(torch.randint(args.answer_len[0], args.answer_len[1] + 1, (1,), generator=g))
            seqs.append(prompt + torch.randint(0, args.vocab, (m,), generator=g).tolist())
            plens.append(n)
    ids = torch.tensor(sum(seqs, []), device=dev)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32).to(dev)
    models = {
        impl: ReaLModel(cfg, dtype=dtype, device=dev, attn_impl=impl).train()
        for impl in ("sdpa_per_seq", "sdpa_bucketed")
    }
    models["sdpa_bucketed"].load_state_dict(models["sdpa_per_seq"].state_dict())
    w = torch.randn(len(ids), args.vocab, generator=g).to(dev, dtype)

    def step(name: str):
        model = models["sdpa_per_seq" if name == "per_seq" else "sdpa_bucketed"]
        model.zero_grad(set_to_none=True)
        sp = None
        if name == "shared":
            sp = SharedPrefix.from_prompts(ids, cu.tolist(), plens)
        out = model(ids, cu, shared_prefix=sp)
        (out.float() * w.float()).sum().backward()
        return out.detach().float(), torch.cat(
            [q.grad.float().flatten() for q in model.parameters()]
        )

    variants = ("per_seq", "bucketed", "shared")
    ref = step("per_seq")
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    agree = {}
    for name in variants[1:]:
        out, grad = step(name)
        d_out = float((out - ref[0]).abs().max() / ref[0].abs().max())
        d_grad = float((grad - ref[1]).abs().max() / ref[1].abs().max())
        agree[name] = {"logits_rel": d_out, "grad_rel": d_grad}
        if d_out > tol or d_grad > tol:
            raise SystemExit(f"{name} disagrees with per_seq: {agree[name]} (tolerance {tol})")
    times = {v: [] for v in variants}
    for _ in range(args.rounds + 1):  # the first round warms up
        for v in variants:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(v)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times[v].append(time.perf_counter() - t0)
    med = {v: sorted(ts[1:])[len(ts[1:]) // 2] for v, ts in times.items()}
    n_shared = len(SharedPrefix.from_prompts(ids, cu.tolist(), plens).keep)
    print(
        f"{args.prompts} prompts x {args.group} answers, {len(ids)} tokens ({n_shared} with each "
        f"prompt once), hidden {args.hidden}, {args.layers} layers, {args.dtype} on {dev}"
    )
    for v in variants:
        print(f"  {v:9} fwd+bwd {med[v] * 1e3:8.1f} ms")
    print(
        json.dumps(
            {
                "date": datetime.date.today().isoformat(),
                "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                "dtype": args.dtype,
                "tokens": len(ids),
                "tokens_shared": n_shared,
                "ms": {v: round(med[v] * 1e3, 2) for v in variants},
                "bucketed_over_per_seq": round(med["per_seq"] / med["bucketed"], 2),
                "shared_over_full": round(med["bucketed"] / med["shared"], 2),
                "agreement": agree,
            }
        )
    )


if __name__ == "__main__":
    main()
