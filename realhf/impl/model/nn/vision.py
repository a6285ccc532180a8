"""The vision tower of a vision-language ReaLModel (Qwen2.5-VL) and its positions.

An image enters the model twice:

* its **pixels** go through the vision transformer (:func:`vision_forward`), whose merged
  tokens replace the image's placeholder tokens (``image_token_id``) in the embedded
  prompt — one placeholder per ``spatial_merge_size ** 2`` patches, which the HF
  processor writes into the prompt;
* its **grid** (``[t, h, w]`` patches) gives the placeholders their multimodal RoPE
  positions (:func:`mrope_positions`): temporal, height and width indices offset by the
  text before them, while text tokens carry three equal positions.  After an image the
  text positions continue from the largest one, so a sequence's positions end below its
  length; ``delta = last position + 1 - length`` is what decoding adds to a new token's
  index (:class:`MRopePositions`).

A packed batch carries its images as :class:`VisionInputs`: every image's patches
(``pixel_values [N, patch_dim]``, the HF image processor's layout: patches of a merge
unit next to each other) and grids (``grid_thw [n_images, 3]``), in the order their
placeholders appear in the packed tokens.

The tower is replicated under tensor parallelism (each rank runs all of it; its weights
are small next to the language model's) and lives on the first pipeline stage, with the
token embedding.  Parameter names (inside layer 0, prefix ``visual.``) follow HF's
modules: ``patch_embed.weight`` (HF's Conv3d kernel flattened: the convolution has
stride = kernel, so it is one matrix product per patch), ``blocks.{i}.norm1/norm2``,
``blocks.{i}.attn.qkv/proj``, ``blocks.{i}.mlp.{gate,up,down}_proj``,
``merger.ln_q``, ``merger.fc1/fc2`` (HF's ``merger.mlp.0/2``).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from realhf.api.core.data_api import VisionInputs
from realhf.impl.model.modules.norm import rms_norm
from realhf.impl.model.nn.model_config import VisionConfig

__all__ = ["VisionInputs", "MRopePositions", "mrope_positions", "vision_forward", "window_order"]

ParamDecl = Tuple[str, Tuple[int, ...], str]


def vision_param_decls(v: VisionConfig) -> List[ParamDecl]:
    """Parameters of the vision tower, named under ``visual.``."""
    D, inner, merged = v.hidden_dim, v.intermediate_dim, v.hidden_dim * v.merge_unit
    d: List[ParamDecl] = [("visual.patch_embed.weight", (D, v.patch_dim), "normal")]
    for i in range(v.depth):
        p = f"visual.blocks.{i}."
        d += [
            (p + "norm1.weight", (D,), "ones"),
            (p + "norm2.weight", (D,), "ones"),
            (p + "attn.qkv.weight", (3 * D, D), "normal"),
            (p + "attn.qkv.bias", (3 * D,), "zeros"),
            (p + "attn.proj.weight", (D, D), "normal"),
            (p + "attn.proj.bias", (D,), "zeros"),
            (p + "mlp.gate_proj.weight", (inner, D), "normal"),
            (p + "mlp.gate_proj.bias", (inner,), "zeros"),
            (p + "mlp.up_proj.weight", (inner, D), "normal"),
            (p + "mlp.up_proj.bias", (inner,), "zeros"),
            (p + "mlp.down_proj.weight", (D, inner), "normal"),
            (p + "mlp.down_proj.bias", (D,), "zeros"),
        ]
    d += [
        ("visual.merger.ln_q.weight", (D,), "ones"),
        ("visual.merger.fc1.weight", (merged, merged), "normal"),
        ("visual.merger.fc1.bias", (merged,), "zeros"),
        ("visual.merger.fc2.weight", (v.out_dim, merged), "normal"),
        ("visual.merger.fc2.bias", (v.out_dim,), "zeros"),
    ]
    return d


# ---- the ViT -------------------------------------------------------------


def _patch_positions(grid_thw: torch.Tensor, m: int) -> torch.Tensor:
    """``[N, 2]`` (row, column) of every patch, in the processor's merge-unit order."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
        cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
        # Merge units are contiguous: (block row, block column, row in block, column in block).
        rc = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], -1)
        out.append(rc.repeat(t, 1))
    return torch.cat(out)


