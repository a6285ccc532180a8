"""Train forward + backward of a GRPO-shaped vision-language batch: each answer's copy of its
prompt's images encoded (repeated), each distinct image encoded once (indexed), and also
each prompt computed once by the language model (shared: SharedPrefix).

A random Qwen2.5-VL shape (``realhf.apps.make_model``, written to ``--models-dir`` when
missing) runs ``--prompts`` prompts x ``--group`` answers, one ``--image``-px square image
per prompt, answers of ``--answer-len`` tokens.  It first checks that the two ways agree
(logits; the tower's gradient), then alternates them for ``--rounds`` and prints medians.

    python benchmark/vision.py                                   # qwen2.5-vl-3b, 2 LM layers
    python benchmark/vision.py --layers 36 --group 8 --image 448

The last line is one JSON object with ``indexed_over_repeated`` and ``shared_over_indexed``
(time ratios) and the host.
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
from realhf.impl.model.modules.shared_prefix import SharedPrefix  # noqa: E402
from realhf.impl.model.nn.real_model import ReaLModel  # noqa: E402


def batch(model_dir: str, prompts: int, group: int, image: int, answer_len: int, seed: int):
    """(tokens, cu_seqlens, images repeated per answer, images indexed, shared prompts)"""
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
    index = torch.arange(prompts).repeat_interleave(group)
    seq_images = [(int(i),) for i in index]
    indexed = VisionInputs(torch.cat(pixels), torch.cat(grids), index, seq_images)
    plens = [len(s) - answer_len for s in seqs]
    shared = SharedPrefix.from_prompts(tokens, cu.tolist(), plens, seq_images)
    return tokens, cu, repeated, indexed, shared


def step(model: ReaLModel, tokens, cu, images, shared=None):
    """(seconds, logits, the patch embedding's gradient) of one forward + backward."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    out = model(tokens, cu, images=images, shared_prefix=shared)
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
    tokens, cu, repeated, indexed, shared = batch(
        model_dir, args.prompts, args.group, args.image, args.answer_len, seed=1
    )
    # The same computation either way: check before timing.
    _, out_r, grad_r = step(model, tokens, cu, repeated)
    tol = 1e-5 if args.dtype == "float32" else 2e-2
    scale = out_r.float().abs().max().item()
    gscale = grad_r.float().abs().max().item()
    for sp in (None, shared):
        _, out, grad = step(model, tokens, cu, indexed, sp)
        assert (out_r.float() - out.float()).abs().max().item() <= tol * max(1.0, scale)
        assert (grad_r.float() - grad.float()).abs().max().item() <= tol * max(1.0, gscale) * 4
    variants = (("repeated", repeated, None), ("indexed", indexed, None),
                ("shared", indexed, shared))  # fmt: skip
    times = {name: [] for name, _, _ in variants}
    for _ in range(args.rounds):
        for name, images, sp in variants:
            times[name].append(step(model, tokens, cu, images, sp)[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.shape} ({args.layers} LM layers, {args.dtype}), {args.prompts} prompts x "
          f"{args.group} answers, {args.image}px images, {len(tokens)} tokens")  # fmt: skip
    rows = len(tokens) if shared is None else shared.keep.numel()
    for k in ("repeated", "indexed", "shared"):
        n = repeated.grid_thw.shape[0] if k == "repeated" else indexed.grid_thw.shape[0]
        print(f"  {k:9s} {med[k]:7.2f} s  ({n} images encoded, "
              f"{rows if k == 'shared' else len(tokens)} rows)")  # fmt: skip
    result = {
        "indexed_over_repeated": round(med["indexed"] / med["repeated"], 3),
        "shared_over_indexed": round(med["shared"] / med["indexed"], 3),
        "seconds": {k: round(v, 3) for k, v in med.items()},
        "args": vars(args),
        "host": host_facts(),
        "date": datetime.date.today().isoformat(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
