"""Train forward + backward of a GRPO-shaped vision-language batch: each answer's copy of its
prompt's images encoded (repeated) vs each distinct image encoded once (indexed).

A random Qwen2.5-VL shape (``realhf.apps.make_model``, written to ``--models-dir`` when
missing) runs ``--prompts`` prompts x ``--group`` answers, one ``--image``-px square image
per prompt, answers of ``--answer-len`` tokens.  It first checks that the two ways agree
(logits; the tower's gradient), then alternates them for ``--rounds`` and prints medians.

    python benchmark/vision.py                                   # qwen2.5-vl-3b, 2 LM layers
    python benchmark/vision.py --layers 36 --group 8 --image 448

The last line is one JSON object with ``indexed_over_repeated`` (time ratio) and the host.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmark.scale import host_facts  # noqa: E402
from realhf.api.core.data_api import VisionInputs  # noqa: E402
from realhf.apps.make_model import make_model  # noqa: E402
from realhf.impl.dataset.images import VisionProcessor  # noqa: E402
from realhf.impl.model.nn.real_model import ReaLModel  # noqa: E402


def batch(model_dir: str, prompts: int, group: int, image: int, answer_len: int, seed: int):
    """(tokens, cu_seqlens, images repeated per answer, images indexed)"""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    proc = VisionProcessor.from_model_dir(model_dir)
    seqs, pixels, grids = [], [], []
    for _ in range(prompts):
        img = Image.fromarray((torch.rand(image, image, 3, generator=g) * 255).byte().numpy())
        ids, pix, grid = proc([5, proc.image_token_id, 6, 7], [img])
        pixels.append(pix)
        grids.append(grid)
        for _ in range(group):
            seqs.append(ids + torch.randint(10, 200, (answer_len,), generator=g).tolist())
    tokens = torch.tensor([t for s in seqs for t in s])
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    repeated = VisionInputs(
        torch.cat([p for p in pixels for _ in range(group)]),
        torch.cat([x for x in grids for _ in range(group)]),
    )
    indexed = VisionInputs(
        torch.cat(pixels), torch.cat(grids), torch.arange(prompts).repeat_interleave(group)
    )
    return tokens, cu, repeated, indexed


def step(model: ReaLModel, tokens, cu, images):
    """(seconds, logits, the patch embedding's gradient) of one forward + backward."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    out = model(tokens, cu, images=images)
    out.float().logsumexp(-1).mean().backward()
    dt = time.perf_counter() - t0
    return dt, out.detach(), model.embedding.visual.patch_embed.weight.grad.detach().clone()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-vl-3b")
    p.add_argument("--layers", type=int, default=2, help="language-model layers kept")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--models-dir", default=os.path.expanduser("~/.cache/realhf/shapes"))
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--image", type=int, default=224, help="side of the square images (px)")
    p.add_argument("--answer-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    model_dir = os.path.join(args.models_dir, f"{args.shape}-{args.layers}l")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        print(f"writing {args.shape} with {args.layers} layers to {model_dir}", flush=True)
        make_model(args.shape, model_dir, layers=args.layers, dtype="bfloat16", overwrite=True)
    model = ReaLModel.from_hf(model_dir, dtype=getattr(torch, args.dtype))
    tokens, cu, repeated, indexed = batch(
        model_dir, args.prompts, args.group, args.image, args.answer_len, seed=1
    )
    # The same computation either way: check before timing.
    _, out_r, grad_r = step(model, tokens, cu, repeated)
    _, out_i, grad_i = step(model, tokens, cu, indexed)
    tol = 1e-5 if args.dtype == "float32" else 2e-2
    scale = out_r.float().abs().max().item()
    assert (out_r.float() - out_i.float()).abs().max().item() <= tol * max(1.0, scale)
    gscale = grad_r.float().abs().max().item()
    assert (grad_r.float() - grad_i.float()).abs().max().item() <= tol * max(1.0, gscale) * 4
    times = {"repeated": [], "indexed": []}
    for _ in range(args.rounds):
        for name, images in (("repeated", repeated), ("indexed", indexed)):
            times[name].append(step(model, tokens, cu, images)[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.shape} ({args.layers} LM layers, {args.dtype}), {args.prompts} prompts x "
          f"{args.group} answers, {args.image}px images, {len(tokens)} tokens")  # fmt: skip
    for k in ("repeated", "indexed"):
        n = repeated.grid_thw.shape[0] if k == "repeated" else indexed.grid_thw.shape[0]
        print(f"  {k:9s} {med[k]:7.2f} s  ({n} images encoded)")
    result = {
        "indexed_over_repeated": round(med["indexed"] / med["repeated"], 3),
        "seconds": {k: round(v, 3) for k, v in med.items()},
        "args": vars(args),
        "host": host_facts(),
        "date": datetime.date.today().isoformat(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
