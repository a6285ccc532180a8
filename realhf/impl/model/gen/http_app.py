"""HTTP front of the built-in engine: SGLang's native API and OpenAI-compatible routes.

Routes (SGLang names and response shapes, see :mod:`realhf.api.core.gen_api`), by who may call
them (see *Authentication* below):

Generation routes (the app's api key, when it has one):

- ``POST /generate`` — ``input_ids`` or ``text``, ``sampling_params``,
  ``return_logprob``, ``image_data``; answers ``{text?, output_ids, meta_info}`` (a list
  for a batch input or ``n > 1``).
- ``POST /v1/completions``, ``POST /v1/chat/completions`` (OpenAI; a chat message's
  content may hold ``image_url`` parts); ``GET /v1/models``.

Images (a vision-language model): data URLs only (``data:image/png;base64,...``: the
server opens no files and fetches nothing), one per image placeholder of the prompt (the
chat template writes one per image part), in order; the model directory's image processor
turns them into patches and expands the placeholders (prompts expanded already are kept).

Control routes (the run's token):

- ``POST /pause_generation`` — aborts every running and queued request (their
  callers get partial outputs with ``finish_reason.type == "abort"``); until
  ``POST /continue_generation``, ``/generate`` answers at once as aborted with no tokens
  and the OpenAI routes hold their requests. Both answer ``{"message", "status": "ok"}``.
  Which ``/generate`` answers keep their tokens across a pause follows the weight-update
  protocol's rules (:class:`~.weight_update.PauseGate`).
- ``POST /update_weights_from_disk {model_path}`` — ``{success, message,
  num_paused_requests}``; 403 when ``model_path`` is not under the server's publication
  directory (``weights_root``), 400 when loading fails.
- ``POST /update_weights_from_shm {path, weight_version}`` — the same for a flat weight file
  in shared memory (``weight_sync=shm``), under ``shm_root``; 400 also when the file holds
  another version than ``weight_version``.
- ``POST /update_weights_from_broadcast {sender, weight_version}`` — the same, pulled from
  the trainer's weight sender at ``sender`` (``host:port``; ``weight_sync=broadcast``); 400
  when the sender refuses or the transfer fails, 409 with ``superseded_by`` (the newer
  version) when the trainer staged a newer one since (the weights are unchanged).  A
  transfer that broke off leaves the server paused: ``/continue_generation`` fails until an
  update succeeds.
- ``GET|POST /flush_cache`` — 200 when idle, 400 while requests are in flight
  (there is no prefix cache to flush; kept for protocol compatibility).
- ``POST /abort_request {rid}``; ``GET /get_model_info``; ``GET /get_server_info`` (limits,
  engine stats, HTTP requests in flight and refused).

Open routes: ``GET /health`` (and ``/health_generate``); ``GET /metrics`` (Prometheus text:
``sglang:num_running_reqs``, ``sglang:num_used_tokens``, ``sglang:num_queue_reqs``,
``sglang:token_usage``, ``sglang:gen_throughput``, ``sglang:max_total_num_tokens`` and
token/request counters).

Authentication: a control route answers 401 unless the request carries
``Authorization: Bearer <the run's token>``
(:func:`~realhf.base.net.http_server.require_run_token`): pausing a server or loading weights
of one's choosing must not be open to whoever reaches the port.  The generation routes want
one of ``api_keys`` as a bearer token when the app has any (``GenerationServerConfig.api_key``:
by default the run's token when the server listens beyond loopback, none on loopback), as
vLLM's ``--api-key``.  Health and metrics stay open: they change nothing and reveal load
figures only, and the manager and monitoring read them.

Without a tokenizer, ``text`` inputs and OpenAI text prompts/chat are answered
with 400 and responses carry no ``text`` field. Invalid requests get 400 with
a message naming the field; more than ``max_concurrent_requests`` requests in
flight, a full queue or a closed engine 503 (the first with ``Retry-After``,
see :class:`~realhf.base.net.http_server.RequestLimit`; health, metrics, information
and control routes, :data:`UNLIMITED_PATHS`, are never refused for load); a request
that outlives the engine's ``request_timeout_s`` is aborted and answered with
504; a failed engine step 500 with the error. A client that disconnects does
not abort its request (it runs to its budget; ``/abort_request`` stops it).

Layout: one :class:`fastapi.APIRouter` per group of routes and of callers — ``native_router``
(``/generate``), ``openai_router`` (``/v1``; bodies parsed and answers shaped by
:mod:`.openai_api`), both behind the api key; ``control_router`` (pause, continue, weight
update, cache flush, abort, information: what the gserver manager calls around a weight
update), behind the run's token; ``open_router`` (health, metrics). The routers hold no state:
handlers reach the engine through the :data:`Served` dependency (``app.state.served``), so one
set of routers serves any number of apps, and :func:`create_app` only builds the app and
includes them.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Annotated, Any, Dict, List, Optional, Sequence, Tuple

import fastapi
import orjson
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from realhf.api.core.data_api import VisionInputs
from realhf.api.core.gen_api import (
    GenerateOutput,
    GenerateRequest,
    InvalidRequestError,
    parse_generate_body,
)
from realhf.base.net.http_server import (
    RequestLimit,
    bearer_refusal,
    fastapi_app,
    require_api_key,
    require_run_token,
)
from realhf.impl.dataset.images import ImageError, VisionProcessor, load_image
from realhf.impl.model.comm.weight_broadcast import WeightsSuperseded
from realhf.impl.model.gen import openai_api
from realhf.impl.model.gen.batch_scheduler import QueueFullError
from realhf.impl.model.gen.engine import EngineClosedError, GenerationEngine
from realhf.impl.model.gen.weight_update import (
    PauseGate,
    WeightPathRefused,
    allowed_weight_path,
    versioned_load_body,
)


def _json(obj: Any, status_code: int = 200) -> Response:
    # orjson serialises the long log-prob lists several times faster than json
    return Response(orjson.dumps(obj), status_code=status_code, media_type="application/json")


# The SGLang release whose /generate protocol we speak: 0.4.6.post4 is what
# AReaL v0.3 runs (patched with pause/continue, which upstream added later with
# the response shape used here). Fields were checked against sgl-project/sglang
# sources of the 0.4.6 - 0.5.x line (io_struct.py, sampling_params.py,
# tokenizer_manager.py, schedule_batch.py, entrypoints/http_server.py,
# metrics/collector.py).
SGLANG_PROTOCOL_VERSION = "0.4.6.post4"

#: Default bound of HTTP requests in flight.  A waiting request costs about 46 KB with
#: short prompts (benchmark/results/load.md), so the bound keeps them under 200 MB; queueing
#: more than 4096 requests behind ``max_running_requests`` only adds latency.
DEFAULT_MAX_CONCURRENT_REQUESTS = 4096

#: Routes served whatever the load: a refused health check or metrics read would get an
#: overloaded server declared dead by the gserver manager, a refused pause or weight update
#: would fail the run; all are cheap and come from few callers.
UNLIMITED_PATHS = (
    "/health",
    "/health_generate",
    "/metrics",
    "/get_model_info",
    "/get_server_info",
    "/v1/models",
    "/abort_request",
    "/pause_generation",
    "/continue_generation",
    "/update_weights_from_disk",
    "/update_weights_from_shm",
    "/update_weights_from_broadcast",
    "/flush_cache",
)


class _HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _error(status: int, message: str, openai: bool) -> JSONResponse:
    if openai:
        kind = "invalid_request_error" if status == 400 else "server_error"
        body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    else:
        body = {"error": {"message": message}}
    return JSONResponse(body, status_code=status)


async def _json_body(request: fastapi.Request) -> Any:
    # Parsed by hand rather than declared as a pydantic body: SGLang's bodies are loose
    # (text or ids, one or a batch), and a bad body must answer 400 in SGLang's error
    # shape, not FastAPI's 422.
    raw = await request.body()
    try:
        return json.loads(raw) if raw else {}
    except ValueError as e:
        raise InvalidRequestError(f"the request body is not valid JSON: {e}") from None


class _Served:
    """What every route reaches through ``app.state.served``: the engine, its names, and the
    directories weight updates may load from."""

    def __init__(
        self,
        engine: GenerationEngine,
        tokenizer,
        model_path: str,
        served_model_name,
        weights_root: Optional[str] = None,
        shm_root: Optional[str] = None,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.served_model_name = served_model_name
        self.weights_root = weights_root
        self.shm_root = shm_root
        self.timeout = engine.config.request_timeout_s
        #: the weight-update protocol's rules for /generate (see :mod:`.weight_update`)
        self.gate = PauseGate()
        #: a vision-language model's image processor (None: text only)
        self.vision = None
        if getattr(engine, "vision", None) is not None and model_path:
            self.vision = VisionProcessor.from_model_dir(model_path)

    async def with_images(
        self, ids: List[int], urls: Optional[List[str]]
    ) -> Tuple[List[int], Optional[VisionInputs]]:
        """A prompt's ids with its image placeholders expanded, and its processed images
        (given as data URLs: the server reads no files and fetches nothing)."""
        if not urls:
            return ids, None
        if self.vision is None:
            raise InvalidRequestError(
                "images were sent, but this server's model is not a vision-language model "
                "(or its directory has no preprocessor_config.json)"
            )
        bad = next((u for u in urls if not u.startswith("data:")), None)
        if bad is not None:
            raise InvalidRequestError(
                f"image {bad[:40]!r}: send images as data URLs (data:image/png;base64,...); "
                "this server reads no files and fetches no URLs"
            )

        def process():
            try:
                images = [load_image(u, "") for u in urls]
                expanded, pixels, grid = self.vision(ids, images, "the prompt")
            except ImageError as e:
                raise InvalidRequestError(f"images: {e}") from None
            return expanded, VisionInputs(pixels, grid)

        return await asyncio.to_thread(process)  # (decoding and resizing: off the loop)

    def check_size(self, n_sequences: int) -> None:
        """A request must fit the engine's queue: one that never could is a 400, before it
        is expanded into ``n_sequences`` engine requests (``n`` comes from the client, and
        expanding ``n = 2**63`` would hold the event loop for good)."""
        limit = self.engine.config.max_queued_requests
        if n_sequences > limit:
            raise InvalidRequestError(
                f"the request asks for {n_sequences} sequences (prompts x n); this server "
                f"queues at most {limit} (max_queued_requests): send fewer at a time"
            )

    async def run(self, groups: List[List[GenerateRequest]]) -> List[List[GenerateOutput]]:
        """Submit every request of ``groups`` and wait for all; outputs keep the grouping."""
        engine = self.engine
        flat = [r for g in groups for r in g]
        for r in flat:  # validate everything before queueing anything
            engine.check_request(r)
        # In one piece: a group's answers are admitted together and share their prompt.
        futs = [asyncio.wrap_future(f) for f in engine.submit_all(flat)]
        try:
            outs = await asyncio.wait_for(asyncio.gather(*futs), self.timeout)
        except asyncio.TimeoutError:
            # wait_for only cancels the asyncio wrappers; the engine keeps decoding the
            # requests (and holding their cache slots) until they are aborted there.
            for r in flat:
                await asyncio.to_thread(engine.abort, r.rid)
            raise _HTTPError(
                504, f"generation did not finish within {self.timeout} s; aborted"
            ) from None
        it = iter(outs)
        return [[next(it) for _ in g] for g in groups]

    async def run_gated(self, groups: List[List[GenerateRequest]]) -> List[List[GenerateOutput]]:
        """:meth:`run` under the weight-update protocol's rules: nothing runs while paused,
        and an answer that a pause overlapped keeps no token made by other weights."""
        gate = self.gate
        ticket = gate.ticket()
        if ticket is None:
            for g in groups:
                for r in g:
                    self.engine.check_request(r)  # a bad request is still a 400
            return [[gate.refused(r.rid, len(r.input_ids)) for r in g] for g in groups]
        outs = await self.run(groups)
        return [[gate.checked(ticket, o) for o in g] for g in outs]

    def decode(self, ids) -> Optional[str]:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


async def _served(request: fastapi.Request) -> _Served:
    # async: FastAPI runs a plain ``def`` dependency in its thread pool, a round trip
    # through a worker thread and back into the event loop for every request.
    return request.app.state.served


#: The route dependency that hands a handler the app's :class:`_Served`.
Served = Annotated[_Served, fastapi.Depends(_served)]


def _handle_errors(openai: bool):
    """Answer the engine's and the request's errors with their status, in the error body
    shape of the route's protocol (SGLang or OpenAI)."""

    def deco(fn):
        async def wrapper(request: fastapi.Request, served: Served):
            try:
                return await fn(request, served)
            except InvalidRequestError as e:
                return _error(400, str(e), openai)
            except QueueFullError as e:
                return _error(503, str(e), openai)
            except EngineClosedError as e:
                return _error(503, str(e), openai)
            except _HTTPError as e:
                return _error(e.status, str(e), openai)
            except Exception as e:  # a failed engine step; the server keeps serving
                return _error(500, f"{type(e).__name__}: {e}", openai)

        # Not functools.wraps: FastAPI would follow __wrapped__ to fn's signature.
        wrapper.__name__ = fn.__name__
        return wrapper

    return deco


