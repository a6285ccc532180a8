"""Loading the images of a dataset row, with errors that name the row and the image.

A row of a vision-language dataset lists its images in the field ``images``, each either
a path (relative to the dataset file's directory, or absolute) or a data URL
``data:image/png;base64,...``.  Raw base64 without the ``data:`` prefix is refused: a
string that is neither an existing path nor a data URL would otherwise be guessed at, and
a typo in a path would surface as a confusing base64 error.

Every image is checked before its pixels are decoded (encoded size, then width * height
read from the header), so one huge or malicious image fails its row with a clear
`ImageError` instead of exhausting the memory of a worker; then it is fully decoded here
(``load()``), so a truncated file fails at loading, naming its row, not later inside the
vision processor.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from PIL import Image

from realhf.api.core.data_api import image_sample
from realhf.impl.dataset.jsonl import DatasetError

# Limits for one image.  20 MiB encoded and 16.7 M pixels are far above what a
# Qwen2.5-VL processor keeps (it resizes to at most ~12.8 M pixels by default) and far
# below what would hurt a worker; raise them per call for unusual data.
MAX_IMAGE_BYTES = 20 * 2**20
MAX_IMAGE_PIXELS = 4096 * 4096

_DATA_URL = re.compile(r"^data:(?P<mime>[^;,]*)(?P<params>(;[^;,]*)*),(?P<data>.*)$", re.S)
_BASE64ISH = re.compile(r"^[A-Za-z0-9+/\s]{64,}={0,2}$")
_SHOW = 40


class ImageError(DatasetError):
    """An image of a dataset row (or of a request) that cannot be used as given."""


def _show(ref: str) -> str:
    """`ref` for an error message: data URLs and other long blobs cut to ~40 characters."""
    if len(ref) > _SHOW and (ref.startswith("data:") or _BASE64ISH.match(ref[:1000])):
        return repr(ref[:_SHOW] + f"... ({len(ref)} chars)")
    return repr(ref)


def decode_data_url(url: str, *, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The bytes of a base64 data URL whose media type is ``image/*``.

    Raises `ImageError` for anything else (no ``data:`` prefix, another media type, not
    base64, bad base64, or more than `max_bytes` once decoded); the size is checked
    before decoding, so an oversized URL costs no memory beyond the string itself.
    """
    m = _DATA_URL.match(url)
    if m is None:
        raise ImageError(
            f"{_show(url)} is not a data URL; expected 'data:image/<format>;base64,<data>'"
        )
    mime = m.group("mime").strip().lower()
    params = [p.strip().lower() for p in m.group("params").split(";") if p.strip()]
    if not mime.startswith("image/"):
        raise ImageError(
            f"data URL {_show(url)} has media type {mime or '(none)'!r}; only image/* "
            "(e.g. 'data:image/png;base64,...') is accepted"
        )
    if "base64" not in params:
        raise ImageError(
            f"data URL {_show(url)} is not base64-encoded; write it as 'data:{mime};base64,<data>'"
        )
    data = m.group("data")
    # 4 base64 characters carry 3 bytes: refuse before allocating the decoded copy.
    if len(data) // 4 * 3 > max_bytes + 3:
        raise ImageError(
            f"data URL {_show(url)} holds about {len(data) // 4 * 3} bytes, more than the "
            f"limit of {max_bytes}; shrink or re-encode the image, or raise max_bytes"
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(
            f"data URL {_show(url)} has invalid base64 ({e}); encode the image bytes with "
            "standard base64 (A-Z a-z 0-9 + /, '=' padding, no line breaks)"
        ) from None
    if len(raw) > max_bytes:
        raise ImageError(
            f"data URL {_show(url)} holds {len(raw)} bytes, more than the limit of "
            f"{max_bytes}; shrink or re-encode the image, or raise max_bytes"
        )
    return raw


def _path_of(ref: str, base_dir: str, max_bytes: int) -> str:
    """The checked file path that `ref` names."""
    path = os.path.join(base_dir, ref)  # an absolute `ref` ignores base_dir
    if not os.path.exists(path):
        if _BASE64ISH.match(ref):
            raise ImageError(
                f"image {_show(ref)} is neither an existing file nor a data URL; embedded "
                "images must be data URLs 'data:image/<format>;base64,<data>' (raw base64 "
                "is not accepted)"
            )
        where = "" if os.path.isabs(ref) else f" (paths are relative to '{base_dir}')"
        raise ImageError(f"image file '{path}' does not exist{where}")
    if not os.path.isfile(path):
        raise ImageError(f"image path '{path}' is not a file")
    size = os.path.getsize(path)
    if size > max_bytes:
        raise ImageError(
            f"image file '{path}' is {size} bytes, more than the limit of {max_bytes}; "
            "shrink or re-encode it, or raise max_bytes"
        )
    return path


def _to_rgb(img: Image.Image) -> Image.Image:
    """`img` as RGB; transparent pixels become white, as in the HF image processors'
    `convert_to_rgb`, so the model sees the same pixels whichever side converts."""
    if img.mode == "RGB":
        return img.copy()
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def load_image(
    ref: str,
    base_dir: str,
    *,
    max_bytes: int = MAX_IMAGE_BYTES,
    max_pixels: int = MAX_IMAGE_PIXELS,
) -> Image.Image:
    """The image `ref` names (a data URL, or a path relative to `base_dir` or absolute),
    fully decoded, as RGB; the file is closed.  Raises `ImageError` naming `ref`."""
    if not isinstance(ref, str) or not ref:
        raise ImageError(
            f"image reference {ref!r} must be a non-empty string (a path or a data URL)"
        )
    if ref.startswith("data:"):
        source = io.BytesIO(decode_data_url(ref, max_bytes=max_bytes))
        name = f"image {_show(ref)}"
    else:
        source = _path_of(ref, base_dir, max_bytes)
        name = f"image file '{source}'"
    try:
        # Image.open reads only the header: the size is known before any pixel is decoded.
        with Image.open(source) as img:
            w, h = img.size
            if w == 0 or h == 0:
                raise ImageError(f"{name} has zero size ({w}x{h}); the image is empty")
            if w * h > max_pixels:
                raise ImageError(
                    f"{name} is {w}x{h} = {w * h} pixels, more than the limit of "
                    f"{max_pixels}; downscale it, or raise max_pixels"
                )
            img.load()
            return _to_rgb(img)
    except ImageError:
        raise
    except Image.DecompressionBombError as e:
        # Pillow's own guard, for a header that claims more than twice its global limit.
        raise ImageError(f"{name} is too large to decode ({e}); downscale it") from None
    except (OSError, ValueError, EOFError, SyntaxError) as e:
        # UnidentifiedImageError is an OSError; truncated or corrupt data raises any of these.
        raise ImageError(
            f"{name} cannot be read as an image ({type(e).__name__}: {e}); check that it is "
            "a complete PNG/JPEG/WebP/... file"
        ) from None


def load_row_images(row: dict, base_dir: str, where: str, **limits) -> List[Image.Image]:
    """The images of a dataset `row` (field ``images``; absent or null means none), as RGB.

    `where` names the row in errors (e.g. ``train.jsonl:17``); `limits` are passed on to
    `load_image` (``max_bytes``, ``max_pixels``).
    """
    refs = row.get("images")
    if refs is None:
        return []
    if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
        raise ImageError(
            f"{where}: field 'images' must be a list of strings (paths relative to the file, "
            "or data URLs)"
        )
    images = []
    for i, ref in enumerate(refs):
        try:
            images.append(load_image(ref, base_dir, **limits))
        except ImageError as e:
            raise ImageError(f"{where}: images[{i}]: {e}") from None
    return images


def image_to_data_url(img: Image.Image) -> str:
    """`img` as a PNG data URL ``data:image/png;base64,...``.

    The same pixels give the same string: no metadata is written (``img.info``, which may
    hold an ICC profile or text chunks, is dropped, all but a palette's transparency) and
    the encoder settings are fixed.
    The bytes depend on the zlib Pillow was built with, so they can differ between Pillow
    builds; the decoded pixels never do.
    """
    clean = img.copy()
    clean.info = {k: v for k, v in img.info.items() if k == "transparency"}
    buf = io.BytesIO()
    clean.save(buf, format="PNG", optimize=False)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


class VisionProcessor:
    """A vision-language model's prompt inputs: token ids with each image's placeholder
    expanded, and the images' pixels.

    A prompt holds one image placeholder token (``<|image_pad|>``, the model config's
    ``image_token_id``: what the model's chat template writes for an image part) per
    image, in order.  The model's HF image processor (``preprocessor_config.json`` next to
    the weights) resizes each image to whole merge units and cuts it into patches; the
    placeholder is then repeated once per language-model token the image becomes
    (``t * h * w / merge_size**2``), which is what HF's own processor does to the text.

    Args:
        image_processor: a transformers image processor (Qwen2-VL's).
        image_token_id: the placeholder token id.
    """

    def __init__(self, image_processor, image_token_id: int):
        self.image_processor = image_processor
        self.image_token_id = int(image_token_id)
        self.merge_size = int(image_processor.merge_size)
        self.patch_dim = 3 * image_processor.temporal_patch_size * image_processor.patch_size**2

    @classmethod
    def from_model_dir(cls, model_dir: str) -> Optional["VisionProcessor"]:
        """The processor of the model in ``model_dir``; None for a text-only model."""
        import json

        cfg_path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(cfg_path):
            return None
        with open(cfg_path) as f:
            image_token_id = json.load(f).get("image_token_id")
        if image_token_id is None:
            return None
        if not os.path.isfile(os.path.join(model_dir, "preprocessor_config.json")):
            raise ImageError(
                f"{model_dir} is a vision-language model without an image processor config "
                "(preprocessor_config.json); save its processor there (processor."
                "save_pretrained) or copy the file from the released model"
            )
        from transformers import AutoImageProcessor

        return cls(AutoImageProcessor.from_pretrained(model_dir), image_token_id)

    def __call__(
        self, ids: Sequence[int], images: List[Image.Image], where: str = "the prompt"
    ) -> Tuple[List[int], torch.Tensor, torch.Tensor]:
        """``(token ids, pixel_values [patches, patch_dim] float32, grid_thw [images, 3])``
        of a tokenized prompt and its images (:meth:`expand`, then :meth:`pixels`)."""
        pixels, grid = self.pixels(images)
        return self.expand(ids, images, where), pixels, grid

    def expand(
        self, ids: Sequence[int], images: List[Image.Image], where: str = "the prompt"
    ) -> List[int]:
        """The prompt's ids with each image placeholder repeated once per token its image
        becomes (counted from the image size, without processing the pixels).  A prompt
        whose placeholders are expanded already (as a dataset item holds them) is kept."""
        img = self.image_token_id
        n = sum(1 for t in ids if t == img)
        per_image = [
            self.image_processor.get_number_of_image_patches(im.height, im.width, {})
            // self.merge_size**2
            for im in images
        ]
        if n != len(images) and _runs(ids, img) == per_image:  # expanded already
            return list(ids)
        if n != len(images):
            raise ImageError(
                f"{where}: holds {n} image placeholders (token {img}) for {len(images)} "
                "images; write one image part (its placeholder) per image"
            )
        counts = iter(per_image)
        expanded: List[int] = []
        for t in ids:
            expanded += [t] * next(counts) if t == img else [t]
        return expanded

    def pixels(self, images: List[Image.Image]) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values [patches, patch_dim] float32, grid_thw [images, 3] int64)``."""
        if not images:
            return torch.zeros(0, self.patch_dim), torch.zeros(0, 3, dtype=torch.long)
        out = self.image_processor(images=images, return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"].long()


def _runs(ids: Sequence[int], token: int) -> List[int]:
    """Lengths of the runs of ``token`` in ``ids``."""
    runs, prev = [], False
    for t in ids:
        if t == token:
            if prev:
                runs[-1] += 1
            else:
                runs.append(1)
        prev = t == token
    return runs


class RowImages:
    """The images of a dataset's items, read when an item is (not all kept in memory).

    A dataset whose rows have ``images`` expands each prompt's placeholders at load (which
    fixes every item's token count) and records the row's image references; reading an
    item decodes and processes its images again and adds the image keys
    (:data:`~realhf.api.core.data_api.IMAGE_KEYS`).  Every item of such a dataset has the
    keys (no rows for a row without images), so any of them batch together.

    Args:
        dataset_path: the jsonl file (relative image paths are resolved next to it).
        tokenizer: the model's tokenizer; its ``name_or_path`` is the model directory whose
            image processor and image token are used.
    """

    def __init__(self, dataset_path: str, tokenizer):
        self.base_dir = os.path.dirname(os.path.abspath(dataset_path))
        model_dir = str(getattr(tokenizer, "name_or_path", "") or "")
        self.processor = VisionProcessor.from_model_dir(model_dir) if model_dir else None
        if self.processor is None:
            raise ImageError(
                f"{dataset_path}: rows have images, but the model ({model_dir or 'unknown'}) "
                "is not a vision-language model (its config.json has no image_token_id); "
                "use a VLM (e.g. Qwen2.5-VL) or drop the 'images' fields"
            )
        self._rows: Dict[int, Tuple[list, str]] = {}

    @staticmethod
    def needed(rows: List[dict]) -> bool:
        """Whether any row has images."""
        return any(r.get("images") for r in rows)

    def expand(self, index: int, row: dict, ids: Sequence[int], where: str) -> List[int]:
        """Item ``index``'s prompt ids with its image placeholders expanded (the row's
        images are loaded and checked here, so a bad one fails the load naming ``where``)."""
        images = load_row_images(row, self.base_dir, where)
        expanded = self.processor.expand(ids, images, where)
        self._rows[index] = (list(row.get("images") or []), where)
        return expanded

    def _images(self, index: int) -> Tuple[list, List[Image.Image]]:
        """Item ``index``'s image references and the images, loaded again."""
        refs, where = self._rows.get(index, ([], ""))
        return refs, load_row_images({"images": refs}, self.base_dir, where)

    def pixels(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Item ``index``'s ``(pixel_values, grid_thw)`` (no rows without images)."""
        return self.processor.pixels(self._images(index)[1])

    def attach(self, index: int, item):
        """``item`` (a one-item SequenceSample) with its image keys."""
        refs, images = self._images(index)
        pixels, grid = self.processor.pixels(images)
        out = image_sample(item.ids, pixels, grid, [pixels.shape[0]], [grid.shape[0]])
        # The images as data URLs too: what an HTTP generation server is sent (it opens no
        # files); a data URL of the row is passed on as it is.
        out.metadata = {
            "image_data": [[r if r.startswith("data:") else image_to_data_url(im)
                            for r, im in zip(refs, images)]]
        }  # fmt: skip
        merged = item.select(item.keys)  # (a copy: the dataset's item stays as it is)
        merged.update_(out)
        return merged
