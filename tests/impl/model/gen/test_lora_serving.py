"""A server of a LoRA run: it serves the base with adapters, and each weight update (disk,
shm, broadcast) carries the adapters alone; what it then serves is the trainer's model."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest
import requests
import torch

from realhf.api.cli_args import LoraConfig
from realhf.base.net.http_server import ServerThread, auth_headers
from realhf.impl.model.comm.weight_broadcast import WeightSender
from realhf.impl.model.conversion.flat_file import write_flat
from realhf.impl.model.gen.engine_config import EngineConfig
from realhf.impl.model.gen.http_app import create_app
from realhf.impl.model.gen.loading import load_engine
from realhf.impl.model.gen.weight_update import update_server
from realhf.impl.model.nn.lora import add_lora, save_peft

from .conftest import load, recompute_logprobs

SPEC = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])


def _trained(model_dir, seed):
    """A trainer's LoRA actor after training: adapters with B != 0."""
    m = load(model_dir)
    add_lora(m, SPEC, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for n, p in m.lora.params.items():
            if n.endswith("lora_B"):
                p.normal_(0, 0.3, generator=g)
    return m.eval()


async def _update(url, version, path, mode):
    async def healthy(_):
        return True

    async with aiohttp.ClientSession() as session:
        await update_server(session, url, version, path, 60.0, healthy, mode)


def _served(url, prompt, n=8):
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    r = requests.post(url + "/generate", json=body, headers=auth_headers(), timeout=60)
    return r.json()["meta_info"]["output_token_logprobs"]


@pytest.fixture
def lora_server(model_dir, tmp_path):
    cfg = EngineConfig(max_running_requests=4, context_length=256, num_threads=1)
    engine = load_engine(model_dir, cfg, lora=SPEC).start()
    srv = ServerThread(create_app(engine, weights_root=str(tmp_path), shm_root=str(tmp_path)))
    srv.start()
    srv.engine = engine
    yield srv
    srv.stop()
    engine.close(timeout=10)


def test_adapter_updates_in_every_mode_serve_the_trainers_model(lora_server, model_dir, tmp_path):
    prompt = [8, 9, 10]
    base = load(model_dir)
    # Fresh adapters change nothing: the server starts as the base model.
    entries = _served(lora_server.url, prompt)
    lps = recompute_logprobs(base, prompt, [e[1] for e in entries])
    assert max(abs(e[0] - float(l)) for e, l in zip(entries, lps)) < 1e-4
    packs = lora_server.engine._packer
    sender = WeightSender(host="127.0.0.1", timeout=10.0)
    try:
        for version, mode in enumerate(("disk", "shm", "broadcast"), start=1):
            trained = _trained(model_dir, seed=version)
            if mode == "disk":
                path = str(tmp_path / f"v{version}")
                save_peft(trained, path, base_model_path=model_dir)
                assert sorted(os.listdir(path)) == [
                    "adapter_config.json",
                    "adapter_model.safetensors",
                ]
            elif mode == "shm":
                path = str(tmp_path / f"v{version}.flat")
                sent = write_flat(trained.lora.flat, trained.lora.param_spec, path, version)
                assert sent < trained.lora.flat.numel() * 4 + (64 << 10)  # adapters only
            else:
                sender.stage(trained.lora.flat, trained.lora.param_spec, version)
                path = sender.address
            asyncio.run(_update(lora_server.url, version, path, mode))
            entries = _served(lora_server.url, prompt)
            lps = recompute_logprobs(trained, prompt, [e[1] for e in entries])
            assert max(abs(e[0] - float(l)) for e, l in zip(entries, lps)) < 1e-4, mode
            assert torch.equal(lora_server.engine.model.lora.flat, trained.lora.flat)
            assert torch.equal(lora_server.engine.model.flat_params, base.flat_params)
        # The base's packed weights were never repacked: the updates did not touch them.
        assert lora_server.engine._packer is packs
        assert sender.wait_transfers(10) and sender.sent == 1
    finally:
        sender.close()