# ---------------------------------------------------------------- SGLang serving routes
native_router = fastapi.APIRouter(dependencies=[require_api_key()])


@native_router.api_route("/generate", methods=["POST", "PUT"])
@_handle_errors(openai=False)
async def generate(request: fastapi.Request, served: _Served):
    tokenizer = served.tokenizer
    batch = parse_generate_body(await _json_body(request))
    served.check_size(sum(sp.n for sp in batch.sampling))
    if batch.texts is not None:
        if tokenizer is None:
            raise InvalidRequestError(
                "text inputs need a tokenizer, and this server's model directory has none; "
                "send input_ids"
            )
        prompts = [tokenizer.encode(t) for t in batch.texts]
    else:
        prompts = batch.prompts
    images = None
    if batch.image_data is not None and any(batch.image_data):
        done = [await served.with_images(p, u) for p, u in zip(prompts, batch.image_data)]
        prompts, images = [d[0] for d in done], [d[1] for d in done]
    outs = await served.run_gated(batch.requests(prompts, images))
    results = []
    for i, per_prompt in enumerate(outs):
        for o in per_prompt:
            texts = None
            if batch.return_text_in_logprobs and tokenizer is not None:
                texts = [tokenizer.decode([t]) for t in o.output_ids]
            results.append(
                o.to_sglang(
                    text=served.decode(o.output_ids),
                    return_logprob=batch.return_logprob[i],
                    token_texts=texts,
                )
            )
    return _json(results if batch.returns_list else results[0])


