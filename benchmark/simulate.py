"""Throughput model of sync vs async RL training: a discrete-event simulation fed by profiled costs.

    python benchmark/simulate.py --profile OUT.json [--threads 1]      # measure costs here
    python benchmark/simulate.py --validate RUNS.json --profiles p1.json p2.json
    python benchmark/simulate.py --project                            # cluster-scale table

Each mode ends with one JSON line of its figures.  Samples/s counts trained *prompts* (each
with G answers), as ``benchmark/async_vs_sync.py`` does.

The model
---------
*Generation* is an engine with ``max_running`` slots (``realhf/impl/model/gen/engine.py``): each
engine step admits waiting sequences into free slots (FCFS, at most ``max_prefill_tokens``
prompt tokens a step; the answers of one group admitted together share one prefill), then
advances every running sequence by one token; a sequence leaves its slot at once when done.
A step costs ``a + c·b + d·Σctx + [prefill](p0 + p·tokens)`` (``GenCost``), with ``b``
running sequences and ``Σctx`` their summed lengths.  ``n`` engines (data-parallel ranks,
generation servers) are one pool whose step lasts as long as the busiest engine's, with
sequences spread evenly: ``ceil(b/n)`` each.  Between events (a completion, an admission, a
weight update) the steps are summed in closed form, so the simulation costs O(events),
not O(tokens).

*Sync* (``ppo-math``): per step, every B·G answer is submitted to a fresh engine (``call_s``),
the step's generation lasts until the longest answer is done (the batch runs nearly empty
at the end: the long tail), then rewards, then one train step over all B·G sequences
(``TrainCost``: ``s0 + t1·tokens + t2·Σlen²``).  Generation and training take turns on the
same devices.

*Async* (``async-ppo-math``): servers decode all the time; a rollout (one prompt, G answers)
is admitted by the very :class:`StalenessController` of ``realhf/system/rollout/staleness.py``
(rule 1: ``R < max_concurrent_rollouts`` and ``(A + R) // B ≤ v + η``, ``v`` the servers'
version; rule 2 holds a finished rollout back until earlier deadlines are served).  The
trainer (own devices) trains batch ``s`` once indices ``[sB, (s+1)B)`` arrived, then
publishes (``publish_s``).  The servers pick up the newest version at their next step
boundary: pause (every running answer is aborted), load (``load_s``), continue; each aborted
answer is resubmitted with its tokens so far, i.e. re-prefilled (as the partial-rollout
manager does), then goes on with the new weights.

Not modelled: processes sharing CPU cores (on the 2-core VM the async trainer, server,
rollout worker and manager contend), HTTP and polling latencies, chunk boundaries
(``new_tokens_per_chunk``), EOS-dependent lengths changing as training goes on (lengths are
drawn i.i.d.), memory limits (``max_running`` is an input).

Projection: the published settings (``SOURCES``, ``SCENARIOS``: AReaL v0.3's sync vs async
hours, 2.77x for 1.5B and 2.27x for 7B) with roofline costs on H800s from stated assumptions
(``H800``, ``MODELS``, ``ASSUMED``); the predicted async/sync ratio is printed beside the
published one.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import datetime
import heapq
import itertools
import json
import math
import os
import random
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from realhf.system.rollout.staleness import StalenessController  # noqa: E402

TINY = os.path.join(ROOT, "realhf", "assets", "tiny")


# ---- costs and setups -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GenCost:
    """Seconds of one engine step with ``b`` running sequences of summed length ``Σctx``:
    decode ``step_s + seq_s·b + ctx_token_s·Σctx`` — or, when ``table`` holds measured rows
    ``(b, fixed_s, per_ctx_token_s)``, those interpolated in ``b`` — plus, when the step
    prefills, ``prefill_call_s + prefill_token_s·tokens``.  ``call_s``: per sync generate
    call (the engine is built for it)."""

    step_s: float
    seq_s: float = 0.0
    ctx_token_s: float = 0.0
    prefill_call_s: float = 0.0
    prefill_token_s: float = 0.0
    call_s: float = 0.0
    table: Tuple[Tuple[float, float, float], ...] = ()

    def scaled(self, f: float) -> "GenCost":
        """Every cost ``f`` times as long (CPU contention)."""
        if f == 1.0:
            return self
        return GenCost(
            *(f * getattr(self, n) for n in ("step_s", "seq_s", "ctx_token_s", "prefill_call_s",
                                              "prefill_token_s", "call_s")),
            table=tuple((b, f * x, f * y) for b, x, y in self.table),
        )  # fmt: skip

    def step(self, b: float, sum_ctx: float, prefill_tokens: float = 0.0) -> float:
        if len(self.table) >= 2:  # piecewise linear in b, extrapolated at the ends
            i = min(max(bisect.bisect_left([r[0] for r in self.table], b), 1), len(self.table) - 1)
            (b0, f0, g0), (b1, f1, g1) = self.table[i - 1], self.table[i]
            w = (b - b0) / (b1 - b0)
            t = max(0.0, f0 + w * (f1 - f0)) + max(0.0, g0 + w * (g1 - g0)) * sum_ctx
        else:
            t = self.step_s + self.seq_s * b + self.ctx_token_s * sum_ctx
        if prefill_tokens > 0:
            t += self.prefill_call_s + self.prefill_token_s * prefill_tokens
        return t


@dataclasses.dataclass(frozen=True)
class TrainCost:
    """Seconds of one train step over sequences of lengths ``lens`` (prompt + answer):
    ``step_s + token_s·Σlen + token_sq_s·Σlen²`` (the last term: attention)."""

    step_s: float
    token_s: float
    token_sq_s: float = 0.0

    def scaled(self, f: float) -> "TrainCost":
        return TrainCost(f * self.step_s, f * self.token_s, f * self.token_sq_s)

    def step(self, lens: Sequence[int]) -> float:
        return self.step_s + self.token_s * sum(lens) + self.token_sq_s * sum(n * n for n in lens)


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Answer lengths: drawn from ``values`` (an empirical list) or lognormal with ``median``
    and ``sigma``; capped at ``cap`` (max_new_tokens), at least 1."""

    values: Tuple[int, ...] = ()
    median: float = 0.0
    sigma: float = 0.0
    cap: int = 1 << 30

    def __post_init__(self):
        if not self.values and self.median <= 0:
            raise ValueError("Lengths: give values (a list of lengths) or a median > 0")

    def sample(self, rng: random.Random) -> int:
        if self.values:
            return max(1, min(self.cap, rng.choice(self.values)))
        return max(1, min(self.cap, round(self.median * math.exp(rng.gauss(0, self.sigma)))))


@dataclasses.dataclass(frozen=True)
class Workload:
    """``batch`` prompts (B) of ``prompt_len`` tokens per train step, ``group`` (G) answers each."""

    batch: int
    group: int
    lengths: Lengths
    prompt_len: int = 8