def window_order(grid_thw: torch.Tensor, v: VisionConfig) -> Tuple[torch.Tensor, List[int]]:
    """Merge units reordered window by window, and each window's length in patches.

    A window is ``window_size`` pixels square (``window_size / patch / merge`` merge units;
    the last row and column of windows may be smaller).  Windows are taken frame by frame,
    row by row; inside one, units keep their row-major order.  Returns the permutation of
    merge-unit indices (over the whole batch) and the window lengths (in patches).
    """
    m = v.spatial_merge_size
    per = v.window_size // m // v.patch_size
    order: List[torch.Tensor] = []
    lengths: List[int] = []
    offset = 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // m, w // m
        idx = torch.arange(t * gh * gw).view(t, gh, gw) + offset
        for f in range(t):
            for r in range(0, gh, per):
                for c in range(0, gw, per):
                    win = idx[f, r : r + per, c : c + per].reshape(-1)
                    order.append(win)
                    lengths.append(win.numel() * v.merge_unit)
        offset += t * gh * gw
    return torch.cat(order), lengths


def _rope_2d(rc: torch.Tensor, v: VisionConfig, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin ``[N, head_dim]``: a quarter of the frequencies per axis, as HF."""
    quarter = v.head_dim // 2
    inv_freq = 1.0 / (v.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
    freqs = rc.to(device).float()[..., None] * inv_freq.to(device)  # [N, 2, head_dim / 4]
    freqs = freqs.flatten(1)  # (row frequencies, column frequencies)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    half = xf.shape[-1] // 2
    rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None] + rot * sin[:, None]).to(x.dtype)


def _segments_attention(q, k, v, lengths: Sequence[int]) -> torch.Tensor:
    """Bidirectional attention inside each segment of ``lengths`` rows (``[N, heads, d]``);
    segments of one length are batched together."""
    out = torch.empty_like(q)
    starts, pos = [], 0
    for n in lengths:
        starts.append(pos)
        pos += n
    by_len = {}
    for s, n in zip(starts, lengths):
        by_len.setdefault(n, []).append(s)
    for n, ss in by_len.items():
        rows = (torch.tensor(ss)[:, None] + torch.arange(n)[None]).to(q.device)  # [b, n]
        qb, kb, vb = (x[rows].transpose(1, 2) for x in (q, k, v))  # [b, heads, n, d]
        o = F.scaled_dot_product_attention(qb, kb, vb)
        out[rows.flatten()] = o.transpose(1, 2).flatten(0, 1)
    return out


def vision_forward(visual, v: VisionConfig, images: VisionInputs, act) -> torch.Tensor:
    """Merged image tokens ``[n_placeholders, out_dim]`` of ``images``, in placeholder order
    (each distinct image encoded once).

    ``visual`` is the module holding the ``visual.*`` parameters; ``act`` the MLP
    activation function.
    """
    w_patch = visual.patch_embed.weight
    grid = images.grid_thw.cpu()
    x = F.linear(images.pixel_values.to(w_patch.dtype), w_patch)  # [N, D]
    N, D, unit = x.shape[0], v.hidden_dim, v.merge_unit
    order, win_lengths = window_order(grid, v)
    order = order.to(x.device)
    x = x.view(N // unit, unit, D)[order].reshape(N, D)
    rc = _patch_positions(grid, v.spatial_merge_size).view(N // unit, unit, 2)
    cos, sin = _rope_2d(rc[order.cpu()].reshape(N, 2), v, x.device)
    frames = [h * w for t, h, w in grid.tolist() for _ in range(t)]
    eps, H = v.layer_norm_epsilon, v.n_heads
    for i in range(v.depth):
        blk = getattr(visual.blocks, str(i))
        y = rms_norm(x, blk.norm1.weight, eps)
        q, k, val = F.linear(y, blk.attn.qkv.weight, blk.attn.qkv.bias).view(N, 3, H, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        lengths = frames if i in v.fullatt_block_indexes else win_lengths
        o = _segments_attention(q, k, val, lengths).reshape(N, D)
        x = x + F.linear(o, blk.attn.proj.weight, blk.attn.proj.bias)
        y = rms_norm(x, blk.norm2.weight, eps)
        mlp = blk.mlp
        a = act(F.linear(y, mlp.gate_proj.weight, mlp.gate_proj.bias))
        a = a * F.linear(y, mlp.up_proj.weight, mlp.up_proj.bias)
        x = x + F.linear(a, mlp.down_proj.weight, mlp.down_proj.bias)
    mg = visual.merger
    y = rms_norm(x, mg.ln_q.weight, eps).view(N // unit, unit * D)
    y = F.linear(F.gelu(F.linear(y, mg.fc1.weight, mg.fc1.bias)), mg.fc2.weight, mg.fc2.bias)
    y = y[torch.argsort(order)]
    if images.index is None:
        return y
    # Each distinct image was encoded once; its tokens go to every placeholder run of it.
    parts = y.split((grid.prod(-1) // unit).tolist())
    return torch.cat([parts[i] for i in images.index.tolist()])


# ---- multimodal RoPE positions ---------------------------------------------


@dataclasses.dataclass
class MRopePositions:
    """Positions of a packed batch with images.

    Attributes:
        position_ids: ``LongTensor[3, T]`` (temporal, height, width) of every token.
        deltas: ``[B]`` per sequence, ``last position + 1 - length`` (0 without images):
            token ``L`` of a sequence (counting from 0) decodes at position ``L + delta``
            on all three axes.
    """

    position_ids: torch.Tensor
    deltas: List[int]


def mrope_positions(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    grid_thw: Optional[torch.Tensor],
    v: VisionConfig,
) -> MRopePositions:
    """Multimodal RoPE positions of a packed batch (see the module docstring).

    Images are matched to runs of ``image_token_id`` in order; an image fills
    ``t * h * w / merge**2`` consecutive placeholders.  Raises ``ValueError`` when the
    placeholders and the images do not match (an image split across sequences, too few or
    too many placeholders).
    """
    ids = input_ids.detach().cpu()
    cu = cu_seqlens.detach().cpu().tolist()
    is_img = (ids == v.image_token_id).tolist()
    m = v.spatial_merge_size
    grids = [] if grid_thw is None else grid_thw.detach().cpu().tolist()
    pos = torch.empty(3, ids.shape[0], dtype=torch.long)
    deltas, img = [], 0
    for s, e in zip(cu[:-1], cu[1:]):
        cur, j = 0, s
        while j < e:
            if not is_img[j]:
                k = j
                while k < e and not is_img[k]:
                    k += 1
                pos[:, j:k] = torch.arange(cur, cur + k - j)
                cur, j = cur + k - j, k
                continue
            if img >= len(grids):
                raise ValueError(
                    f"the tokens hold more image placeholders (id {v.image_token_id}) than "
                    f"the {len(grids)} images given"
                )
            t, h, w = grids[img]
            n = t * h * w // (m * m)
            if j + n > e or not all(is_img[j : j + n]):
                raise ValueError(
                    f"image {img} ({t}x{h}x{w} patches) needs {n} consecutive placeholder "
                    f"tokens (id {v.image_token_id}) inside one sequence; the prompt has "
                    "another count (build prompts with the model's processor)"
                )
            tt, hh, ww = torch.meshgrid(
                torch.arange(t), torch.arange(h // m), torch.arange(w // m), indexing="ij"
            )
            pos[:, j : j + n] = torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + cur
            cur += max(h, w) // m
            j += n
            img += 1
        deltas.append(cur - (e - s))
    if img != len(grids):
        raise ValueError(
            f"{len(grids)} images were given but the tokens hold placeholders for {img} "
            f"(id {v.image_token_id})"
        )
    return MRopePositions(pos.to(input_ids.device), deltas)