# ---------------------------------------------------------------- open routes
# No token: they change nothing and reveal load figures only; the manager's health checks and
# a monitoring scraper read them.
open_router = fastapi.APIRouter()


@open_router.get("/health")
@open_router.get("/health_generate")
async def health(served: Served):
    return Response(status_code=200 if served.engine.alive else 503)


@open_router.get("/metrics")
async def metrics(served: Served):
    return PlainTextResponse(prometheus_text(served.engine.stats(), served.served_model_name))


# ---------------------------------------------------------------- control routes
# The gserver manager's ServerPool calls pause -> update_weights_from_disk -> continue on every
# server after each training step (SGLang's names and answers).  All want the run's token.
control_router = fastapi.APIRouter(dependencies=[require_run_token()])


@control_router.post("/pause_generation")
@_handle_errors(openai=False)
async def pause_generation(request: fastapi.Request, served: _Served):
    served.gate.pause()  # first: from here on /generate admits nothing until the resume
    # Engine calls that take its lock run in a thread: the event loop keeps serving.
    await asyncio.to_thread(served.engine.pause)
    return {"message": "Generation paused successfully.", "status": "ok"}


@control_router.post("/continue_generation")
@_handle_errors(openai=False)
async def continue_generation(request: fastapi.Request, served: _Served):
    await asyncio.to_thread(served.engine.resume)
    served.gate.resume()
    return {"message": "Generation continued successfully.", "status": "ok"}


