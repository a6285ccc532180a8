"""Serve a HuggingFace model directory with the built-in generation engine over HTTP.

    python -m realhf.apps.serve --model-path DIR --host 127.0.0.1 --port 30000

The server speaks SGLang's native protocol (``/generate``,
``/update_weights_from_disk``, ``/pause_generation``, ``/continue_generation``,
``/flush_cache``, ``/health``, ``/metrics``, ``/v1/models``) and OpenAI's
``/v1/completions`` and ``/v1/chat/completions`` (see
:mod:`realhf.impl.model.gen.http_app`). It prints one line starting with
``realhf generation server ready`` once it accepts requests. A directory
without tokenizer files is served token-ids-only (text inputs get HTTP 400).

Who may call what: the control routes (pause, continue, weight updates, cache flush,
abort, server information) want ``Authorization: Bearer <token>`` where the token is
``realhf.base.net.auth.http_token()`` of the secret in ``$REALHF_RUN_SECRET`` (hex) or
``$REALHF_SECRET_FILE``; give the server and its clients the same one, e.g.
``export REALHF_RUN_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')``.
Weight updates load directories under ``--weights-root`` only, and flat weight files
(``/update_weights_from_shm``) under ``--shm-root`` only.  The generation routes want
``--api-key`` (or the token) when set, by default when ``--host`` is not a loopback address.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import List, Optional

from realhf.api.core.gen_api import GenerateRequest, SamplingParams
from realhf.base import logging
from realhf.base.gcutil import freeze_startup_objects, keep_freed_memory
from realhf.base.net import auth
from realhf.base.net.http_server import (
    generation_api_keys,
    listen_socket,
    make_server,
    serve_until_started,
)
from realhf.impl.model.gen.engine_config import EngineConfig
from realhf.impl.model.gen.http_app import DEFAULT_MAX_CONCURRENT_REQUESTS, create_app
from realhf.impl.model.gen.loading import load_engine, load_tokenizer

logger = logging.getLogger("serve")

READY_LINE = "realhf generation server ready"
_WARMUP = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
#: most seconds from a warm engine to a listening socket (the app has no lifespan work)
_STARTUP_TIMEOUT_S = 60.0


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Command-line options (defaults from :class:`EngineConfig`)."""
    d = EngineConfig()
    p = argparse.ArgumentParser(
        prog="python -m realhf.apps.serve", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--model-path",
        required=True,
        help="HuggingFace directory (config.json + safetensors), or a PEFT LoRA adapter "
        "directory (served on its base; updates then carry adapters)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--served-model-name", default=None, help="name in /v1/models (default: directory name)"
    )
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    p.add_argument(
        "--context-length", type=int, default=None, help="default: the model's n_positions"
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="KV cache positions over all running requests (a request reserves prompt + "
        "max_new_tokens, a group's shared prompt once); default: max-running-requests x "
        "context-length",
    )
    p.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens)
    p.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests)
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=DEFAULT_MAX_CONCURRENT_REQUESTS,
        help="HTTP requests in flight; more are answered 503 with Retry-After and a reason",
    )
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--device", default=d.device)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--decode-attn-impl",
        default=d.decode_attn_impl,
        help="auto (the first that can run of cpp, numba, padded), cpp, numba or padded",
    )
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s)
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="CPU threads of the engine (torch and numba); default all cores",
    )
    p.add_argument(
        "--weights-root",
        default=None,
        help="directory under which /update_weights_from_disk may load weights (any other "
        "path answers 403); default: no weight updates",
    )
    p.add_argument(
        "--shm-root",
        default=None,
        help="directory (in /dev/shm) under which /update_weights_from_shm may map flat weight "
        "files (realhf.impl.model.conversion.flat_file); default: none",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="bearer key the generation routes (/generate, /v1/...) want, besides the run's "
        "token; default: the run's token when --host is not loopback, none on loopback; "
        "'' opens them wherever the server listens",
    )
    p.add_argument(
        "--no-pack-weights",
        action="store_true",
        help="do not pre-pack the linear weights for oneDNN (saves one copy of the weights "
        "in memory, decodes slower; EngineConfig.pack_weights)",
    )
    p.add_argument("--log-level", default="warning", help="uvicorn log level")
    return p.parse_args(argv)


async def _serve(server, sock, host: str, port: int, timeout: float) -> None:
    task = await serve_until_started(server, sock, timeout, name="realhf generation server")
    print(f"{READY_LINE} at http://{host}:{port}", flush=True)
    await task


def main(argv: Optional[List[str]] = None) -> int:
    """Load, serve until interrupted, close. Returns the exit code."""
    args = parse_args(argv)
    if not os.path.isdir(args.model_path):
        print(f"error: --model-path {args.model_path!r} is not a directory", file=sys.stderr)
        return 2
    if not any(
        os.path.isfile(os.path.join(args.model_path, f))
        for f in ("config.json", "adapter_config.json")
    ):
        print(
            f"error: --model-path {args.model_path!r} has no config.json; "
            "pass a HuggingFace model directory (or a PEFT LoRA adapter directory)",
            file=sys.stderr,
        )
        return 2
    try:
        config = EngineConfig(
            max_running_requests=args.max_running_requests,
            context_length=args.context_length,
            kv_cache_tokens=args.kv_cache_tokens,
            max_prefill_tokens=args.max_prefill_tokens,
            max_queued_requests=args.max_queued_requests,
            dtype=args.dtype,
            device=args.device,
            seed=args.seed,
            decode_attn_impl=args.decode_attn_impl,
            request_timeout_s=args.request_timeout,
            num_threads=args.num_threads,
            pack_weights=not args.no_pack_weights,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.max_concurrent_requests < 1:  # checked before the slow model load
        print(
            f"error: --max-concurrent-requests {args.max_concurrent_requests} is invalid: "
            "use an integer >= 1",
            file=sys.stderr,
        )
        return 2
    if not (os.environ.get(auth.SECRET_FILE_ENV) or os.environ.get(auth.SECRET_ENV)):
        logger.warning(
            f"neither ${auth.SECRET_ENV} nor ${auth.SECRET_FILE_ENV} is set: this server made "
            "a secret of its own, so no other process can call its control routes (pause, "
            f"weight updates); set ${auth.SECRET_ENV} for the server and its clients alike"
        )
    # A server's steps free and retake the same large tensors (a prefill's activations):
    # keep them in the process rather than fault them in again (see keep_freed_memory).
    keep_freed_memory()
    tokenizer = load_tokenizer(args.model_path)
    engine = load_engine(args.model_path, config, tokenizer=tokenizer)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model_path))
    app = create_app(
        engine,
        tokenizer=tokenizer,
        model_path=args.model_path,
        served_model_name=name,
        max_concurrent_requests=args.max_concurrent_requests,
        weights_root=args.weights_root,
        api_keys=generation_api_keys(args.api_key, args.host),
        shm_root=args.shm_root,
    )
    server = make_server(app, args.host, args.port, log_level=args.log_level)
    try:
        # Bind before starting and warming up the engine: a taken port fails at
        # once, and the port is ours while the warm-up runs.
        sock = listen_socket(args.host, args.port)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    engine.start()
    try:
        # One tiny request before the ready line: the first step loads compiled
        # kernels, which should not land on a client's latency.
        engine.generate(
            [GenerateRequest(input_ids=(0,), sampling=_WARMUP)], timeout=config.request_timeout_s
        )
        freeze_startup_objects()
        asyncio.run(_serve(server, sock, args.host, port, _STARTUP_TIMEOUT_S))
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
