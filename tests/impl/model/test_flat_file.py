"""The flat weight file of ``weight_sync=shm``: what the trainer writes, a server maps."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from tiny_models import make_tiny_hf_model

from realhf.impl.model.conversion.flat_file import (
    SPARE,
    FlatFileError,
    load_flat,
    map_flat,
    read_header,
    retire,
    write_flat,
    write_model,
)
from realhf.impl.model.nn.real_model import ReaLModel


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("m") / "qwen2")


def _perturbed(model_dir, seed=0) -> ReaLModel:
    m = ReaLModel.from_hf(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.flat_params.add_(torch.randn(m.flat_params.shape, generator=g))
    return m


def test_a_model_round_trips_bit_for_bit_and_safetensors_reads_the_file(tmp_path, model_dir):
    trained = _perturbed(model_dir)
    path = str(tmp_path / "actor" / "v3.flat")
    n = write_model(trained, path, version=3)
    assert n == os.path.getsize(path)
    assert os.listdir(tmp_path / "actor") == ["v3.flat"]  # no temporary file left
    header = read_header(path)
    assert header["data_start"] % 4096 == 0  # page-aligned data: a mapping suits any dtype
    served = ReaLModel.from_hf(model_dir)
    assert not torch.equal(served.flat_params, trained.flat_params)
    assert load_flat(served.flat_params, served.param_spec, path, 3) == 3
    assert torch.equal(served.flat_params, trained.flat_params)
    # A copying load keeps no mapping (only the writer keeps its read-write one, rw-s).
    with open("/proc/self/maps") as f:
        mine = [line.split()[1] for line in f if line.rstrip().endswith(path)]
    assert mine == ["rw-s"], mine
    # Any safetensors reader opens it.
    with safe_open(path, "pt") as f:
        assert f.metadata()["version"] == "3"
        assert torch.equal(f.get_tensor("flat"), trained.flat_params)


def test_a_bf16_server_loads_an_fp32_file_converted(tmp_path, model_dir):
    trained = _perturbed(model_dir, seed=1)
    path = str(tmp_path / "v1.flat")
    write_flat(trained.flat_params, trained.param_spec, path, 1)
    served = ReaLModel.from_hf(model_dir, dtype=torch.bfloat16)
    load_flat(served.flat_params, served.param_spec, path, 1)
    assert served.flat_params.dtype == torch.bfloat16
    assert torch.equal(served.flat_params, trained.flat_params.to(torch.bfloat16))


def test_a_wrong_version_or_layout_is_refused_and_the_model_keeps_its_weights(tmp_path, model_dir):
    trained = _perturbed(model_dir, seed=2)
    path = str(tmp_path / "v5.flat")
    write_flat(trained.flat_params, trained.param_spec, path, 5)
    served = ReaLModel.from_hf(model_dir)
    before = served.flat_params.clone()
    with pytest.raises(FlatFileError, match="holds weight version 5, not the 6 asked for"):
        load_flat(served.flat_params, served.param_spec, path, 6)
    other = make_tiny_hf_model("qwen3", tmp_path / "qwen3", seed=1)
    q3 = ReaLModel.from_hf(other)
    with pytest.raises(FlatFileError, match="its layout is not this model's"):
        load_flat(q3.flat_params, q3.param_spec, path, 5)
    assert torch.equal(served.flat_params, before)


def test_truncated_foreign_and_missing_files_are_named(tmp_path, model_dir):
    m = ReaLModel.from_hf(model_dir)
    path = str(tmp_path / "v1.flat")
    write_flat(m.flat_params, m.param_spec, path, 1)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(FlatFileError, match="ends 100 bytes early"):
        load_flat(m.flat_params, m.param_spec, path, 1)
    # A plain safetensors file (e.g. an HF weight file) is not a flat file.
    foreign = tmp_path / "model.safetensors"
    text = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    foreign.write_bytes(len(text).to_bytes(8, "little") + text + b"\0" * 4)
    with pytest.raises(FlatFileError, match="is not a flat weight file"):
        load_flat(m.flat_params, m.param_spec, str(foreign), 1)
    with pytest.raises(FlatFileError, match="cannot read the flat weight file"):
        load_flat(m.flat_params, m.param_spec, str(tmp_path / "absent.flat"), 1)


def test_a_retired_version_is_overwritten_by_the_next_write(tmp_path, model_dir):
    # New pages cost more than the copy into them: the next version reuses the old file.
    a, b = _perturbed(model_dir, seed=3), _perturbed(model_dir, seed=4)
    v1, v2, v3 = (str(tmp_path / f"v{v}.flat") for v in (1, 2, 3))
    write_model(a, v1, 1)
    inode = os.stat(v1).st_ino
    retire(v1)
    assert sorted(os.listdir(tmp_path)) == [SPARE]
    write_model(b, v2, 2)
    assert sorted(os.listdir(tmp_path)) == ["v2.flat"] and os.stat(v2).st_ino == inode
    served = ReaLModel.from_hf(model_dir)
    assert load_flat(served.flat_params, served.param_spec, v2, 2) == 2
    assert torch.equal(served.flat_params, b.flat_params)
    # A spare of another size (another model) is fitted; only one spare is kept.
    small = torch.arange(10, dtype=torch.float32)
    spec = {"w": type(served.param_spec["0.wte.weight"])(0, (10,))}
    write_flat(small, spec, v3, 3)
    retire(v3)
    retire(v2)  # replaces the spare
    assert sorted(os.listdir(tmp_path)) == [SPARE]
    write_flat(small, spec, v1, 4)
    assert os.path.getsize(v1) == read_header(v1)["data_start"] + 40
    out = torch.zeros(10)
    load_flat(out, spec, v1, 4)
    assert torch.equal(out, small)


def test_a_model_can_serve_from_the_mapped_file_itself(tmp_path, model_dir):
    trained = _perturbed(model_dir, seed=5)
    path = str(tmp_path / "v1.flat")
    write_model(trained, path, 1)
    served = ReaLModel.from_hf(model_dir).eval()
    served.use_flat(map_flat(path, served.param_spec, 1, served.flat_params.numel()))
    ids, cu = torch.tensor([3, 1, 4, 1, 5]), torch.tensor([0, 5], dtype=torch.int32)
    with torch.no_grad():
        assert torch.equal(served(ids, cu), trained.eval()(ids, cu))
    with open("/proc/self/maps") as f:
        assert path in f.read()
    with pytest.raises(FlatFileError, match="not the 2 asked for"):
        map_flat(path, served.param_spec, 2)
    with pytest.raises(ValueError, match="a flat buffer of"):
        served.use_flat(torch.zeros(3))


def _maps_of(directory) -> list:
    """(permissions, path) of this process's mappings of files in ``directory``."""
    with open("/proc/self/maps") as f:
        rows = [line.split(maxsplit=5) for line in f]
    return [(r[1], r[5].strip()) for r in rows if len(r) == 6 and str(directory) in r[5]]