@control_router.post("/update_weights_from_disk")
@_handle_errors(openai=False)
async def update_weights_from_disk(request: fastapi.Request, served: _Served):
    body = await _json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
        raise InvalidRequestError('send {"model_path": "<HF directory>"}')
    extra = set(body) - {"model_path", "load_format", "abort_all_requests", "weight_version"}
    if extra:
        raise InvalidRequestError(f"unknown fields {sorted(extra)}")
    return await _load_weights(
        served,
        body["model_path"],
        served.weights_root,
        served.engine.update_weights_from_disk,
        abort_all=bool(body.get("abort_all_requests")),
    )


@control_router.post("/update_weights_from_shm")
@_handle_errors(openai=False)
async def update_weights_from_shm(request: fastapi.Request, served: _Served):
    path, version = versioned_load_body(await _json_body(request), "path", "<flat weight file>")
    return await _load_weights(
        served,
        path,
        served.shm_root,
        lambda path: served.engine.update_weights_from_shm(path, version),
    )


@control_router.post("/update_weights_from_broadcast")
@_handle_errors(openai=False)
async def update_weights_from_broadcast(request: fastapi.Request, served: _Served):
    sender, version = versioned_load_body(await _json_body(request), "sender", "<host:port>")
    # No root to check: the sender must answer with the run's MAC and prove the secret.
    return await _load_weights(
        served,
        sender,
        None,
        lambda sender: served.engine.update_weights_from_broadcast(sender, version),
        is_path=False,
    )