@dataclasses.dataclass(frozen=True)
class Setup:
    """How a run is laid out.  ``n_gen``: engines (sync: data-parallel ranks; async:
    generation servers), ``max_running`` / ``max_prefill_tokens`` each; async only: ``eta``,
    ``max_concurrent_rollouts`` (None = B), ``publish_s`` (trainer), ``load_s`` (servers);
    ``step_overhead_s``: per train step (rewards, master).  Async latencies:
    ``version_poll_s``: the servers see a published version at the manager's next poll
    (ticks every ``version_poll_s``); ``admit_retry_s``: a rollout worker whose admission
    was refused tries again after this long, so an idle pool waits half of it (the
    expected phase) after a version switch before new rollouts arrive."""

    n_gen: int = 1
    max_running: int = 256
    max_prefill_tokens: int = 4096
    eta: int = 1
    max_concurrent_rollouts: Optional[int] = None
    publish_s: float = 0.0
    load_s: float = 0.0
    step_overhead_s: float = 0.0
    version_poll_s: float = 0.0
    admit_retry_s: float = 0.0
    n_steps: int = 20
    seed: int = 0

    def __post_init__(self):
        for name, lo in (("n_gen", 1), ("max_running", 1), ("max_prefill_tokens", 1),
                         ("n_steps", 1), ("eta", 0), ("publish_s", 0), ("load_s", 0),
                         ("step_overhead_s", 0), ("version_poll_s", 0),
                         ("admit_retry_s", 0)):  # fmt: skip
            if not getattr(self, name) >= lo:
                raise ValueError(f"Setup.{name}={getattr(self, name)!r}: use a value >= {lo}")


