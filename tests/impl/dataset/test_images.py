"""Loading the images of a dataset row: paths, data URLs, and an error per way to fail."""

import base64
import os
import struct
import zlib

import pytest
from PIL import Image

from realhf.impl.dataset.images import (
    ImageError,
    decode_data_url,
    image_to_data_url,
    load_image,
    load_row_images,
)
from realhf.impl.dataset.jsonl import DatasetError


def _img(size=(6, 4), mode="RGB"):
    img = Image.new(mode, size)
    for x in range(size[0]):
        for y in range(size[1]):
            v = (x * 40 + y * 7) % 256
            img.putpixel((x, y), {"RGB": (v, 255 - v, x), "RGBA": (v, v, v, 255), "L": v}[mode])
    return img


def _png(tmp_path, name="a.png", img=None):
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (img or _img()).save(tmp_path / name)
    return tmp_path / name


def test_relative_and_absolute_paths(tmp_path):
    _png(tmp_path, "imgs/a.png")
    rel = load_image("imgs/a.png", str(tmp_path))
    absolute = load_image(str(tmp_path / "imgs" / "a.png"), "/nonexistent")
    assert rel.mode == "RGB" and rel.size == (6, 4)
    assert rel.tobytes() == absolute.tobytes() == _img().tobytes()


def test_data_url_round_trip_is_exact_and_deterministic():
    img = _img((9, 5))
    url = image_to_data_url(img)
    assert url.startswith("data:image/png;base64,")
    assert image_to_data_url(img.copy()) == url
    back = load_image(url, "/nonexistent")
    assert back.size == (9, 5) and back.tobytes() == img.tobytes()
    # metadata such as text chunks does not reach the bytes
    tagged = img.copy()
    tagged.info["comment"] = "hello"
    assert image_to_data_url(tagged) == url


def test_rgba_and_grey_come_back_rgb(tmp_path):
    grey = load_image(str(_png(tmp_path, "l.png", _img(mode="L"))), "")
    assert grey.mode == "RGB" and grey.getpixel((1, 1)) == (47, 47, 47)
    rgba = _img(mode="RGBA")
    rgba.putpixel((0, 0), (10, 20, 30, 0))  # fully transparent: white, as HF processors do
    got = load_image(image_to_data_url(rgba), "")
    assert got.mode == "RGB" and got.getpixel((0, 0)) == (255, 255, 255)
    assert got.getpixel((1, 1)) == (47, 47, 47)


def test_missing_file_names_the_path_and_the_base(tmp_path):
    with pytest.raises(ImageError) as e:
        load_image("imgs/nope.png", str(tmp_path))
    msg = str(e.value)
    assert f"'{tmp_path / 'imgs' / 'nope.png'}' does not exist" in msg
    assert f"relative to '{tmp_path}'" in msg
    assert isinstance(e.value, DatasetError)


def test_directory_is_not_a_file(tmp_path):
    (tmp_path / "d.png").mkdir()
    with pytest.raises(ImageError, match="d.png' is not a file"):
        load_image("d.png", str(tmp_path))


def test_raw_base64_is_refused_asking_for_a_data_url():
    raw = image_to_data_url(_img()).split(",", 1)[1]
    with pytest.raises(ImageError) as e:
        load_image(raw, "/tmp")
    msg = str(e.value)
    assert "data:image/<format>;base64" in msg and "raw base64 is not accepted" in msg
    assert raw[:40] in msg and raw not in msg  # cut short, not pasted whole


def test_bad_base64_names_the_truncated_url():
    url = "data:image/png;base64," + "iVBORw0K!!" + "A" * 100
    with pytest.raises(ImageError) as e:
        load_image(url, "")
    msg = str(e.value)
    assert "invalid base64" in msg and url[:40] in msg and url not in msg


@pytest.mark.parametrize(
    "url, why",
    [
        ("not a url", "is not a data URL"),
        ("data:text/plain;base64,aGVsbG8=", "media type 'text/plain'"),
        ("data:,hello", r"media type '\(none\)'"),
        ("data:image/png,rawbytes", "not base64-encoded"),
    ],
)
def test_malformed_data_urls(url, why):
    with pytest.raises(ImageError, match=why):
        decode_data_url(url)