def test_a_file_met_again_reuses_its_mapping_and_shows_the_new_version(tmp_path, model_dir):
    # Two files take turns: v1, v2, then v3 in v1's retired file.  The writer and a server
    # map each file once; the server's view of v3 is v1's mapping, holding v3's weights.
    a, b, c = (_perturbed(model_dir, seed=s) for s in (6, 7, 8))
    served = ReaLModel.from_hf(model_dir).eval()
    paths = [str(tmp_path / f"v{v}.flat") for v in (1, 2, 3)]
    views = []
    for version, (model, path) in enumerate(zip((a, b, c), paths), start=1):
        write_model(model, path, version)
        views.append(map_flat(path, served.param_spec, version, served.flat_params.numel()))
        served.use_flat(views[-1])
        assert torch.equal(served.flat_params, model.flat_params)
        if version > 1:
            retire(paths[version - 2])
    assert views[2].data_ptr() == views[0].data_ptr()  # the same mapping, not a new one
    assert torch.equal(views[2], c.flat_params) and torch.equal(views[1], b.flat_params)
    ids, cu = torch.tensor([3, 1, 4, 1, 5]), torch.tensor([0, 5], dtype=torch.int32)
    with torch.no_grad():
        assert torch.equal(served(ids, cu), c.eval()(ids, cu))
    # Two files, each mapped once by the writer (rw-s) and once by the reader (r--s).
    perms = sorted(p for p, _ in _maps_of(tmp_path))
    assert perms == ["r--s", "r--s", "rw-s", "rw-s"], _maps_of(tmp_path)