async def _load_weights(
    served: _Served, path: str, root, load, abort_all: bool = False, is_path: bool = True
):
    """The load step of a weight update: ``load(path)`` on a worker thread once ``path`` is
    found under ``root`` (``is_path`` False: ``path`` is an address, taken as is); the answer
    SGLang's routes give."""
    engine = served.engine
    try:
        if is_path:
            path = allowed_weight_path(path, root)
    except WeightPathRefused as e:
        return JSONResponse(
            {"success": False, "message": str(e), "num_paused_requests": 0}, status_code=403
        )
    paused = 0
    try:
        if abort_all:
            # SGLang aborts what is running first: the whole protocol (pause, load,
            # continue) in one call, with the gate's rules for what overlapped it.
            served.gate.pause()
            paused = len(await asyncio.to_thread(engine.pause))
        version = await asyncio.to_thread(load, path)
    except WeightsSuperseded as e:
        # Not a failure: the trainer moved on before this server pulled.  The weights are
        # unchanged; the client asks for ``superseded_by`` next (409: a conflict of versions).
        return JSONResponse(
            {
                "success": False,
                "message": f"Weights not updated: {e}",
                "superseded_by": e.newer,
                "num_paused_requests": paused,
            },
            status_code=409,
        )
    except Exception as e:  # a bad checkpoint must not take the server down
        return JSONResponse(
            {
                "success": False,
                "message": f"Failed to update weights: {e}",
                "num_paused_requests": paused,
            },
            status_code=400,
        )
    finally:
        if abort_all:
            try:
                await asyncio.to_thread(engine.resume)
            finally:  # nobody sends /continue_generation after this call: never stay gated
                served.gate.resume()
    return {
        "success": True,
        "message": f"Succeeded to update model weights (version {version}).",
        "num_paused_requests": paused,
    }


