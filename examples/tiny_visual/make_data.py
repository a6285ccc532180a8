"""Generate the embedded visual arithmetic task ``tiny_visual`` (train / held-out eval / SFT).

    python examples/tiny_visual/make_data.py          # writes the committed files
    python examples/tiny_visual/make_data.py --out-dir /tmp/x --preview-dir /tmp/x/png

The problems are those of the tiny text task (examples/tiny/make_data.py: ``add``, ``sub``,
``mul``, drawn and split the same way), but the problem is shown only in an image; the text
asks to compute it and the answer is the same ``\\boxed{85}``, checked by the same math
verifier::

    image  [37+48]     prompt  <|vision_start|><|image_pad|><|vision_end|>Compute.
                       answer  \\boxed{85}

Images are drawn from a hard-coded 5x7 bitmap glyph table, so they are identical on every
host and need no font files.  Their geometry follows the vision tower of Qwen2.5-VL, which
cuts an image into 14x14 patches and merges 2x2 patches into one token: the image is 28
pixels high (one token row), each character gets its own 14-pixel column with the glyph
(scaled to 10x21) centred in it, and blank columns pad the width to a multiple of 28.  So
``37+48`` is 84x28, three tokens, and no patch mixes two characters.

Files written (math jsonl is AReaL's format plus ``images``, a list of PNG data URLs made
by `realhf.impl.dataset.images.image_to_data_url`, so a file needs nothing beside it):

- ``{out_dir}/train.jsonl``  ``{"query_id", "prompt", "images", "task": "math", "solutions"}``
- ``{out_dir}/eval.jsonl``   same format, ``n_eval`` held-out problems, disjoint from train
- ``{out_dir}/sft.jsonl``    ``{"id", "prompt", "images", "answer"}`` over the train problems

Output is a pure function of ``--seed`` (for a given Pillow build: the PNG bytes depend on
its zlib, the pixels never do).  ``--preview-dir`` also writes one PNG per kind to look at;
the committed data has no image files.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Dict

from PIL import Image, ImageDraw

from realhf.impl.dataset.images import image_to_data_url

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT_DIR = os.path.join(REPO_ROOT, "realhf", "assets", "tiny_visual", "data")

# Exactly what the Qwen2-VL chat template emits for one image; the processor expands the
# pad token into one token per merged 28x28 patch.
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = IMAGE_PLACEHOLDER + "Compute."

PATCH = 14  # the vision tower's patch side
MERGE = 2  # patches merged per side into one token
HEIGHT = PATCH * MERGE
SCALE_X, SCALE_Y = 2, 3  # 5x7 glyphs drawn 10x21

# 5x7 bitmaps, one string per row, '#' = ink.
GLYPHS = {
    "0": (" ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### "),
    "1": ("  #  ", " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "),
    "2": (" ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####"),
    "3": ("#####", "   # ", "  #  ", "   # ", "    #", "#   #", " ### "),
    "4": ("   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # "),
    "5": ("#####", "#    ", "#### ", "    #", "    #", "#   #", " ### "),
    "6": ("  ## ", " #   ", "#    ", "#### ", "#   #", "#   #", " ### "),
    "7": ("#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   "),
    "8": (" ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### "),
    "9": (" ### ", "#   #", "#   #", " ####", "    #", "   # ", " ##  "),
    "+": ("     ", "  #  ", "  #  ", "#####", "  #  ", "  #  ", "     "),
    "-": ("     ", "     ", "     ", "#####", "     ", "     ", "     "),
    "*": ("     ", "  #  ", "# # #", " ### ", "# # #", "  #  ", "     "),
}
GLYPH_W, GLYPH_H = 5 * SCALE_X, 7 * SCALE_Y
_X0 = (PATCH - GLYPH_W) // 2  # glyph offset inside its column
_Y0 = (HEIGHT - GLYPH_H) // 2


def _tiny_make_data():
    """examples/tiny/make_data.py (its problems and split writer), loaded by path: both
    scripts are named make_data."""
    path = os.path.join(REPO_ROOT, "examples", "tiny", "make_data.py")
    spec = importlib.util.spec_from_file_location("tiny_make_data", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_TINY = _tiny_make_data()
KINDS = _TINY.KINDS


def render(text: str) -> Image.Image:
    """`text` (digits and ``+-*``) drawn black on white, RGB, 28 pixels high, one 14-pixel
    column per character, width padded with blank columns to a multiple of 28."""
    unknown = sorted(set(text) - set(GLYPHS))
    if not text or unknown:
        raise ValueError(f"cannot draw {text!r}: only {''.join(GLYPHS)} have glyphs")
    width = -(-len(text) * PATCH // HEIGHT) * HEIGHT
    img = Image.new("RGB", (width, HEIGHT), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    for col, ch in enumerate(text):
        for row, bits in enumerate(GLYPHS[ch]):
            for i, bit in enumerate(bits):
                if bit == "#":
                    x = col * PATCH + _X0 + i * SCALE_X
                    y = _Y0 + row * SCALE_Y
                    draw.rectangle((x, y, x + SCALE_X - 1, y + SCALE_Y - 1), fill=(0, 0, 0))
    return img


def problem_text(kind: str, a: int, b: int) -> str:
    """What the image shows, e.g. ``37+48``."""
    return f"{a}{_TINY._SYMBOL[kind]}{b}"


def math_record(kind: str, a: int, b: int) -> Dict:
    """One line of the math jsonl format, with the problem as an embedded image."""
    return {
        "query_id": f"{kind}-{a}-{b}",
        "prompt": PROMPT,
        "images": [image_to_data_url(render(problem_text(kind, a, b)))],
        "task": "math",
        "solutions": [_TINY.boxed(_TINY.answer_of(kind, a, b))],
    }


def sft_record(kind: str, a: int, b: int) -> Dict:
    """One line of the SFT jsonl format, with the problem as an embedded image."""
    return {
        "id": f"{kind}-{a}-{b}",
        "prompt": PROMPT,
        "images": [image_to_data_url(render(problem_text(kind, a, b)))],
        "answer": _TINY.boxed(_TINY.answer_of(kind, a, b)),
    }


def make_data(
    out_dir: str = DEFAULT_OUT_DIR,
    seed: int = 1,
    n_eval: int = 200,
    n_train_per_kind: int = 1200,
    preview_dir: str | None = None,
) -> Dict[str, int]:
    """Write train/eval/sft jsonl files under `out_dir`; returns the split sizes."""
    train, held_out = _TINY.split_problems(seed, n_eval, n_train_per_kind)
    if preview_dir:
        os.makedirs(preview_dir, exist_ok=True)
        for kind in KINDS:
            p = next(p for p in train if p[0] == kind)
            render(problem_text(*p)).save(os.path.join(preview_dir, f"{'-'.join(map(str, p))}.png"))
    return _TINY.write_splits(out_dir, None, train, held_out, math_record, sft_record)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where train/eval/sft.jsonl go")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--n-eval", type=int, default=200, help="held-out problems")
    p.add_argument("--n-train-per-kind", type=int, default=1200)
    p.add_argument("--preview-dir", default=None, help="also write one PNG per kind here")
    args = p.parse_args(argv)
    sizes = make_data(args.out_dir, args.seed, args.n_eval, args.n_train_per_kind, args.preview_dir)
    print(f"wrote {sizes} to {args.out_dir}")


if __name__ == "__main__":
    main()
