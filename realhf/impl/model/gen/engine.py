"""The built-in generation engine: continuous batching over ReaLModel.

A dedicated thread owns the model, the KV cache and the scheduler, and loops::

    apply commands (new requests, aborts, pause, weight updates)
    admit waiting requests while KV pages for their whole length are free
    one packed forward: a token for every running sequence + the new prompts
    sample, append, finish sequences that stopped, free their pages

Callers on other threads (the HTTP server's event loop, tests, benchmarks) use
:meth:`GenerationEngine.submit`, which returns a ``concurrent.futures.Future``,
and control methods that block (with a timeout) until the engine thread has
carried them out. Both travel as small frozen command objects on a thread-safe
queue that the engine thread drains between steps, so nothing else touches the
model or the cache and there are no locks on the hot path. A command that
raises fails its own caller (the request's or the control call's future).

Shutdown: :meth:`close` sets a flag and wakes the thread, which fails every
in-flight future with ``EngineClosedError`` and exits; ``close`` joins it with a
timeout. A crash in a model step fails the futures of every in-flight
request with the exception (their cache state is unknown) and the engine keeps
serving new ones.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
import queue
import threading
import time
import traceback
from typing import (
    Any,
    Callable,
    ClassVar,
    Deque,
    Dict,
    Iterable,
    List,
    NamedTuple,
    Optional,
    Tuple,
    Type,
)
from typing import Sequence as Seq

import torch

from realhf.api.core.gen_api import (
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    InvalidRequestError,
)
from realhf.base import logging
from realhf.impl.kernels import simd_isa
from realhf.impl.model.comm.weight_broadcast import WeightReceiver, WeightSyncError
from realhf.impl.model.conversion.flat_file import flat_dtype, load_flat, map_flat
from realhf.impl.model.gen.batch_scheduler import Scheduler
from realhf.impl.model.gen.cache_attention import (
    DecodeAttention,
    DecodeImpl,
    PrefillAttention,
    select_decode_impl,
)
from realhf.impl.model.gen.engine_config import EngineConfig
from realhf.impl.model.gen.kv_cache import PagedKVCache, check_cache_fits, pages_for
from realhf.impl.model.gen.sampler import SamplingBatch, sample
from realhf.impl.model.gen.sequence import Sequence
from realhf.impl.model.nn.lora import is_adapter_dir
from realhf.impl.model.nn.packed_linear import WeightPacker, packing_supported
from realhf.impl.model.nn.parallel_hooks import LOCAL
from realhf.impl.model.nn.real_model import ReaLModel
from realhf.impl.model.nn.vision import VisionInputs, mrope_positions

logger = logging.getLogger("gen_engine")

#: A directory: every engine then records each step's wall time and running sequences to
#: ``{dir}/occupancy-{pid}.tsv`` (the generation-batch occupancy that
#: benchmark/async_vs_sync.py reports).  Unset: nothing is recorded.
OCCUPANCY_DIR_ENV = "REALHF_GEN_OCCUPANCY_DIR"
#: seconds of weight packing per engine step after an update (a 0.5B model's layer is
#: ~10 ms, its LM head ~0.1 s: packed over the first ~15 steps), and per idle turn
_PACK_STEP_S = 0.02
_PACK_IDLE_S = 0.05


class _OccupancyLog:
    """Appends ``time<TAB>running<TAB>slots`` lines, flushed about once a second."""

    def __init__(self, directory: str, slots: int):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"occupancy-{os.getpid()}.tsv")
        self.slots = slots
        self._rows: List[str] = []
        self._flushed = time.monotonic()

    @classmethod
    def from_env(cls, slots: int) -> Optional["_OccupancyLog"]:
        d = os.environ.get(OCCUPANCY_DIR_ENV)
        return cls(d, slots) if d else None

    def record(self, running: int) -> None:
        self._rows.append(f"{time.time():.4f}\t{running}\t{self.slots}\n")
        if time.monotonic() - self._flushed > 1.0:
            self.flush()

    def flush(self) -> None:
        if self._rows:
            with open(self.path, "a") as f:
                f.writelines(self._rows)
            self._rows.clear()
        self._flushed = time.monotonic()


class EngineClosedError(RuntimeError):
    """The engine was closed while a request or command was in flight."""


# ---- the engine thread's inbox: one frozen class per command ----------------------------


@dataclasses.dataclass(frozen=True)
class _Add:
    """Queue new sequences, in one piece (a group is admitted together and shares its
    prompt's cache pages); each future resolves when its sequence finishes."""

    seqs: Tuple[Sequence, ...]

    def done(self, result: Any) -> None:
        pass  # the sequence resolves its future when it finishes, not when it is queued

    def fail(self, exc: BaseException) -> None:
        for seq in self.seqs:
            seq.fail(exc)


@dataclasses.dataclass(frozen=True)
class _Control:
    """A control command; the caller blocks on ``future`` for the handler's result."""

    #: what the command does, for error messages
    label: ClassVar[str] = "control"
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)

    def done(self, result: Any) -> None:
        self.future.set_result(result)

    def fail(self, exc: BaseException) -> None:
        self.future.set_exception(exc)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Abort(_Control):
    label: ClassVar[str] = "abort"
    rid: str