def test_text_file_renamed_png(tmp_path):
    (tmp_path / "t.png").write_text("just some text\n")
    with pytest.raises(ImageError) as e:
        load_image("t.png", str(tmp_path))
    assert f"'{tmp_path / 't.png'}' cannot be read as an image" in str(e.value)
    assert "UnidentifiedImageError" in str(e.value)


def test_truncated_png_fails_at_loading(tmp_path):
    data = _png(tmp_path, img=_img((64, 64))).read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageError, match="cut.png' cannot be read as an image"):
        load_image("cut.png", str(tmp_path))


def test_too_many_pixels_is_refused_before_decoding(tmp_path):
    _png(tmp_path, img=_img((10, 10)))
    assert load_image("a.png", str(tmp_path), max_pixels=100).size == (10, 10)
    with pytest.raises(ImageError, match=r"10x10 = 100 pixels, more than the limit of 99"):
        load_image("a.png", str(tmp_path), max_pixels=99)
    with pytest.raises(ImageError, match="100 pixels, more than the limit of 99"):
        load_image(image_to_data_url(_img((10, 10))), "", max_pixels=99)


def test_pillows_own_bomb_guard_becomes_an_image_error(tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10)
    _png(tmp_path, img=_img((10, 10)))  # > 2 * 10 pixels: Pillow refuses to open it
    with pytest.raises(ImageError, match="a.png' is too large to decode"):
        load_image("a.png", str(tmp_path))


def test_too_many_bytes_file_and_data_url(tmp_path):
    size = _png(tmp_path).stat().st_size
    with pytest.raises(ImageError, match=f"is {size} bytes, more than the limit of {size - 1}"):
        load_image("a.png", str(tmp_path), max_bytes=size - 1)
    url = image_to_data_url(_img())
    n = len(base64.b64decode(url.split(",", 1)[1]))
    assert load_image(url, "", max_bytes=n).size == (6, 4)
    with pytest.raises(ImageError, match=f"holds {n} bytes, more than the limit of {n - 1}"):
        load_image(url, "", max_bytes=n - 1)
    with pytest.raises(ImageError, match="holds about .* more than the limit of 10"):
        decode_data_url(url, max_bytes=10)  # refused before decoding


def test_zero_size_image_is_refused(tmp_path):
    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    ihdr = struct.pack(">IIBBBBB", 0, 5, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")
    (tmp_path / "z.png").write_bytes(png)
    # Pillow itself refuses a zero width; either way the error names the file
    with pytest.raises(ImageError, match="z.png'"):
        load_image("z.png", str(tmp_path))


def test_row_images(tmp_path):
    _png(tmp_path)
    url = image_to_data_url(_img((3, 3)))
    imgs = load_row_images({"images": ["a.png", url]}, str(tmp_path), "d.jsonl:3")
    assert [i.size for i in imgs] == [(6, 4), (3, 3)]
    assert load_row_images({"prompt": "x"}, str(tmp_path), "d.jsonl:3") == []
    assert load_row_images({"images": None}, str(tmp_path), "d.jsonl:3") == []


@pytest.mark.parametrize("images", ["a.png", [1], [["a.png"]], {"a": "a.png"}])
def test_row_images_field_must_be_a_list_of_strings(tmp_path, images):
    with pytest.raises(ImageError) as e:
        load_row_images({"images": images}, str(tmp_path), "d.jsonl:3")
    assert str(e.value) == (
        "d.jsonl:3: field 'images' must be a list of strings (paths relative to the file, "
        "or data URLs)"
    )


def test_row_image_errors_name_the_row_and_index(tmp_path):
    _png(tmp_path)
    with pytest.raises(ImageError) as e:
        load_row_images({"images": ["a.png", "a.png", "b.png"]}, str(tmp_path), "d.jsonl:7")
    assert str(e.value).startswith("d.jsonl:7: images[2]: image file '")
    assert os.path.join(str(tmp_path), "b.png") in str(e.value)
    with pytest.raises(ImageError, match=r"d.jsonl:7: images\[0\]: .*limit of 5"):
        load_row_images({"images": ["a.png"]}, str(tmp_path), "d.jsonl:7", max_pixels=5)