def test_mappings_of_files_that_left_the_directory_are_dropped(tmp_path, model_dir):
    a = _perturbed(model_dir, seed=9)
    served = ReaLModel.from_hf(model_dir)
    n = served.flat_params.numel()
    for v in (1, 2):
        write_model(a, str(tmp_path / f"v{v}.flat"), v)
        map_flat(str(tmp_path / f"v{v}.flat"), served.param_spec, v, n)  # tensor dropped
    other = tmp_path / "other"  # e.g. another run's directory, removed whole
    write_model(a, str(other / "v1.flat"), 1)
    map_flat(str(other / "v1.flat"), served.param_spec, 1, n)
    shutil.rmtree(other)
    retire(str(tmp_path / "v1.flat"))
    retire(str(tmp_path / "v2.flat"))  # replaces v1's file, which is deleted
    write_model(a, str(tmp_path / "v3.flat"), 3)
    map_flat(str(tmp_path / "v3.flat"), served.param_spec, 3, n)
    # No mapping of a deleted file is left holding its memory.
    assert not [m for m in _maps_of(tmp_path) if "(deleted)" in m[1]], _maps_of(tmp_path)
    assert len(_maps_of(tmp_path)) == 2  # v3's file: the writer's and the reader's


def test_a_served_mapping_is_read_only(tmp_path, model_dir):
    """A stray write into weights served from the file faults instead of changing the
    file under every other server (or silently detaching from it)."""
    a = _perturbed(model_dir, seed=10)
    path = str(tmp_path / "v1.flat")
    write_model(a, path, 1)
    code = (
        "import sys, torch\n"
        "from realhf.impl.model.conversion.flat_file import map_flat\n"
        "from realhf.impl.model.nn.real_model import ReaLModel\n"
        "m = ReaLModel.from_hf(sys.argv[2])\n"
        "m.use_flat(map_flat(sys.argv[1], m.param_spec, 1, m.flat_params.numel()))\n"
        "print('serving', flush=True)\n"
        "with torch.no_grad(): m.flat_params[0] = 7.0\n"
        "print('wrote', flush=True)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, path, str(model_dir)], capture_output=True, text=True
    )
    assert r.stdout.split() == ["serving"] and r.returncode == -signal.SIGSEGV, r.stderr[-2000:]
    out = torch.empty_like(a.flat_params)
    load_flat(out, a.param_spec, path, 1)
    assert torch.equal(out, a.flat_params)  # the file is as written


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_the_hf_recipe_builds_what_save_hf_writes_from_views_of_the_file(tmp_path, family):
    """What vLLM's worker loads with ``weight_sync=shm`` (it has no realhf): the recipe's
    tensors equal the HF checkpoint ``save_hf`` writes, bit for bit.  GPT-2 covers the
    transposed and concatenated kinds (its ``c_attn`` is three of our matrices)."""
    from safetensors.torch import load_file

    from realhf.impl.model.conversion.families import get_family
    from realhf.impl.model.conversion.flat_file import hf_recipe
    from realhf.system.rollout.vllm_worker_ext import assemble, map_file

    trained = _perturbed(make_tiny_hf_model(family, tmp_path / family), seed=9)
    path = str(tmp_path / "shm" / "v4.flat")
    write_model(trained, path, version=4)
    trained.save_hf(str(tmp_path / "hf"))
    want = load_file(str(tmp_path / "hf" / "model.safetensors"))
    rules = get_family(trained.config.family).weight_rules(trained.config)
    recipe = hf_recipe(path, 4, rules)
    # JSON on its way to vLLM
    got = dict(assemble(map_file(path, 4), json.loads(json.dumps(recipe))))
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    if family == "gpt2":
        assert any(e["transpose"] and len(e["pieces"]) == 3 for e in recipe)
    with pytest.raises(FlatFileError, match="holds weight version 4, not the 5 asked for"):
        hf_recipe(path, 5, rules)
    with pytest.raises(FlatFileError, match="holds weight version 4, not the 5 asked for"):
        map_file(path, 5)
    other = ReaLModel.from_hf(make_tiny_hf_model("qwen3", tmp_path / "q3", seed=1))
    q3_rules = get_family("qwen3").weight_rules(other.config)
    with pytest.raises(FlatFileError, match="its layout is not the served model's"):
        hf_recipe(path, 4, q3_rules)