@dataclasses.dataclass
class SimResult:
    """What one simulation returns.  ``occupancy``: (time, running sequences over all
    engines) at each event; ``staleness``: trained version − admission version, per trained
    rollout (async only)."""

    samples_per_s: float  # trained prompts / time to the end of the last train step
    steady_samples_per_s: float  # the same over the steps after the first quarter
    step_s: List[float]
    occupancy: List[Tuple[float, int]]
    trainer_idle_share: float
    mean_answer_len: float
    staleness: List[int] = dataclasses.field(default_factory=list)
    interrupted: int = 0  # answers aborted by weight updates and re-prefilled
    slowdown: float = 1.0  # CPU contention applied to every cost (predict_run)

    @property
    def after_first_samples_per_s(self) -> float:
        """Trained prompts / time over the steps after the first (as measured runs report
        it with their warm-up step left out)."""
        ends = list(itertools.accumulate(self.step_s))
        if len(ends) < 2:
            return self.samples_per_s
        return self.samples_per_s * ends[-1] / len(ends) * (len(ends) - 1) / (ends[-1] - ends[0])

    @property
    def gen_busy_share(self) -> float:
        """Share of the run's time with at least one sequence running."""
        occ, end = self.occupancy, self.step_s and sum(self.step_s)
        if not occ or not end:
            return 0.0
        busy = sum(t1 - t0 for (t0, b), (t1, _) in zip(occ, occ[1:] + [(end, 0)]) if b > 0)
        return min(1.0, busy / end)

    def summary(self) -> dict:
        return {
            "samples_per_s": round(self.samples_per_s, 4),
            "after_first_samples_per_s": round(self.after_first_samples_per_s, 4),
            "steady_samples_per_s": round(self.steady_samples_per_s, 4),
            "step_s_median": round(sorted(self.step_s)[len(self.step_s) // 2], 4),
            "trainer_idle_share": round(self.trainer_idle_share, 3),
            "mean_answer_len": round(self.mean_answer_len, 1),
            "max_running": max((b for _, b in self.occupancy), default=0),
            "staleness_max": max(self.staleness, default=0),
            "interrupted": self.interrupted,
            "gen_busy_share": round(self.gen_busy_share, 3),
            "slowdown": round(self.slowdown, 3),
        }


def _result(B, ends, busy, answers, occupancy, staleness=(), interrupted=0) -> SimResult:
    n, total, w = len(ends), ends[-1], len(ends) // 4
    steady = (n - w) * B / (total - ends[w - 1]) if w else n * B / total
    steps = [e - s for s, e in zip([0.0] + ends[:-1], ends)]
    idle, mean_len = 1 - busy / total, sum(answers) / len(answers)
    return SimResult(
        n * B / total, steady, steps, occupancy, idle, mean_len, list(staleness), interrupted
    )


# ---- the generation pool ----------------------------------------------------------------


@dataclasses.dataclass
class _Seq:
    group: int
    prefill: int  # tokens prefilled at admission (prompt, or prompt + generated after abort)
    remaining: int  # tokens still to generate
    shared: bool = True  # False after an abort: its prefill is its own
    start: int = 0  # engine step count when admitted


class _Pool:
    """``n_gen`` engines of ``max_running`` slots, stepped together (see the module docstring)."""

    def __init__(self, cost: GenCost, setup: Setup):
        self.cost, self.n = cost, setup.n_gen
        self.slots, self.budget = self.n * setup.max_running, self.n * setup.max_prefill_tokens
        self.t, self.k = 0.0, 0  # clock, engine steps done
        self.running: List[Tuple[int, int, _Seq]] = []  # heap of (finish step, id, seq)
        self.waiting: collections.deque = collections.deque()
        self.sum_ctx = 0
        self.occupancy: List[Tuple[float, int]] = []
        self._ids = 0

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def _per_engine(self, b: int, sum_ctx: float, prefill: float) -> float:
        # The busiest engine holds ceil(b/n) sequences and sets the pace of the step.
        if b == 0:
            return self.cost.step(0, 0, prefill / self.n)
        share = math.ceil(b / self.n) / b
        return self.cost.step(b * share, sum_ctx * share, prefill / self.n)

    def _segment_s(self, m: int) -> float:
        """Seconds of ``m`` decode steps without admissions (Σctx grows by b per step)."""
        b = len(self.running)
        first = self._per_engine(b, self.sum_ctx, 0)
        growth = self._per_engine(b, self.sum_ctx + b, 0) - first  # linear in Σctx
        return m * first + growth * m * (m - 1) / 2

    def _admission_step(self) -> None:
        admitted, budget, tokens, seen = [], self.budget, 0, set()
        while self.waiting and len(self.running) + len(admitted) < self.slots:
            s = self.waiting[0]
            if admitted and s.prefill > budget:
                break  # strict FCFS, as the engine's scheduler
            self.waiting.popleft()
            budget -= s.prefill
            if not s.shared or s.group not in seen:
                tokens += s.prefill
            if s.shared:
                seen.add(s.group)
            admitted.append(s)
        b = len(self.running) + len(admitted)
        self.occupancy.append((self.t, b))
        self.sum_ctx += sum(s.prefill for s in admitted)
        self.t += self._per_engine(b, self.sum_ctx, tokens)
        for s in admitted:  # the admission step samples each one's first token
            s.start = self.k
            heapq.heappush(self.running, (self.k + s.remaining, self._ids, s))
            self._ids += 1
        self.k += 1
        self.sum_ctx += b

    def advance(self, stop_t: float = math.inf) -> List[_Seq]:
        """One event: an admission step, or decode steps up to the next completion or up
        to the first step boundary at or after ``stop_t``.  Returns the finished ones."""
        if self.waiting and len(self.running) < self.slots:
            self._admission_step()
        else:
            m = self.running[0][0] - self.k
            if self.t + self._segment_s(m) > stop_t:
                lo, hi = 1, m  # smallest step count whose end reaches stop_t
                while lo < hi:
                    mid = (lo + hi) // 2
                    lo, hi = (mid + 1, hi) if self.t + self._segment_s(mid) < stop_t else (lo, mid)
                m = lo
            self.occupancy.append((self.t, len(self.running)))
            self.t += self._segment_s(m)
            self.k += m
            self.sum_ctx += m * len(self.running)
        done = []
        while self.running and self.running[0][0] <= self.k:
            s = heapq.heappop(self.running)[2]
            self.sum_ctx -= s.prefill + (self.k - s.start)
            done.append(s)
        return done

    def interrupt(self, load_s: float) -> int:
        """Pause (abort everything), load new weights, continue: aborted answers come back
        with their tokens so far as prompt.  Returns how many were running."""
        resumed = []
        for finish, _, s in sorted(self.running):
            generated = self.k - s.start
            resumed.append(_Seq(s.group, s.prefill + generated, finish - self.k, shared=False))
        self.waiting.extendleft(reversed(resumed))
        self.running, self.sum_ctx = [], 0
        self.occupancy.append((self.t, 0))
        self.t += load_s
        return len(resumed)

    def wait_until(self, t: float) -> None:
        if t > self.t:
            self.occupancy.append((self.t, len(self.running)))
            self.t = t


# ---- sync and async ---------------------------------------------------------------------


def simulate_sync(gen: GenCost, train: TrainCost, work: Workload, setup: Setup) -> SimResult:
    """``ppo-math``: generate all B·G answers (to the longest), then train, on the same devices."""
    rng = random.Random(setup.seed)
    pool = _Pool(gen, setup)
    ends, busy, answers = [], 0.0, []
    for _ in range(setup.n_steps):
        pool.wait_until(pool.t + gen.call_s)
        lens = [work.lengths.sample(rng) for _ in range(work.batch * work.group)]
        pool.waiting.extend(_Seq(i // work.group, work.prompt_len, n) for i, n in enumerate(lens))
        while not pool.idle:
            pool.advance()
        dt = train.step([work.prompt_len + n for n in lens]) + setup.step_overhead_s
        busy += dt
        pool.wait_until(pool.t + dt)
        ends.append(pool.t)
        answers += lens
    return _result(work.batch, ends, busy, answers, pool.occupancy)


# Long on purpose: one loop in the system's event order (weight update, decode, hand-off,
# train, admit); split up, its shared state would travel through many arguments.
def simulate_async(gen: GenCost, train: TrainCost, work: Workload, setup: Setup) -> SimResult:
    """``async-ppo-math``: servers and trainer on separate devices under the staleness bound."""
    rng = random.Random(setup.seed)
    B, G, n_steps = work.batch, work.group, setup.n_steps
    ctl = StalenessController(B, setup.eta, setup.max_concurrent_rollouts or B)
    pool = _Pool(gen, setup)
    version = 0  # what every server runs
    publishes: collections.deque = collections.deque()  # (time, version) from the trainer
    groups: Dict[int, list] = {}  # group -> [admission, answers left, lengths]
    finished: List[int] = []  # groups done, waiting for an index (rule 2 may hold them)
    arrivals: List[Tuple[float, list]] = []  # by index: (time, group record)
    ends, staleness, answers = [], [], []
    trainer_free, busy, interrupted = 0.0, 0.0, 0

    def admit() -> None:
        while (adm := ctl.admit(version, owner=0)) is not None:
            gid = len(groups)
            lens = [work.lengths.sample(rng) for _ in range(G)]
            groups[gid] = [adm, G, lens]
            pool.waiting.extend(_Seq(gid, work.prompt_len, n) for n in lens)

    def hand_off() -> None:
        progress = True
        while progress:  # an acceptance may release a held rollout
            progress = False
            for gid in list(finished):
                if ctl.accept(groups[gid][0].rollout_id) is not None:
                    finished.remove(gid)
                    arrivals.append((pool.t, groups[gid]))
                    progress = True

    def train_ready() -> None:  # the trainer takes indices [sB, (s+1)B) for step s
        nonlocal trainer_free, busy
        while len(ends) < n_steps and len(arrivals) >= (len(ends) + 1) * B:
            s = len(ends)
            batch = arrivals[s * B : (s + 1) * B]
            start = max(trainer_free, max(t for t, _ in batch))
            lens = [work.prompt_len + n for _, g in batch for n in g[2]]
            dt = train.step(lens) + setup.publish_s + setup.step_overhead_s
            trainer_free, busy = start + dt, busy + dt
            ends.append(trainer_free)
            staleness.extend(s - g[0].version for _, g in batch)
            answers.extend(n for _, g in batch for n in g[2])
            seen = trainer_free  # the manager's next poll after the publish
            if setup.version_poll_s > 0:
                seen = math.ceil(trainer_free / setup.version_poll_s) * setup.version_poll_s
            publishes.append((seen, s + 1))

    admit()
    while len(ends) < n_steps:
        if publishes and publishes[0][0] <= pool.t:
            while publishes and publishes[0][0] <= pool.t:  # the manager loads the newest
                version = publishes.popleft()[1]
            interrupted += pool.interrupt(setup.load_s)
            if pool.idle and setup.admit_retry_s > 0:  # refused workers retry on a timer
                pool.wait_until(pool.t + setup.admit_retry_s / 2)
        elif pool.idle:
            if not publishes:
                raise RuntimeError(
                    f"simulate_async stalled at t={pool.t:.3f}s: nothing runs and no new "
                    f"version is coming (steps {len(ends)}, running {ctl.running}, "
                    f"accepted {ctl.accepted_total}); check B, eta and max_concurrent_rollouts"
                )
            pool.wait_until(publishes[0][0])
        else:
            for s in pool.advance(publishes[0][0] if publishes else math.inf):
                groups[s.group][1] -= 1
                if groups[s.group][1] == 0:
                    finished.append(s.group)
            hand_off()
            train_ready()
        admit()
    return _result(B, ends, busy, answers, pool.occupancy, staleness, interrupted)


# ---- --profile: measure the costs on this machine ---------------------------------------


@dataclasses.dataclass(frozen=True)
class Profile:
    """Costs measured at one thread count (``--profile`` writes it as JSON)."""

    threads: int
    gen: GenCost
    train: TrainCost
    publish_s: float  # the trainer writes an HF directory of the new weights
    load_s: float  # a server pauses, loads it, continues
    reward_s_per_answer: float = 0.0

    @classmethod
    def from_json(cls, d: dict) -> "Profile":
        gen = GenCost(**{**d["gen"], "table": tuple(map(tuple, d["gen"].get("table", ())))})
        return cls(int(d["threads"]), gen, TrainCost(**d["train"]), float(d["publish_s"]),
                   float(d["load_s"]), float(d.get("reward_s_per_answer", 0.0)))  # fmt: skip


def _fit(rows: List[List[float]], ys: List[float]) -> Tuple[List[float], float]:
    """Non-negative least squares on relative errors: coefficients, worst relative error."""
    import numpy as np
    from scipy.optimize import nnls

    a, y = np.asarray(rows, float), np.asarray(ys, float)
    coef, _ = nnls(a / y[:, None], np.ones(len(y)))
    return coef.tolist(), float(np.max(np.abs(a @ coef / y - 1)))


def _timed(fn, reps: int) -> float:
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# Long on purpose: the measurements share one engine and one trainer, in this order; a
# helper each would only pass that state around.
def measure_profile(threads: int, model_dir: str = TINY, quick: bool = False) -> dict:
    """Time our engine and train step in this process; returns the profile as a dict.

    Engine: this thread runs the engine's loop (``step()``) on b requests of a short and of a
    long random prompt (EOS ignored): the first step prefills them all, the median of the
    next ones is a decode step at b sequences (a table row per b, and a global linear fit);
    the prefill steps give the prefill cost.  Sync call: building and closing an engine.
    Train: ``PPOActorInterface.train_step`` with the tiny GRPO settings of ``ppo-math`` on
    packed batches.  Weights: ``ReaLModel.save_hf`` (the trainer publishes) and pause →
    ``update_weights_from_disk`` → resume (a server).  Reward: ``verify_batch`` per answer.
    """
    import statistics
    import tempfile

    import numba
    import torch
    import transformers

    from realhf.api.cli_args import OptimizerConfig
    from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
    from realhf.api.core.gen_api import GenerateRequest, SamplingParams
    from realhf.api.core.model_api import FinetuneSpec, Model
    from realhf.experiments.ppo_math import _tiny_ppo
    from realhf.impl.model import ReaLModel
    from realhf.impl.model.backend import TrainEngine
    from realhf.impl.model.gen import EngineConfig
    from realhf.impl.model.gen.engine import GenerationEngine
    from realhf.impl.model.gen.loading import load_engine
    from realhf.impl.model.interface import PPOActorInterface
    from realhf.impl.reward.math_reward import verify_batch

    torch.set_num_threads(threads)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    reps, n_steps = (1, 12) if quick else (2, 24)
    cfg = EngineConfig(max_running_requests=256, max_prefill_tokens=1 << 16, device="cpu")
    engine = load_engine(model_dir, dataclasses.replace(cfg, num_threads=threads))
    vocab, ctx_max, rng = engine.vocab_size, engine.context_length, random.Random(0)

    @torch.inference_mode()
    def run(b: int, plen: int) -> Tuple[float, List[float]]:
        """Seconds of the prefill step of b requests, then of each decode step."""
        sp = SamplingParams(max_new_tokens=n_steps + 1, ignore_eos=True)
        for _ in range(b):
            ids = tuple(rng.randrange(2, vocab) for _ in range(plen))
            engine.submit(GenerateRequest(input_ids=ids, sampling=sp))
        engine._apply_commands()  # the engine thread is not started: this thread is its loop
        times = []
        while not engine.scheduler.idle:
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        return times[0], times[1:]

    raw: Dict[str, list] = {"decode": [], "prefill": [], "train": []}
    table = []
    try:
        run(8, 8)  # warm-up (numba kernels, allocator)
        for b in (1, 8, 32, 64, 128, 256):
            pts = []
            for plen in (8, min(120, ctx_max - n_steps - 2)):
                prefill, decode = run(b, plen)
                ctx = plen + 1 + n_steps / 2  # mean length read by the timed steps
                pts.append((b * ctx, statistics.median(decode)))
                raw["decode"].append([b, ctx, pts[-1][1]])
                raw["prefill"].append([b, plen, prefill])
            (s_short, y_short), (s_long, y_long) = pts
            per_ctx = max(0.0, (y_long - y_short) / (s_long - s_short))
            table.append((b, max(1e-6, y_short - per_ctx * s_short), per_ctx))
        dec = raw["decode"]
        (a, c, d), dec_err = _fit([[1, b, b * x] for b, x, _ in dec], [y for *_, y in dec])
        gen = GenCost(a, c, d, table=tuple(table))
        pre = [[n, x, max(1e-6, y - gen.step(n, n * x))] for n, x, y in raw["prefill"]]
        (p0, p), pre_err = _fit([[1, n * x] for n, x, _ in pre], [y for *_, y in pre])
        # A sync generate call builds (and closes) an engine over the live model.
        small = dataclasses.replace(cfg, context_length=64, max_prefill_tokens=4096)
        call_s = _timed(lambda: GenerationEngine(engine.model, small).start().close(), 3)
        gen = dataclasses.replace(gen, prefill_call_s=p0, prefill_token_s=p, call_s=call_s)
        engine.start()

        tok = transformers.AutoTokenizer.from_pretrained(model_dir)
        net = ReaLModel.from_hf(model_dir)
        opt = OptimizerConfig(lr=2e-4, weight_decay=0.0)
        actor_m = Model("actor", TrainEngine(net, opt, FinetuneSpec(1, 4096, 32)), tok, "cpu")
        actor, mb = PPOActorInterface(_tiny_ppo()), MicroBatchSpec()
        g = torch.Generator().manual_seed(0)

        def batch(prompts: int, group: int, plen: int, alen: int) -> SequenceSample:
            n, L = prompts * group, plen + alen
            return SequenceSample.from_default(
                ids=[f"q{i}" for i in range(prompts)],
                seqlens=[[L] * group for _ in range(prompts)],
                data={
                    "packed_input_ids": torch.randint(2, vocab, (n * L,), generator=g),
                    "prompt_mask": torch.tensor(([True] * plen + [False] * alen) * n),
                    "packed_logprobs": -torch.rand(n * (L - 1), generator=g),
                    "rewards": torch.tensor([5.0, -5.0] * (n // 2) + [5.0] * (n % 2)),
                    "seq_no_eos_mask": torch.zeros(n, dtype=torch.bool),
                },
            )

        actor.train_step(actor_m, batch(4, 8, 8, 8), mb)  # warm-up
        shapes = [(32, 8, 8, 6), (32, 8, 8, 24), (8, 8, 8, 120), (4, 8, 8, min(240, ctx_max - 8))]
        for shape in shapes[:3] if quick else shapes:
            data = batch(*shape)
            dt = _timed(lambda: actor.train_step(actor_m, data, mb), reps)
            raw["train"].append([shape[0] * shape[1], shape[2] + shape[3], dt])
        tr = raw["train"]
        train, tr_err = _fit([[1, n * L, n * L * L] for n, L, _ in tr], [y for *_, y in tr])

        with tempfile.TemporaryDirectory() as wdir:
            publish_s = _timed(lambda: net.save_hf(wdir), 2)

            def swap():
                engine.pause()
                engine.update_weights_from_disk(wdir)
                engine.resume()

            load_s = _timed(swap, 2)
        answers = [f"\\boxed{{{i}}}" for i in range(256)]
        reward_s = _timed(lambda: verify_batch(answers, [["\\boxed{7}"]] * 256), 2) / 256
    finally:
        engine.close()
    return {
        "benchmark": "simulate_profile",
        "date": datetime.date.today().isoformat(),
        "threads": threads,
        "model": os.path.relpath(model_dir, ROOT),
        "cpu_count": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 2),
        "gen": dataclasses.asdict(gen),
        "train": dataclasses.asdict(TrainCost(*train)),
        "publish_s": publish_s,
        "load_s": load_s,
        "reward_s_per_answer": reward_s,
        "fit_max_rel_err": {"decode_linear": dec_err, "prefill": pre_err, "train": tr_err},
        "raw": raw,
    }


# ---- --validate: predicted vs measured runs ---------------------------------------------


def predict_run(
    row: dict,
    profiles: Dict[int, Profile],
    lengths: Sequence[int],
    in_run: Optional[dict] = None,
) -> SimResult:
    """Simulate one measured run.  ``row``: ``mode`` (sync/async), ``batch``, ``group_size``,
    ``steps``, ``threads`` (sync) or ``gen_threads`` / ``train_threads`` (async), ``eta``;
    optional ``prompt_len`` (8), ``max_new_tokens``, ``n_gen`` (1), ``max_running`` (256),
    ``max_concurrent_rollouts``, ``step_overhead_s`` (master, 0), the async latencies
    ``weight_poll_interval_s`` and ``allocate_retry_interval_s`` (0), ``cpu_count`` and
    ``overhead_cpu_s_per_answer`` (CPU contention, see :func:`_contended`).  ``lengths``:
    the run's answer lengths, drawn with replacement.

    ``in_run``: costs measured inside runs (``decode_table`` rows ``[b, seconds]`` and
    ``train_s_per_token``, see benchmark/async_vs_sync.py) that replace the profile's decode
    and train costs, and for sync ``step_other_s`` (rewards and the master, in place of the
    profile's reward cost); they already carry the run's CPU contention, so none is added.
    With ``in_run``, a row's ``seq_len_mean`` (trained prompt + answer tokens, mean over the
    run) rescales ``lengths`` to the run's mean answer length."""

    def at(threads: int) -> Profile:
        if threads not in profiles:
            raise KeyError(
                f"no profile measured at {threads} thread(s) (have {sorted(profiles)}); run "
                f"python benchmark/simulate.py --profile p{threads}.json --threads {threads}"
            )
        return profiles[threads]

    def costs(gen_p: Profile, train_p: Profile) -> Tuple[GenCost, TrainCost]:
        if in_run is None:
            return gen_p.gen, train_p.train
        table = _flat_table(in_run["decode_table"])
        gen = dataclasses.replace(gen_p.gen, step_s=0.0, seq_s=0.0, ctx_token_s=0.0, table=table)
        return gen, TrainCost(0.0, float(in_run["train_s_per_token"]))

    B, G, mode = int(row["batch"]), int(row["group_size"]), row["mode"]
    cap, prompt_len = int(row.get("max_new_tokens", 1 << 30)), int(row.get("prompt_len", 8))
    if in_run is not None and row.get("seq_len_mean"):
        # The policy's answers grow or shrink as it trains: scale the start model's lengths
        # to the run's mean trained length (its workload, not a cost).
        f = (float(row["seq_len_mean"]) - prompt_len) / (sum(lengths) / len(lengths))
        lengths = [max(1, round(n * f)) for n in lengths]
    lens = Lengths(tuple(int(n) for n in lengths), cap=cap)
    work = Workload(B, G, lens, prompt_len)
    setup = Setup(
        n_gen=int(row.get("n_gen", 1)),
        max_running=int(row.get("max_running", 256)),
        eta=int(row.get("eta", 0)),
        max_concurrent_rollouts=row.get("max_concurrent_rollouts"),
        step_overhead_s=float(row.get("step_overhead_s", 0.0)),
        version_poll_s=float(row.get("weight_poll_interval_s", 0.0)),
        admit_retry_s=float(row.get("allocate_retry_interval_s", 0.0)),
        n_steps=int(row["steps"]),
    )
    if mode not in ("sync", "async"):
        raise ValueError(f"run row mode={mode!r}: use 'sync' or 'async'")
    if mode == "sync":
        p = at(int(row["threads"]))
        gen, train = costs(p, p)
        over = setup.step_overhead_s + p.reward_s_per_answer * B * G
        if in_run is not None and "step_other_s" in in_run:  # rewards + master, measured
            over = setup.step_overhead_s + float(in_run["step_other_s"])
        setup = dataclasses.replace(setup, max_running=min(256, B * G), step_overhead_s=over)
        threads = {"all": int(row["threads"])}  # one process, busy throughout: gen, then train
        sim = lambda f: simulate_sync(gen.scaled(f), train.scaled(f), work, setup)  # noqa: E731
    else:
        g, t = at(int(row["gen_threads"])), at(int(row["train_threads"]))
        gen, train = costs(g, t)
        setup = dataclasses.replace(setup, publish_s=t.publish_s, load_s=g.load_s)
        threads = {"gen": int(row["gen_threads"]), "train": int(row["train_threads"])}
        sim = lambda f: simulate_async(gen.scaled(f), train.scaled(f), work, setup)  # noqa: E731
    if in_run is not None:
        return sim(1.0)
    return _contended(sim, row, threads, B * G)


def _flat_table(rows: Sequence[Sequence[float]]) -> Tuple[Tuple[float, float, float], ...]:
    """``[b, seconds]`` rows (an in-run decode table) as a :class:`GenCost` table with no
    context term; one row is a flat cost."""
    table = tuple((float(b), float(x), 0.0) for b, x in rows)
    return ((0.0,) + table[0][1:], table[0]) if len(table) == 1 else table


def _in_run_costs(rows: List[dict], i: int, others: bool = True) -> Tuple[dict, str]:
    """Row ``i``'s in-run costs: its own (``others=False``), or taken from the *other* runs
    of the same task and layout (decode: same mode and generation threads; train: same mode
    and trainer threads), averaged; a run with no such sibling uses its own ("own").
    Returns (costs, source)."""
    row = rows[i]

    def layout(r: dict, what: str):
        if r["mode"] == "sync":
            return (r.get("task"), "sync", r["threads"])
        return (r.get("task"), "async", r["gen_threads" if what == "gen" else "train_threads"])

    out, sources = {}, []
    for what, key in (("gen", "decode_table"), ("train", "train_s_per_token")):
        if key not in row:
            raise KeyError(
                f"run {row.get('label', i)!r} has no {key!r}: --costs in-run needs rows "
                "written by benchmark/async_vs_sync.py --rows-out (2026-11-27 or later)"
            )
        sib = [
            r
            for j, r in enumerate(rows)
            if others and j != i and layout(r, what) == layout(row, what)
        ]
        sources.append("others" if sib else "own")
        sib = sib or [row]
        if what == "train":
            out[key] = sum(float(r[key]) for r in sib) / len(sib)
            other = [float(r["step_other_s"]) for r in sib if "step_other_s" in r]
            if other:  # sync: the step's time outside generation and training
                out["step_other_s"] = sum(other) / len(other)
        else:  # the mean of the siblings' piecewise-linear costs, at every b any of them has
            fns = [GenCost(0.0, table=_flat_table(r[key])) for r in sib]
            bs = sorted({float(b) for r in sib for b, _ in r[key]})
            out[key] = [[b, sum(f.step(b, 0) for f in fns) / len(fns)] for b in bs]
    return out, "/".join(sources)


def _contended(sim, row: dict, threads: Dict[str, int], answers_per_step: int) -> SimResult:
    """Run ``sim(slowdown)`` with the CPU contention of a run on ``row['cpu_count']`` cores.

    Besides the engine and trainer threads, the run's other processes (rollout workers,
    gserver manager, master, controller) burn ``row['overhead_cpu_s_per_answer']`` CPU
    seconds per answer (measured in the run by benchmark/async_vs_sync.py).  When the
    busy threads plus that load ask for more than the cores, a fair scheduler stretches
    every thread by demand / cores: the slowdown is iterated to a fixed point (3 rounds).
    Without ``cpu_count`` the devices are taken as uncontended (e.g. GPUs).
    """
    cores = row.get("cpu_count")
    res = sim(1.0)
    if not cores:
        return res
    per_answer = float(row.get("overhead_cpu_s_per_answer", 0.0))
    f = 1.0
    for _ in range(3):
        answers_per_s = res.samples_per_s * answers_per_step / int(row["batch"])
        demand = per_answer * answers_per_s + threads.get("all", 0)
        demand += threads.get("gen", 0) * res.gen_busy_share
        demand += threads.get("train", 0) * (1.0 - res.trainer_idle_share)
        f = max(1.0, demand / float(cores))
        res = sim(f)
    res.slowdown = f
    return res


def _lengths_of(row: dict, base: str) -> List[int]:
    if "lengths" in row:
        return [int(n) for n in row["lengths"]]
    with open(os.path.join(base, row["lengths_file"])) as f:
        text = f.read().strip()
    return [int(n) for n in (json.loads(text) if text.startswith("[") else text.split())]


#: Where ``--validate`` takes the decode and train costs from (see :func:`validate`).
COST_SOURCES = ("profile", "in-run", "in-run-others")


def validate(runs_path: str, profile_paths: Sequence[str], costs: str = "profile") -> dict:
    """Print predicted vs measured samples/s for each run of ``runs_path`` (a JSON list of
    rows, or ``{"runs": [...]}``; each row as :func:`predict_run` plus ``task``,
    ``samples_per_s`` (and ``samples_per_s_after_first``, compared when present) and
    ``lengths`` or ``lengths_file``).  ``costs`` (``COST_SOURCES``): ``profile`` (the
    isolated profiles plus the CPU contention model), ``in-run`` (the decode and train
    costs measured inside the run itself: checks the schedule model alone) or
    ``in-run-others`` (those of the other runs of the same layout, :func:`_in_run_costs`)."""
    if costs not in COST_SOURCES:
        raise ValueError(f"costs={costs!r}: use one of {', '.join(COST_SOURCES)}")
    profiles = {}
    for path in profile_paths:
        with open(path) as f:
            prof = Profile.from_json(json.load(f))
        profiles[prof.threads] = prof
    with open(runs_path) as f:
        data = json.load(f)
    runs = data["runs"] if isinstance(data, dict) else data
    out = []
    print(
        f"{'task':<12} {'run':<24} {'threads':>7} {'measured':>9} {'predicted':>9}"
        f"  (costs: {costs})"
    )
    for i, row in enumerate(runs):
        in_run, source = (None, "profile")
        if costs != "profile":
            in_run, source = _in_run_costs(runs, i, others=costs == "in-run-others")
        res = predict_run(row, profiles, _lengths_of(row, os.path.dirname(runs_path)), in_run)
        # Runs measured since 2026-11-27 also give their figure without the first step:
        # its warm-up (allocations, kernel compilation) is not modelled.
        if "samples_per_s_after_first" in row:
            meas, pred = float(row["samples_per_s_after_first"]), res.after_first_samples_per_s
        else:
            meas, pred = float(row["samples_per_s"]), res.samples_per_s
        err = pred / meas - 1
        sync = row["mode"] == "sync"
        thr = row["threads"] if sync else f"{row['gen_threads']}+{row['train_threads']}"
        label = row.get("label") or (row["mode"] if sync else f"async_eta{row['eta']}")
        print(
            f"{row.get('task', '?'):<12} {label:<24} {thr:>7} {meas:>9.2f} "
            f"{pred:>9.2f}  ({err:+.1%}, {source})"
        )
        kept = {k: v for k, v in row.items() if k != "lengths"}
        out.append(
            {**kept, "predicted": res.summary(), "rel_err": round(err, 4), "cost_source": source}
        )
    worst = max((abs(r["rel_err"]) for r in out), default=0.0)
    return {"benchmark": "simulate_validate", "costs": costs, "rows": out, "max_abs_rel_err": worst}


# ---- --what-if: more cores and longer answers, from this machine's costs -----------------


def what_if(
    prof: Profile,
    lengths: Sequence[int],
    cores: Sequence[int] = (2, 4, 8, 16, 32),
    scales: Sequence[int] = (1, 4, 16),
    batch: int = 32,
    group: int = 8,
    prompt_len: int = 12,
    eta: int = 4,
    n_steps: int = 12,
) -> List[dict]:
    """Predicted async/sync with ``k`` cores used as ``k`` one-thread devices, answers
    ``scale`` times as long as ``lengths`` (the tail keeps its shape).

    Sync runs ``k`` data-parallel engines, then trains data-parallel on all ``k`` (train
    time / k: no all-reduce cost, an assumption that favours sync); async gives the servers
    every split ``g`` of the ``k`` cores (one engine each) and the trainer the other
    ``k - g`` and keeps the best split.  The batch grows with the cores (``batch·k/2``
    prompts) so that every engine stays as full as on 2 cores.
    """
    rows = []
    for scale in scales:
        lens = Lengths(tuple(n * scale for n in lengths), cap=max(lengths) * scale)
        for k in cores:
            B = batch * k // 2
            work = Workload(B, group, lens, prompt_len)
            base = Setup(max_running=256, n_steps=n_steps, eta=eta)
            train_k = lambda n: TrainCost(  # noqa: E731
                prof.train.step_s, prof.train.token_s / n, prof.train.token_sq_s / n
            )
            sync = simulate_sync(
                prof.gen,
                train_k(k),
                work,
                dataclasses.replace(base, n_gen=k, max_running=min(256, B * group // k)),
            )
            best = None
            for g in range(1, k):
                asyn = simulate_async(
                    prof.gen,
                    train_k(k - g),
                    work,
                    dataclasses.replace(
                        base, n_gen=g, publish_s=prof.publish_s, load_s=prof.load_s
                    ),
                )
                if best is None or asyn.steady_samples_per_s > best[1].steady_samples_per_s:
                    best = (g, asyn)
            g, asyn = best
            rows.append(
                {
                    "cores": k,
                    "length_scale": scale,
                    "mean_answer_len": round(sync.mean_answer_len),
                    "sync_gen_share": round(sync.trainer_idle_share, 2),
                    "best_split": f"{g}+{k - g}",
                    "ratio": round(asyn.steady_samples_per_s / sync.steady_samples_per_s, 2),
                }
            )
    return rows


# ---- --project: the published settings at cluster scale ---------------------------------

SOURCES = {
    "blog_v03": "https://github.com/inclusionAI/AReaL/blob/main/blog/AReaL_v0_3.md, Table 2: "
    "R1-Distill-Qwen on AReaL-boba-106k, 1000 PPO steps; 1.5B on 16 nodes: sync 41.0 h, async "
    "14.8 h (2.77x); 7B on 24 nodes: sync 57.7 h, async 25.4 h (2.27x)",
    "async_config": "https://github.com/inclusionAI/AReaL/blob/main/training/configs/"
    "async-ppo.yaml: 512 prompts x 16 answers, max_new_tokens 27,648, eta 4, recompute_logprob, "
    "gradient checkpointing; max_concurrent_rollouts empty = the batch (AReaL's async_rl_exp.py)",
    "code_14b_config": "https://github.com/inclusionAI/AReaL/blob/main/examples/configs/"
    "qwen3-code/14b.yaml: 48 nodes x 8 GPUs, sglang.d80m4p1+d4p8m2 (320 GPUs generate, 64 "
    "train), 128 prompts x 16, max_new_tokens 27,648, eta 16, max_concurrent_rollouts 512",
    "verl_benchmark": "https://github.com/inclusionAI/AReaL/tree/main/benchmark "
    "(verl_v0_3_0_post1_312a8cb/README.md, verl_312a8cb/build_cmd.py): 512 prompts x 16, 31k "
    "max generation (32k context), 3/4 of the GPUs generate, SGLang TP 1 (8 for 32B)",
    "paper": "https://arxiv.org/abs/2505.24298 abstract: up to 2.77x training speedup over "
    "synchronous systems with the same number of GPUs (v2 on; v1: 2.57x)",
    "h800": "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM datasheet): 989 TFLOPS "
    "dense BF16, 80 GB HBM3 at 3.35 TB/s; the H800 is this chip with NVLink at 400 GB/s",
}
H800 = {"bf16_flops": 989e12, "hbm_bytes_per_s": 3.35e12, "hbm_bytes": 80e9}
# From the models' config.json (Qwen2 / Qwen3): parameters with embeddings, layers,
# query width (heads x head_dim), key/value width (kv heads x head_dim).
MODELS = {
    "1.5b": dict(params=1.78e9, layers=28, q_dim=1536, kv_dim=256),  # R1-Distill-Qwen-1.5B
    "7b": dict(params=7.62e9, layers=28, q_dim=3584, kv_dim=512),  # R1-Distill-Qwen-7B
    "14b": dict(params=14.8e9, layers=40, q_dim=5120, kv_dim=1024),  # Qwen3-14B
}
# Ours, not published: efficiencies, fixed costs, the answer lengths.
ASSUMED = {
    "train_mfu": 0.40,  # of peak BF16 on packed long sequences
    "train_step_s": 1.0,  # optimizer step and pipeline fill
    # FLOPs per parameter and token: forward + backward with checkpointing (8) + the
    # log-prob recompute forward (2); attention likewise 10 · layers · q_dim · len² a sequence
    "train_flops_per_param_token": 10,
    "decode_bandwidth_share": 0.8,  # of HBM bandwidth, streaming the weights and the KV cache
    "decode_mfu": 0.5,  # the per-sequence matmul work of a decode step
    "prefill_mfu": 0.5,
    "decode_step_fixed_s": 0.003,  # scheduling, sampling, launches (CUDA graphs on)
    "kv_memory_share": 0.8,  # of HBM for weights + KV (SGLang mem_fraction_static)
    "weights_io_bytes_per_s": 2e9,  # publish to / load from shared storage
    "weights_io_fixed_s": 1.0,
    "sync_switch_s": 2.0,  # colocated sync: the new weights to the engines, every step
    "step_overhead_s": 2.0,  # rewards, data movement, master
    "prompt_len": 200,
    # Lognormal answers, median 3,000 tokens, sigma 0.8 (mean ~4.1k), capped: no published
    # distribution was found; 0.3% of the answers then reach a 27,648 cap (the sync tail).
    "length_median": 3000,
    "length_sigma": 0.8,
}


@dataclasses.dataclass(frozen=True)
class Scenario:
    """``gpus`` in all; async gives ``gen_gpus`` to servers of ``gen_tp`` GPUs each and the
    rest to the trainer; sync runs both phases on all of them."""

    name: str
    model: str
    gpus: int
    gen_gpus: int
    gen_tp: int
    batch: int
    cap: int
    eta: int
    group: int = 16
    max_concurrent: Optional[int] = None
    published_hours: Optional[Tuple[float, float]] = None  # (sync, async), 1000 steps
    source: str = "verl_benchmark"  # keys of SOURCES


SCENARIOS = [
    Scenario("areal-1.5b-math", "1.5b", 128, 96, 1, 512, 27648, 4, published_hours=(41.0, 14.8),
             source="blog_v03 async_config verl_benchmark"),
    Scenario("areal-7b-math", "7b", 192, 144, 1, 512, 27648, 4, published_hours=(57.7, 25.4),
             source="blog_v03 async_config verl_benchmark"),
    Scenario("areal-14b-code", "14b", 384, 320, 4, 128, 27648, 16, max_concurrent=512,
             source="code_14b_config"),
    Scenario("1.5b-16k-16gpu", "1.5b", 16, 12, 1, 64, 15360, 4),
    Scenario("7b-32k-64gpu", "7b", 64, 48, 1, 128, 31744, 4),
]  # fmt: skip


def gpu_costs(model: str, gen_tp: int, train_gpus: int, mean_ctx: float):
    """Roofline costs on H800s: a decode step streams the weights and the KV cache (memory
    bound) plus per-sequence matmuls; training is FLOPs at ``train_mfu``.  Returns
    (GenCost, TrainCost, sequences a server's KV memory holds at ``mean_ctx`` tokens)."""
    m, A = MODELS[model], ASSUMED
    weight_bytes, kv_per_token = 2 * m["params"], 4 * m["layers"] * m["kv_dim"]  # bf16, K+V
    bw = gen_tp * H800["hbm_bytes_per_s"] * A["decode_bandwidth_share"]
    flops = gen_tp * H800["bf16_flops"]
    gen = GenCost(
        step_s=A["decode_step_fixed_s"] + weight_bytes / bw,
        seq_s=2 * m["params"] / (flops * A["decode_mfu"]),
        ctx_token_s=kv_per_token / bw,
        prefill_token_s=2 * m["params"] / (flops * A["prefill_mfu"]),
    )
    k = A["train_flops_per_param_token"] / (train_gpus * H800["bf16_flops"] * A["train_mfu"])
    train = TrainCost(A["train_step_s"], k * m["params"], k * m["layers"] * m["q_dim"])
    kv_bytes = gen_tp * H800["hbm_bytes"] * A["kv_memory_share"] - weight_bytes
    return gen, train, max(1, int(kv_bytes / (kv_per_token * mean_ctx)))


def project(sc: Scenario, n_steps: int = 16, seed: int = 0) -> dict:
    """Simulate ``sc`` sync and async: steady-state seconds per step and their ratio."""
    A = ASSUMED
    lengths = Lengths(median=A["length_median"], sigma=A["length_sigma"], cap=sc.cap)
    work = Workload(sc.batch, sc.group, lengths, A["prompt_len"])
    rng = random.Random(seed)
    mean_ctx = A["prompt_len"] + sum(lengths.sample(rng) for _ in range(4000)) / 4000
    io_s = 2 * MODELS[sc.model]["params"] / A["weights_io_bytes_per_s"] + A["weights_io_fixed_s"]
    base = Setup(max_prefill_tokens=32768, n_steps=n_steps, seed=seed)
    gen, train, slots = gpu_costs(sc.model, sc.gen_tp, sc.gpus, mean_ctx)
    over = A["step_overhead_s"] + A["sync_switch_s"]
    sync = simulate_sync(gen, train, work, dataclasses.replace(
        base, n_gen=sc.gpus // sc.gen_tp, max_running=slots, step_overhead_s=over))  # fmt: skip
    gen, train, slots = gpu_costs(sc.model, sc.gen_tp, sc.gpus - sc.gen_gpus, mean_ctx)
    asyn = simulate_async(gen, train, work, dataclasses.replace(
        base, n_gen=sc.gen_gpus // sc.gen_tp, max_running=slots, eta=sc.eta,
        max_concurrent_rollouts=sc.max_concurrent, publish_s=io_s, load_s=io_s,
        step_overhead_s=A["step_overhead_s"]))  # fmt: skip
    t_sync, t_async = sc.batch / sync.steady_samples_per_s, sc.batch / asyn.steady_samples_per_s
    pub = sc.published_hours
    return {
        "scenario": sc.name,
        "gpus": sc.gpus,
        "sync_step_s": round(t_sync, 1),
        "async_step_s": round(t_async, 1),
        "predicted_ratio": round(t_sync / t_async, 2),
        "published_hours": pub,
        "published_step_s": [round(h * 3.6, 1) for h in pub] if pub else None,
        "published_ratio": round(pub[0] / pub[1], 2) if pub else None,
        "sync_trainer_idle": round(sync.trainer_idle_share, 2),
        "async_trainer_idle": round(asyn.trainer_idle_share, 2),
        "async_staleness_max": max(asyn.staleness),
        "mean_answer_len": round(asyn.mean_answer_len),
        "source": sc.source,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--profile", metavar="OUT.json", help="measure costs here, write a profile")
    mode.add_argument("--validate", metavar="RUNS.json", help="predicted vs measured runs")
    mode.add_argument("--project", action="store_true", help="the published settings at scale")
    mode.add_argument(
        "--what-if",
        metavar="LENGTHS.json",
        help="more cores / longer answers from a 1-thread profile (--profiles) and a list of "
        "measured answer lengths",
    )
    p.add_argument("--threads", type=int, default=1, help="--profile: torch/engine threads")
    p.add_argument("--model", default=TINY, help="--profile: HF model directory")
    p.add_argument("--quick", action="store_true", help="--profile: one repetition per point")
    p.add_argument("--profiles", nargs="+", default=[], help="--validate: profile JSON files")
    p.add_argument(
        "--costs",
        choices=COST_SOURCES,
        default="profile",
        help="--validate: decode/train costs from the isolated profiles (plus the CPU "
        "contention model), measured inside each run, or inside the other runs of the "
        "same layout",
    )
    p.add_argument("--steps", type=int, default=16, help="--project: train steps simulated")
    args = p.parse_args()
    if args.profile:
        t0 = time.monotonic()
        prof = measure_profile(args.threads, args.model, args.quick)
        with open(args.profile, "w") as f:
            json.dump(prof, f, indent=1)
        g, t = prof["gen"], prof["train"]
        print(f"{args.threads} thread(s), {time.monotonic() - t0:.0f} s; decode ms by b: "
              + ", ".join(f"{b}: {1e3 * x:.1f}" for b, _, x in prof["raw"]["decode"][::2])
              + f"; prefill {1e6 * g['prefill_token_s']:.0f} us/token; train "
              f"{t['step_s']:.3f} s + {1e6 * t['token_s']:.0f} us/token; publish "
              f"{prof['publish_s']:.3f} s, load {prof['load_s']:.3f} s")  # fmt: skip
        print(json.dumps({k: v for k, v in prof.items() if k != "raw"}))
    elif args.validate:
        if not args.profiles:
            p.error("--validate needs --profiles (one JSON per thread count)")
        print(json.dumps(validate(args.validate, args.profiles, args.costs)))
    elif args.what_if:
        profs = [Profile.from_json(json.load(open(f))) for f in args.profiles]
        one = [pr for pr in profs if pr.threads == 1]
        if not one:
            p.error("--what-if needs a 1-thread profile in --profiles")
        with open(args.what_if) as f:
            lengths = json.load(f)
        rows = what_if(one[0], lengths)
        print(f"{'cores':>5} {'x len':>5} {'mean len':>8} {'sync gen share':>14} "
              f"{'async split':>11} {'async/sync':>10}")  # fmt: skip
        for r in rows:
            print(f"{r['cores']:>5} {r['length_scale']:>5} {r['mean_answer_len']:>8} "
                  f"{r['sync_gen_share']:>14.2f} {r['best_split']:>11} "
                  f"{r['ratio']:>9.2f}x")  # fmt: skip
        print(json.dumps({"benchmark": "simulate_what_if", "rows": rows}))
    else:
        rows = [project(sc, args.steps) for sc in SCENARIOS]
        print(f"{'scenario':<16} {'GPUs':>4} {'sync s/step':>11} {'async s/step':>12} "
              f"{'async/sync':>10}   published (sync/async s/step)")  # fmt: skip
        for r in rows:
            pub = "-"
            if r["published_ratio"]:
                pub = "{:.0f}/{:.0f} = {:.2f}x".format(*r["published_step_s"], r["published_ratio"])
            print(f"{r['scenario']:<16} {r['gpus']:>4} {r['sync_step_s']:>11.1f} "
                  f"{r['async_step_s']:>12.1f} {r['predicted_ratio']:>9.2f}x   "
                  f"{pub}")  # fmt: skip
        for key in sorted({k for r in rows for k in r["source"].split()} | {"paper", "h800"}):
            print(f"  [{key}] {SOURCES[key]}")
        print(json.dumps({"benchmark": "simulate_project", "assumed": ASSUMED, "rows": rows}))


if __name__ == "__main__":
    main()