@control_router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(served: Served):
    st = served.engine.stats()
    idle = st["num_running_reqs"] == 0 and st["num_queue_reqs"] == 0
    return PlainTextResponse(
        "Cache flushed.\n" if idle else "Cache not flushed: requests are running or waiting.\n",
        status_code=200 if idle else 400,
    )


@control_router.post("/abort_request")
@_handle_errors(openai=False)
async def abort_request(request: fastapi.Request, served: _Served):
    body = await _json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get("rid"), str):
        raise InvalidRequestError('send {"rid": "<request id>"}')
    found = await asyncio.to_thread(served.engine.abort, body["rid"])
    return {"success": found}


@control_router.get("/get_model_info")
async def get_model_info(served: Served):
    return {
        "model_path": served.model_path,
        "tokenizer_path": served.model_path if served.tokenizer is not None else None,
        "is_generation": True,
        "weight_version": str(served.engine.weight_version),
    }


@control_router.get("/get_server_info")
async def get_server_info(request: fastapi.Request, served: Served):
    engine = served.engine
    return {
        "model_path": served.model_path,
        "served_model_name": served.served_model_name,
        "context_length": engine.context_length,
        "max_running_requests": engine.config.max_running_requests,
        "max_total_num_tokens": engine.cache.n_tokens,
        "decode_attention": engine.decode_impl,
        "protocol": f"sglang {SGLANG_PROTOCOL_VERSION}",
        "stats": engine.stats(),
        "http": request.app.state.request_limit.stats(),
    }


# ---------------------------------------------------------------- OpenAI routes
# Bodies are parsed and answers shaped by openai_api; these routes only run the engine.
openai_router = fastapi.APIRouter(prefix="/v1", dependencies=[require_api_key()])


@openai_router.get("/models")
async def models(served: Served):
    name = served.served_model_name
    card = {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "realhf",
        "root": name,
        "max_model_len": served.engine.context_length,
    }
    return {"object": "list", "data": [card]}


@openai_router.post("/completions")
@_handle_errors(openai=True)
async def completions(request: fastapi.Request, served: _Served):
    tokenizer = served.tokenizer
    prompts, sp, logprobs = openai_api.completion_prompts(await _json_body(request), tokenizer)
    served.check_size(len(prompts) * sp.n)
    groups = [
        [GenerateRequest(input_ids=tuple(p), sampling=sp.for_sample(j)) for j in range(sp.n)]
        for p in prompts
    ]
    outs = await served.run(groups)
    return _json(
        openai_api.completion_response(outs, served.served_model_name, tokenizer, logprobs)
    )


@openai_router.post("/chat/completions")
@_handle_errors(openai=True)
async def chat_completions(request: fastapi.Request, served: _Served):
    tokenizer = served.tokenizer
    ids, sp, logprobs, urls = openai_api.chat_prompt(await _json_body(request), tokenizer)
    served.check_size(sp.n)
    ids, images = await served.with_images(ids, urls)
    group = [
        GenerateRequest(input_ids=tuple(ids), sampling=sp.for_sample(j), images=images)
        for j in range(sp.n)
    ]
    outs = await served.run([group])
    return _json(openai_api.chat_response(outs[0], served.served_model_name, tokenizer, logprobs))