@dataclasses.dataclass(frozen=True)
class _Pause(_Control):
    label: ClassVar[str] = "pause"


@dataclasses.dataclass(frozen=True)
class _Resume(_Control):
    label: ClassVar[str] = "resume"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _UpdateWeights(_Control):
    label: ClassVar[str] = "update_weights"
    path: str
    #: None: ``path`` is a HF directory; else a flat weight file that must hold this version
    #: (or, with ``broadcast``, the version to pull)
    flat_version: Optional[int] = None
    #: ``path`` is the address of the trainer's weight sender (``weight_sync=broadcast``)
    broadcast: bool = False
    #: bound on the broadcast's waits (seconds)
    timeout_s: float = 60.0


_Command = _Add | _Control


class _StepSampling(NamedTuple):
    """A step's sequences and what their sampling needed (for the next step's reuse)."""

    seqs: List[Sequence]
    #: per row, the index of its uniform in the flattened ``[rows, context]`` table
    flat: torch.Tensor
    #: every row's parameters, uniforms and stop masks left out
    params: SamplingBatch
    #: whether any row has stop tokens it may not emit yet (``min_new_tokens``)
    masks: bool


class GenerationEngine:
    """Serve generation requests for one model with continuous batching.

    Args:
        model: a ReaLModel (``model(input_ids, cu_seqlens, position_ids=,
            attn_fn=) -> logits`` and ``model.config``), already on its device.
        config: engine limits and numerics.
        eos_token_ids: default stop tokens (besides ``pad_token_id``).
        pad_token_id: also a default stop token when set.
        load_weights: ``fn(model, hf_dir)`` used by :meth:`update_weights_from_disk`;
            defaults to ``model.load_hf_weights(hf_dir)``.
    """

    def __init__(
        self,
        model,
        config: EngineConfig,
        *,
        eos_token_ids: Iterable[int] = (),
        pad_token_id: Optional[int] = None,
        load_weights: Optional[Callable] = None,
    ):
        self.model = model
        self.config = config
        self.vocab_size = model.config.vocab_size
        # The cache holds this rank's key/value heads (tensor parallelism) of the blocks
        # of its pipeline stage; attn_fn gets global block indices.
        mc = getattr(model, "layer_config", model.config)
        hooks = getattr(model, "tp", LOCAL)
        self._gather_logits = hooks.gather_logits
        self._run_model = functools.partial(hooks.run_stages, model)
        blocks = getattr(model, "blocks", None)
        self._first_block = blocks[0].block_idx if blocks else 0
        n_cache_layers = len(blocks) if blocks else mc.n_layers
        self.sliding_window = getattr(mc, "sliding_window", None)
        self.context_length = config.context_length or mc.n_positions
        #: a vision-language model's vision tower config (None: text only)
        self.vision = getattr(mc, "vision", None)
        # Vision tokens are never sampled: a generated image placeholder would have no
        # image behind it when the answer is trained on.
        v = self.vision
        self._banned = (
            None
            if v is None
            else torch.tensor(
                sorted({v.image_token_id, v.video_token_id, v.vision_start_token_id,
                        v.vision_end_token_id} & set(range(self.vocab_size)))
            )
        )  # fmt: skip
        defaults = set(int(t) for t in eos_token_ids)
        if pad_token_id is not None:
            defaults.add(int(pad_token_id))
        self.default_stop_ids = frozenset(defaults)
        self._load_weights = load_weights or (lambda m, path: m.load_hf_weights(path))
        self._serving_file = False  # the weights are a flat file's read-only mapping (shm)
        self.device = next(iter(model.parameters())).device
        kv_tokens = config.kv_cache_tokens or config.max_running_requests * self.context_length
        check_cache_fits(mc, kv_tokens, config.torch_dtype, self.device)
        self.cache = PagedKVCache(
            n_layers=n_cache_layers,
            n_kv_heads=mc.n_kv_heads,
            head_dim=mc.head_dim,
            n_tokens=kv_tokens,
            dtype=config.torch_dtype,
            device=self.device,
        )
        self.decode_impl = select_decode_impl(self.cache.k, config.decode_attn_impl)
        #: packs the linear weights for oneDNN after each update, a few per step (None: off)
        self._packer: Optional[WeightPacker] = None
        if (
            config.pack_weights
            and isinstance(model, ReaLModel)
            and packing_supported(model.dtype, self.device)
            and not getattr(model, "tp", LOCAL).distributed
        ):
            self._packer = WeightPacker(model, batch_hint=min(config.max_running_requests, 64))
        self.scheduler = Scheduler(
            self.cache,
            max_running=config.max_running_requests,
            max_prefill_tokens=config.max_prefill_tokens,
            max_queued_requests=config.max_queued_requests,
        )
        # One row of pre-drawn uniforms per running row: token i of the sequence in
        # row r uses uniforms[r, i], drawn from the request's own generator.
        self._uniforms = torch.zeros(config.max_running_requests, self.context_length)
        # Each running row's page table (a sequence holds its pages from admission to the
        # end), so that a decode step gathers its tables by row instead of from lists.
        self._page_table = torch.zeros(
            config.max_running_requests,
            pages_for(self.context_length, self.cache.page_size),
            dtype=torch.long,
        )
        self._last_sampling: Optional[_StepSampling] = None
        self._generator = torch.Generator().manual_seed(config.seed)
        self._inbox: "queue.SimpleQueue[_Command]" = queue.SimpleQueue()
        self._wake = threading.Event()
        self._closing = False
        self.paused = False
        self.weight_version = 0
        #: why the weights are neither version (a pull that broke off), else None
        self.weights_incomplete: Optional[str] = None
        self._receiver: Optional[WeightReceiver] = None
        self.last_error: Optional[str] = None
        self.total_prompt_tokens = 0
        self.total_generated_tokens = 0
        self.total_finished = 0
        self._recent: Deque[Tuple[float, int]] = collections.deque(maxlen=256)
        self._occupancy = _OccupancyLog.from_env(config.max_running_requests)
        self._thread = threading.Thread(target=self._loop, name="gen-engine", daemon=True)
        logger.info(
            f"engine: up to {config.max_running_requests} sequences of up to "
            f"{self.context_length} tokens, KV cache of {self.cache.n_tokens} tokens "
            f"({self.cache.nbytes / 2**20:.1f} MiB) on {self.device}, "
            f"decode attention {self.decode_impl}"
            + (f" ({simd_isa()})" if self.decode_impl is DecodeImpl.CPP else "")
        )

    # ------------------------------------------------------------------ public API

    def start(self) -> "GenerationEngine":
        """Start the engine thread."""
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs."""
        return self._thread.is_alive()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine thread; in-flight requests fail with :class:`EngineClosedError`."""
        self._closing = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"engine thread did not stop within {timeout} s")
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        if self._packer is not None:
            # The model outlives the engine (a trainer's own generation): its packed copy
            # of the weights goes now, not at the next update.
            self._packer.reset()

    def check_request(self, req: GenerateRequest) -> int:
        """Validate a request against this model; returns its resolved ``max_new_tokens``."""
        plen = len(req.input_ids)
        bad = next((t for t in req.input_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"input_ids contains token id {bad}, outside the vocabulary of {self.vocab_size}"
            )
        if plen >= self.context_length:
            raise InvalidRequestError(
                f"the prompt has {plen} tokens; the context length is {self.context_length}, "
                "so at most {0} prompt tokens fit".format(self.context_length - 1)
            )
        self._check_images(req)
        mnt = req.sampling.max_new_tokens
        room = self.cache.n_tokens - plen  # a sequence reserves its whole length (kv_cache)
        if mnt is None:
            mnt = min(self.context_length - plen, room)
        if room < 1:
            raise InvalidRequestError(
                f"the prompt has {plen} tokens; the KV cache holds {self.cache.n_tokens} "
                "(kv_cache_tokens), so at most {0} prompt tokens fit".format(
                    self.cache.n_tokens - 1
                )
            )
        if plen + mnt > self.cache.n_tokens:
            raise InvalidRequestError(
                f"prompt ({plen} tokens) + max_new_tokens ({mnt}) exceeds the KV cache of "
                f"{self.cache.n_tokens} tokens (kv_cache_tokens); lower max_new_tokens to at "
                f"most {room} or raise kv_cache_tokens"
            )
        if plen + mnt > self.context_length:
            raise InvalidRequestError(
                f"prompt ({plen} tokens) + max_new_tokens ({mnt}) exceeds the context length "
                f"{self.context_length}; lower max_new_tokens to at most "
                f"{self.context_length - plen}"
            )
        return mnt

    def _check_images(self, req: GenerateRequest) -> None:
        if req.images is not None and self.vision is None:
            raise InvalidRequestError(
                "the request has images, but the model has no vision tower (a text-only model)"
            )
        if self.vision is None:
            return
        grid = None if req.images is None else req.images.slot_grids
        try:  # the placeholders must match the images before the request reaches a batch
            mrope_positions(
                torch.tensor(req.input_ids), torch.tensor([0, len(req.input_ids)]), grid,
                self.vision,
            )  # fmt: skip
        except ValueError as e:
            raise InvalidRequestError(f"images: {e}") from None

    def submit(self, req: GenerateRequest) -> "concurrent.futures.Future[GenerateOutput]":
        """Queue one request; the future resolves to its :class:`GenerateOutput`.

        Raises :class:`InvalidRequestError` at once for requests that can never run.
        """
        return self.submit_all([req])[0]

    def submit_all(
        self, reqs: Seq[GenerateRequest]
    ) -> List["concurrent.futures.Future[GenerateOutput]"]:
        """Queue requests together: they reach the scheduler in one piece, so the answers
        of a group are admitted in one step and share their prompt's cache pages.

        Raises :class:`InvalidRequestError` before queueing any when one can never run.
        """
        seqs = []
        for req in reqs:
            mnt = self.check_request(req)
            stops = frozenset(req.sampling.stop_token_ids)
            if not req.sampling.ignore_eos:
                stops = stops | self.default_stop_ids
            seqs.append(Sequence(req, mnt, stops))
        queued = []
        for seq in seqs:
            if seq.max_new_tokens == 0:
                seq.finish(FinishReason("length", length=0))
            else:
                queued.append(seq)
        if queued:
            if self._closing:
                raise EngineClosedError("the generation engine is closed")
            self._inbox.put(_Add(tuple(queued)))
            self._wake.set()
        return [seq.future for seq in seqs]

    def generate(
        self, reqs: Seq[GenerateRequest], timeout: Optional[float] = None
    ) -> List[GenerateOutput]:
        """Submit requests and wait for all outputs (in order)."""
        return self.collect(reqs, self.submit_all(reqs), timeout)

    def collect(
        self,
        reqs: Seq[GenerateRequest],
        futs: Seq["concurrent.futures.Future[GenerateOutput]"],
        timeout: Optional[float] = None,
    ) -> List[GenerateOutput]:
        """Wait for the outputs of ``reqs`` submitted as ``futs`` (in order)."""
        deadline = time.monotonic() + (timeout or self.config.request_timeout_s)
        outs = []
        for r, f in zip(reqs, futs):
            try:
                outs.append(f.result(timeout=max(0.0, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                raise TimeoutError(
                    f"generation of request {r.rid} did not finish in time"
                ) from None
        return outs

    def abort(self, rid: str, timeout: Optional[float] = None) -> bool:
        """Abort one request by id (reason ``abort``); returns whether it was found."""
        return self._command(_Abort(rid=rid), timeout)

    def pause(self, timeout: Optional[float] = None) -> List[GenerateOutput]:
        """Abort every running and queued request and hold new ones until :meth:`resume`.

        Returns the partial outputs (reason ``abort``) of the aborted requests.
        """
        return self._command(_Pause(), timeout)

    def resume(self, timeout: Optional[float] = None) -> None:
        """Serve again after :meth:`pause`."""
        return self._command(_Resume(), timeout)

    def update_weights_from_disk(self, path: str, timeout: Optional[float] = None) -> int:
        """Load HF weights from ``path`` in place, between two steps; returns the new version.

        Requests still running keep their cache (computed with the old weights);
        pause first for a clean switch, as the gserver manager does.
        """
        return self._command(_UpdateWeights(path=path), timeout)

    def update_weights_from_shm(
        self, path: str, version: int, timeout: Optional[float] = None
    ) -> int:
        """Load the flat weight file ``path`` (``weight_sync=shm``), which must hold trained
        version ``version``, in place between two steps; returns the engine's new version.

        The file is mapped (:func:`~realhf.impl.model.conversion.flat_file.map_flat`): a
        model of the file's dtype on the CPU then serves from the mapping itself, any other
        copies it into its buffer in one pass.  The model must be a single-device ReaLModel
        of the file's architecture.  Pause first, as for :meth:`update_weights_from_disk`.
        """
        return self._command(_UpdateWeights(path=path, flat_version=int(version)), timeout)

    def update_weights_from_broadcast(
        self, sender: str, version: int, timeout: Optional[float] = None
    ) -> int:
        """Pull trained version ``version`` from the trainer's weight sender at ``sender``
        (``host:port``; ``weight_sync=broadcast``,
        :mod:`realhf.impl.model.comm.weight_broadcast`) into the model's buffer in place,
        between two steps; returns the engine's new version.  Every wait of the transfer is
        bounded by ``timeout`` (default ``control_timeout_s``).

        If the transfer fails after some weights arrived, the engine holds neither version:
        it stays paused and refuses :meth:`resume` until an update succeeds.  Pause first,
        as for :meth:`update_weights_from_disk`."""
        t = timeout or self.config.control_timeout_s
        cmd = _UpdateWeights(path=sender, flat_version=int(version), broadcast=True, timeout_s=t)
        # The engine thread waits up to t per step of the transfer; give it the margin.
        return self._command(cmd, 2 * t + 10)

    def stats(self) -> dict:
        """Counters for ``/metrics`` (read without locking; values may lag one step)."""
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._recent) if now - t < 10.0]
        span = now - recent[0][0] if recent else 0.0
        return {
            "num_running_reqs": len(self.scheduler.running),
            "num_queue_reqs": len(self.scheduler.waiting) + self._inbox.qsize(),
            "num_used_tokens": self.scheduler.num_used_tokens,
            "max_total_num_tokens": self.cache.n_tokens,
            "gen_throughput": sum(n for _, n in recent) / span if span > 0 else 0.0,
            "prompt_tokens_total": self.total_prompt_tokens,
            "generation_tokens_total": self.total_generated_tokens,
            "num_requests_total": self.total_finished,
            "paused": self.paused,
            "weight_version": self.weight_version,
        }

    # ------------------------------------------------------------------ engine thread

    def _command(self, cmd: _Control, timeout: Optional[float]):
        if self._closing or not self._thread.is_alive():
            raise EngineClosedError(f"cannot {cmd.label}: the generation engine is not running")
        self._inbox.put(cmd)
        self._wake.set()
        t = timeout or self.config.control_timeout_s
        try:
            return cmd.future.result(timeout=t)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"the engine thread did not carry out {cmd.label!r} within {t} s"
            ) from None

    def run_until_idle(self, timeout: float) -> None:
        """Serve what was submitted on the calling thread, instead of :meth:`start`, until no
        request is queued or running; raises :class:`TimeoutError` after ``timeout`` s.

        For a caller that submits every request first and then waits (a trainer's own
        generation): its products run on the thread that has run the process's other torch
        work.  Two threads that each run OpenMP regions (the engine thread's and the
        trainer's) make more OpenMP threads than cores, and then GNU OpenMP's idle threads
        sleep between regions instead of spinning: each of the thousands of products in a
        decode step waits to wake one (0.5B in bf16 on 2 cores: 50 ms a step against 41 on
        the calling thread).  The weights are packed for decoding before the first step,
        since every step after the first is a decode.
        """
        if self._thread.is_alive():
            raise RuntimeError(
                "run_until_idle: the engine thread runs already (start() was called)"
            )
        deadline = time.monotonic() + timeout
        self._set_threads()
        with torch.inference_mode():
            if self._packer is not None:
                self._packer.pack(float("inf"))
            self._apply_commands()
            try:
                while not self.scheduler.idle:
                    if time.monotonic() > deadline:
                        left = len(self.scheduler.running) + len(self.scheduler.waiting)
                        raise TimeoutError(
                            f"generation did not finish within {timeout} s: {left} requests "
                            "were still queued or running"
                        )
                    self.step()
                    self._apply_commands()  # (what other threads submitted meanwhile)
            except BaseException as e:  # their futures fail too, as with the engine thread
                for s in self.scheduler.take_all():
                    s.fail(e)
                raise
        if self._occupancy is not None:
            self._occupancy.flush()

    def _set_threads(self) -> None:
        n = self.config.num_threads
        if n is not None:
            torch.set_num_threads(n)
            if self.decode_impl is DecodeImpl.NUMBA:
                import numba

                numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))

    def _loop(self) -> None:
        self._set_threads()
        with torch.inference_mode():
            while not self._closing:
                self._apply_commands()
                if self.paused or self.scheduler.idle:
                    if self._packer is not None and not self._packer.done and not self.paused:
                        self._packer.pack(_PACK_IDLE_S)  # idle: pack on, then look again
                        continue
                    # Every producer (submit, control calls, close) sets the event after
                    # queueing, so this wakes as soon as there is work; the timeout is a backstop.
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                try:
                    self.step()
                except Exception as e:  # a broken step fails its requests, not the server
                    self.last_error = traceback.format_exc()
                    logger.error(f"engine step failed:\n{self.last_error}")
                    for s in self.scheduler.take_all():
                        s.fail(e)
        self._apply_commands()
        if self._occupancy is not None:
            self._occupancy.flush()
        err = EngineClosedError("the generation engine was closed")
        for s in self.scheduler.take_all():
            s.fail(err)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if self._closing:
                cmd.fail(EngineClosedError("the generation engine was closed"))
                continue
            try:
                result = _COMMAND_HANDLERS[type(cmd)](self, cmd)
            except Exception as e:  # a failed command fails its caller, not the engine
                cmd.fail(e)
            else:
                cmd.done(result)

    def _add(self, cmd: _Add) -> None:
        self.scheduler.add_all(cmd.seqs)

    def _abort(self, cmd: _Abort) -> bool:
        seq = self.scheduler.find(cmd.rid)
        if seq is not None:
            self.scheduler.remove(seq)
            seq.finish(FinishReason("abort", message="aborted by request"))
        return seq is not None

    def _pause(self, cmd: _Pause) -> List[GenerateOutput]:
        self.paused = True
        return [
            s.finish(FinishReason("abort", message="generation paused"))
            for s in self.scheduler.take_all()
        ]

    def _resume(self, cmd: _Resume) -> None:
        if self.weights_incomplete:
            raise RuntimeError(
                f"not serving: {self.weights_incomplete}; the weights are neither the old "
                "version nor the new one until a weight update succeeds"
            )
        self.paused = False

    def _update_weights(self, cmd: _UpdateWeights) -> int:
        m = self.model
        if getattr(m, "lora", None) is not None and (
            cmd.broadcast or cmd.flat_version is not None or is_adapter_dir(cmd.path)
        ):
            # A LoRA run: the update is the adapters (the base, and its packs, stay).
            self._update_adapters(cmd)
            self.weight_version += 1
            return self.weight_version
        if self._packer is not None:  # packs of the old weights go first (their memory)
            self._packer.reset()
        if cmd.broadcast or cmd.flat_version is None:
            self._own_weights()  # these two write the weights in place
        if cmd.broadcast:
            self._receive_weights(cmd)
        elif cmd.flat_version is None:
            self._load_weights(self.model, cmd.path)
        else:
            m = self.model
            if getattr(m, "tp", LOCAL).distributed:
                raise ValueError("a flat weight file loads into a single-device model only")
            if m.flat_params.device.type == "cpu" and flat_dtype(cmd.path) == m.flat_params.dtype:
                # Serve from the file's pages: no copy, and the servers of the host share
                # them.  The manager retires the file only once every server in service
                # holds a newer version.  Outside inference mode: the mapping becomes the
                # parameters' data.
                with torch.inference_mode(False):
                    m.use_flat(
                        map_flat(cmd.path, m.param_spec, cmd.flat_version, m.flat_params.numel())
                    )
                self._serving_file = True
            else:  # another dtype or a device: one converting copy
                self._own_weights()
                with torch.inference_mode(False):
                    load_flat(m.flat_params, m.param_spec, cmd.path, cmd.flat_version)
        self.weight_version += 1
        return self.weight_version

    def _update_adapters(self, cmd: _UpdateWeights) -> None:
        lora = self.model.lora
        with torch.inference_mode(False):
            if cmd.broadcast:
                self._receive_weights(cmd, lora.flat, lora.param_spec)
            elif cmd.flat_version is not None:
                load_flat(lora.flat, lora.param_spec, cmd.path, cmd.flat_version)
            else:
                self.model.load_trained(cmd.path)

    def _own_weights(self) -> None:
        """Before a load that writes the weights in place: a model serving a flat file's
        read-only mapping (``shm``) takes a copy of its own first (once, on a change of
        ``weight_sync``, e.g. a recovery through ``disk``)."""
        if self._serving_file:
            with torch.inference_mode(False):
                self.model.use_flat(self.model.flat_params.clone())
            self._serving_file = False

    def _receive_weights(self, cmd: _UpdateWeights, flat=None, param_spec=None) -> None:
        """Pull into ``flat`` laid out by ``param_spec`` (default: the model's weights)."""
        m = self.model
        if getattr(m, "tp", LOCAL).distributed:
            raise ValueError("weights pulled from the trainer load into a single-device model only")
        if self._receiver is None:
            self._receiver = WeightReceiver(f"engine@{os.getpid()}")
        try:
            self._receiver.receive(
                cmd.path,
                cmd.flat_version,
                m.flat_params if flat is None else flat,
                m.param_spec if param_spec is None else param_spec,
                cmd.timeout_s,
            )
        except WeightSyncError as e:
            if e.partial:
                self.weights_incomplete = (
                    f"the update to weight version {cmd.flat_version} broke off ({e})"
                )
                logger.error(self.weights_incomplete)
            raise
        self.weights_incomplete = None

    def step(self) -> None:
        """One engine iteration: admit waiting requests into the cache, then one
        packed forward that decodes a token for every running sequence and
        prefills the admitted prompts, then sample and retire finished ones."""
        if self._packer is not None and not self._packer.done:
            self._packer.pack(_PACK_STEP_S)
        decode = list(self.scheduler.running)
        prefill = self.scheduler.admit()
        if prefill:
            self._prepare_uniforms(prefill)
            for s in prefill:
                self._page_table[s.slot, : len(s.pages)] = torch.tensor(s.pages)
        if decode or prefill:
            self._postprocess(decode + prefill, *self._forward(decode, prefill))

    # ------------------------------------------------------------------ stages

    def _prepare_uniforms(self, seqs: List[Sequence]) -> None:
        for s in seqs:
            sp = s.req.sampling
            if sp.greedy:
                continue
            g = self._generator
            if sp.sampling_seed is not None:
                g = torch.Generator().manual_seed(sp.sampling_seed)
            self._uniforms[s.slot, : s.max_new_tokens] = torch.rand(s.max_new_tokens, generator=g)

    def _forward(self, decode: List[Sequence], prefill: List[Sequence]):
        # Packed layout: the last token of each decoding sequence (one token
        # each), then the admitted prompts. One forward serves both, so new
        # arrivals cost no extra pass over the weights. Admitted requests with the
        # same prompt (the group of answers GRPO samples per prompt) share one
        # prefill: the prompt runs once; its full pages are written once and shared,
        # and each answer gets its own copy of the last, partial page.
        dev = self.device
        B = len(decode)
        ids = [s.output_ids[-1] for s in decode]
        positions = [s.length - 1 + s.rope_delta for s in decode]
        bounds = list(range(B + 1))
        pbounds = [0]
        # prompt (tokens, and its images: one object per prompt) -> index among unique ones
        first: Dict[Tuple[Tuple[int, ...], int], int] = {}
        owner: List[int] = []  # per admitted sequence: the unique prompt it reads
        mrope: Dict[int, Any] = {}  # unique prompt with images -> its MRopePositions
        images: List[VisionInputs] = []
        for s in prefill:
            u = first.setdefault(s.prompt_key, len(first))
            owner.append(u)
            if u == len(pbounds) - 1:  # a prompt not seen yet in this step
                n = s.prompt_len
                ids.extend(s.req.input_ids)
                positions.extend(range(n))
                bounds.append(bounds[-1] + n)
                pbounds.append(pbounds[-1] + n)
                if s.req.images is not None and s.req.images.n_images:
                    mrope[u] = mrope_positions(
                        torch.tensor(s.req.input_ids), torch.tensor([0, n]),
                        s.req.images.slot_grids, self.vision,
                    )  # fmt: skip
                    images.append(s.req.images)
            if u in mrope:
                s.rope_delta = mrope[u].deltas[0]
        pos_t = torch.tensor(positions, device=dev)
        model_pos = pos_t
        if mrope:  # multimodal positions [3, T]: text rows repeat theirs on the three axes
            model_pos = pos_t.expand(3, -1).clone()
            for u, mp in mrope.items():
                lo = B + pbounds[u]
                model_pos[:, lo : lo + mp.position_ids.shape[1]] = mp.position_ids.to(dev)
        cache = self.cache
        dattn = pattn = src_t = None
        if decode:
            dattn = DecodeAttention(
                self._page_table[torch.tensor([s.slot for s in decode])],
                # (tokens in the cache: the RoPE position differs after an image)
                [s.length for s in decode],
                page_size=cache.page_size,
                sliding_window=self.sliding_window,
                impl=self.decode_impl,
                device=dev,
            )
        if prefill:
            pattn = PrefillAttention(pbounds, sliding_window=self.sliding_window, device=dev)
            src, rows = [], []  # cache writes: packed row -> pool row
            for s, u in zip(prefill, owner):
                # (a group mate's positions below shared_tokens are on the first one's pages)
                src.extend(range(pbounds[u] + s.shared_tokens, pbounds[u + 1]))
                rows.extend(cache.rows(s.pages, s.shared_tokens, s.prompt_len))
            if len(first) < len(prefill):
                src_t = torch.tensor(src, device=dev)
            rows_t = torch.tensor(rows, device=dev)

        def attn_fn(layer, q, k, v):
            layer -= self._first_block
            outs = []
            if dattn is not None:
                outs.append(dattn(q[:B], k[:B], v[:B], cache.k[layer], cache.v[layer]))
            if pattn is not None:
                kp, vp = k[B:], v[B:]
                if src_t is None:
                    cache.write(layer, rows_t, kp, vp)
                else:
                    cache.write(layer, rows_t, kp[src_t], vp[src_t])
                outs.append(pattn(q[B:], kp, vp))
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        extra = {}
        if images:
            extra["images"] = VisionInputs.concat(images).to(dev)
        if prefill:  # each admitted sequence samples from its prompt's last position
            # (the head runs at these rows only: at a 152k vocabulary, over every prompt
            # position it was a quarter of a prefill's products)
            sample_rows = list(range(B)) + [bounds[B + 1 + u] - 1 for u in owner]
            extra["output_rows"] = torch.tensor(sample_rows, device=dev)
        logits = self._run_model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(bounds, dtype=torch.int32, device=dev),
            position_ids=model_pos,
            attn_fn=attn_fn,
            **extra,
        )
        self.total_prompt_tokens += pbounds[-1]
        # Vocabulary shards of a tensor-parallel model are joined for these rows only.
        logits = self._gather_logits(logits)
        if self._banned is not None:
            logits = logits.index_fill(-1, self._banned.to(logits.device), float("-inf"))
        return sample(logits, self._sampling_batch(decode + prefill))

    def _sampling_batch(self, seqs: List[Sequence]) -> SamplingBatch:
        # Every sequence of a step gets one token, so when a step runs the same sequences
        # as the last (most steps), each reads the next uniform of its row and the other
        # parameters are the last step's. (The cache holds the sequences, so an equal list
        # means the same objects, never a new sequence in a finished one's memory.)
        last = self._last_sampling
        if last is not None and last.seqs == seqs:
            flat, params, masks = last.flat + 1, last.params, last.masks
        else:
            W = self._uniforms.shape[1]
            flat = torch.tensor([s.slot * W + s.n_out for s in seqs])
            params = self._sampling_params(seqs)
            masks = any(s.min_new_tokens and s.stop_ids for s in seqs)
        self._last_sampling = _StepSampling(seqs, flat, params, masks)
        return dataclasses.replace(
            params,
            uniforms=self._uniforms.view(-1)[flat].to(self.device),
            stop_mask=self._stop_mask(seqs) if masks else None,
        )

    def _stop_mask(self, seqs: List[Sequence]) -> Optional[torch.Tensor]:
        """``[B, V]``: the stop tokens of rows still short of their ``min_new_tokens``."""
        masked = [i for i, s in enumerate(seqs) if s.n_out < s.min_new_tokens and s.stop_ids]
        if not masked:
            return None
        stop_mask = torch.zeros(len(seqs), self.vocab_size, dtype=torch.bool)
        for i in masked:
            ids = [t for t in seqs[i].stop_ids if t < self.vocab_size]
            stop_mask[i, ids] = True
        return stop_mask.to(self.device)

    def _sampling_params(self, seqs: List[Sequence]) -> SamplingBatch:
        """The rows' parameters, without their uniforms and stop masks."""
        dev = self.device
        sps = [s.req.sampling for s in seqs]
        greedy = [sp.greedy for sp in sps]
        return SamplingBatch(
            temperature=torch.tensor([sp.temperature for sp in sps], device=dev),
            greedy=torch.tensor(greedy, device=dev),
            top_p=torch.tensor([sp.top_p for sp in sps], device=dev),
            top_k=torch.tensor([sp.top_k for sp in sps], device=dev),
            uniforms=torch.empty(0),
            all_greedy=all(greedy),
            any_truncation=any(
                not g and (sp.top_k > 0 or sp.top_p < 1.0) for g, sp in zip(greedy, sps)
            ),
            any_greedy=any(greedy),
            unit_temperature=all(g or sp.temperature == 1.0 for g, sp in zip(greedy, sps)),
        )

    def _postprocess(
        self, seqs: List[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor
    ) -> None:
        toks = tokens.tolist()
        lps = logprobs.tolist()
        done: List[Tuple[Sequence, FinishReason]] = []
        for s, t, lp in zip(seqs, toks, lps):
            s.output_ids.append(t)
            s.output_logprobs.append(lp)
            if t in s.stop_ids and s.n_out >= s.min_new_tokens:
                done.append((s, FinishReason("stop", matched=t)))
            elif s.n_out >= s.max_new_tokens:
                done.append((s, FinishReason("length", length=s.n_out)))
        # Free the pages before resolving futures, so that a caller woken by its
        # result already sees the capacity back.
        self.scheduler.release([s for s, _ in done])
        for s, reason in done:
            s.finish(reason)
        self.total_generated_tokens += len(toks)
        self.total_finished += len(done)
        self._recent.append((time.monotonic(), len(toks)))
        if self._occupancy is not None:
            self._occupancy.record(len(toks))


#: What the engine thread runs for each command (called with the engine and the command).
_COMMAND_HANDLERS: Dict[Type[_Command], Callable[[GenerationEngine, Any], Any]] = {
    _Add: GenerationEngine._add,
    _Abort: GenerationEngine._abort,
    _Pause: GenerationEngine._pause,
    _Resume: GenerationEngine._resume,
    _UpdateWeights: GenerationEngine._update_weights,
}
