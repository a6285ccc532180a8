"""The committed visual arithmetic task (examples/tiny_visual/make_data.py ->
realhf/assets/tiny_visual/data/).

Checks the rendering (deterministic, 28 pixels high, one 14-pixel column per character so
no vision patch mixes two characters), that each row's image shows its problem and its
solution is right, that the splits are disjoint, and that the script reproduces the
committed files byte for byte.
"""

import pathlib

import pytest
from example_scripts import load_script, read_jsonl
from PIL import Image, ImageChops

from realhf.impl.dataset.images import load_row_images

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "realhf" / "assets" / "tiny_visual" / "data"


@pytest.fixture(scope="module")
def mk():
    return load_script("examples/tiny_visual/make_data.py", "tiny_visual_make_data")


_read = read_jsonl


def _ink_bbox(img):
    """Bounding box of the non-white pixels, or None."""
    return ImageChops.invert(img.convert("L")).getbbox()


def _problem(query_id):
    kind, a, b = query_id.split("-")
    return kind, int(a), int(b)


def test_rendering_is_deterministic(mk):
    a, b = mk.render("37+48"), mk.render("37+48")
    assert a.mode == "RGB" and a.tobytes() == b.tobytes()
    assert mk.image_to_data_url(a) == mk.image_to_data_url(b)


def test_geometry_every_problem_fits_whole_tokens(mk):
    lengths = {len(mk.problem_text(*p)) for kind in mk.KINDS for p in mk._TINY.all_problems(kind)}
    assert lengths == {4, 5}  # 48*7 and 37+48
    for n in (3, 4, 5):
        img = mk.render("8" * n)
        assert img.height == 28 and img.width % 28 == 0 and img.width // 14 in (n, n + 1)
    assert mk.render("37+48").size == (84, 28) and mk.render("48*7").size == (56, 28)


def test_each_glyph_lies_inside_its_own_column(mk):
    for ch in mk.GLYPHS:
        alone = mk.render(ch)
        left, top, right, bottom = _ink_bbox(alone)
        # a blank margin on every side of the column keeps neighbours apart
        assert 0 < left and right < 14 and 0 < top and bottom < 28, (ch, _ink_bbox(alone))
    text = "90-12"
    img = mk.render(text)
    for col, ch in enumerate(text):
        cell = img.crop((col * 14, 0, col * 14 + 14, 28))
        assert cell.tobytes() == mk.render(ch).crop((0, 0, 14, 28)).tobytes(), (col, ch)
    assert _ink_bbox(img.crop((5 * 14, 0, img.width, 28))) is None  # padding is blank


def test_distinct_problems_give_distinct_images(mk):
    texts = [mk.problem_text(*p) for kind in mk.KINDS for p in mk._TINY.all_problems(kind)]
    assert len(set(texts)) == len(texts)
    assert len({mk.render(t).tobytes() for t in texts[::7]}) == len(texts[::7])
    rows = _read(DATA / "train.jsonl") + _read(DATA / "eval.jsonl")
    assert len({r["images"][0] for r in rows}) == len(rows)


def test_rows_show_their_problem_and_solve_it(mk):
    for split in ("train", "eval"):
        rows = _read(DATA / f"{split}.jsonl")
        for r in rows:
            assert r["prompt"] == mk.IMAGE_PLACEHOLDER + "Compute." and r["task"] == "math"
            assert len(r["images"]) == 1 and r["images"][0].startswith("data:image/png;base64,")
        for i, r in enumerate(rows[:60]):
            kind, a, b = _problem(r["query_id"])
            want = {"add": a + b, "sub": a - b, "mul": a * b}[kind]
            assert r["solutions"] == [f"\\boxed{{{want}}}"]
            (img,) = load_row_images(r, str(DATA), f"{split}.jsonl:{i + 1}")
            assert img.tobytes() == mk.render(mk.problem_text(kind, a, b)).tobytes()
    assert mk.IMAGE_PLACEHOLDER == "<|vision_start|><|image_pad|><|vision_end|>"


def test_splits_are_disjoint_and_sft_matches_train():
    train, held_out, sft = (_read(DATA / f"{s}.jsonl") for s in ("train", "eval", "sft"))
    assert len(train) == 3600 and len(held_out) == 200
    assert not {r["query_id"] for r in train} & {r["query_id"] for r in held_out}
    assert len({r["query_id"] for r in train}) == len(train)
    assert [r["query_id"] for r in train] == [r["id"] for r in sft]
    for t, s in zip(train, sft):
        assert s["images"] == t["images"] and [s["answer"]] == t["solutions"]
        assert s["prompt"] == t["prompt"]
    assert (DATA / "train.jsonl").stat().st_size < 2 * 2**20


def test_make_data_reproduces_the_committed_files(mk, tmp_path):
    # PNG bytes depend on the zlib Pillow is built with: after a Pillow upgrade that
    # changes them, regenerate with `python examples/tiny_visual/make_data.py`.
    assert mk.make_data(str(tmp_path)) == {"train": 3600, "eval": 200, "sft": 3600}
    for name in ("eval.jsonl", "train.jsonl", "sft.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name


def test_preview_pngs_go_only_where_asked(mk, tmp_path):
    mk.make_data(str(tmp_path / "d"), n_eval=3, n_train_per_kind=2, preview_dir=str(tmp_path / "p"))
    pngs = sorted(p.name.split("-")[0] for p in (tmp_path / "p").iterdir())
    assert pngs == ["add", "mul", "sub"]
    assert Image.open(next((tmp_path / "p").iterdir())).height == 28
    assert not list((tmp_path / "d").glob("*.png"))