class _HotRoutes:
    """ASGI shortcut for the serving routes' ``POST``: straight to the handler.

    FastAPI's routing, per-request dependency solving and endpoint wrapping were about 40 %
    of the event loop's busy time at 256 concurrent ``/v1/completions`` (py-spy,
    2026-11-26), and the event loop shares the machine with the engine.  These routes need
    none of it: the handler (the same function the router serves, so errors keep their
    status and shape) gets a plain request and the app's :class:`_Served`.  Installed
    inside :class:`~realhf.base.net.http_server.RequestLimit`, which therefore still counts and
    refuses them; every other method and path goes on to FastAPI.
    """

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope, receive, send):
        handler = _HOT_ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        request = fastapi.Request(scope, receive)
        state = scope["app"].state
        # The routers' require_api_key(), which this shortcut skips, in the same words.
        why = bearer_refusal(
            request.headers.get("authorization"), state.api_keys, "this server's api key"
        )
        if why is not None:
            response = JSONResponse(
                {"detail": f"POST {scope['path']}: {why}"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        else:
            response = await handler(request, state.served)
        await response(scope, receive, send)


def create_app(
    engine: GenerationEngine,
    *,
    tokenizer=None,
    model_path: str = "",
    served_model_name: str = "default",
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
    weights_root: Optional[str] = None,
    api_keys: Optional[Sequence[str]] = None,
    shm_root: Optional[str] = None,
) -> fastapi.FastAPI:
    """A FastAPI app serving ``engine`` (which the caller starts and closes).

    At most ``max_concurrent_requests`` requests of the serving routes are in flight; more
    are answered 503 with a reason (``app.state.request_limit`` counts them).
    ``/update_weights_from_disk`` loads directories under ``weights_root`` only (None: no
    weight updates; in a run, :func:`~realhf.base.constants.weight_publication_root`),
    ``/update_weights_from_shm`` flat files under ``shm_root`` only (None: none; in a run,
    :func:`~realhf.base.constants.weight_shm_root`).
    The generation routes want one of ``api_keys`` as a bearer token (None or empty: open;
    :func:`~realhf.base.net.http_server.generation_api_keys` makes them from a config);
    the control routes always want the run's token.
    """
    app = fastapi_app(title="realhf generation server")
    app.state.served = _Served(
        engine, tokenizer, model_path, served_model_name, weights_root, shm_root
    )
    app.state.api_keys = tuple(api_keys) if api_keys else None
    app.add_middleware(_HotRoutes)  # added first: inside the request limit
    app.state.request_limit = RequestLimit(
        max_concurrent_requests, UNLIMITED_PATHS, name="the generation server"
    ).install(app)
    for router in (native_router, control_router, openai_router, open_router):
        app.include_router(router)
    return app


#: Paths :class:`_HotRoutes` serves without FastAPI's routing (their POST only), taken
#: from the routers so that a path is written in one place.
_HOT_ROUTES = {
    r.path: r.endpoint
    for router in (native_router, openai_router)
    for r in router.routes
    if r.endpoint in (generate, completions, chat_completions)
}

_GAUGES = (
    ("num_running_reqs", "The number of running requests."),
    ("num_used_tokens", "The number of used tokens."),
    ("num_queue_reqs", "The number of requests in the waiting queue."),
    ("token_usage", "The token usage."),
    ("gen_throughput", "The generation throughput (token/s)."),
    ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."),
)
_COUNTERS = (
    ("prompt_tokens_total", "Number of prefill tokens processed."),
    ("generation_tokens_total", "Number of generation tokens processed."),
    ("num_requests_total", "Number of requests processed."),
)


def prometheus_text(stats: Dict[str, Any], model_name: str) -> str:
    """Prometheus exposition text of the engine's stats, named like SGLang's metrics."""
    stats = dict(stats)
    stats["token_usage"] = stats["num_used_tokens"] / max(1, stats["max_total_num_tokens"])
    label = '{model_name="%s"}' % model_name.replace('"', "'")
    lines = []
    for name, doc in _GAUGES:
        lines += [
            f"# HELP sglang:{name} {doc}",
            f"# TYPE sglang:{name} gauge",
            f"sglang:{name}{label} {float(stats[name])}",
        ]
    for name, doc in _COUNTERS:
        lines += [
            f"# HELP sglang:{name} {doc}",
            f"# TYPE sglang:{name} counter",
            f"sglang:{name}{label} {float(stats[name])}",
        ]
    return "\n".join(lines) + "\n"
