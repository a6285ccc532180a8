"""Math reward: is a generated solution's final answer correct?

    from realhf.impl.reward.math_reward import verify, verify_batch
    verify("... so the answer is \\boxed{\\frac12}.", ["\\boxed{0.5}"])      # True
    verify_batch(texts, solutions_list, timeout=15.0)                      # [bool, ...]

The answer is extracted from the generation (:func:`extract_answer`), each
reference solution's answer likewise (with a last-number fallback for prose
solutions), and compared with :func:`math_equal`. Cheap checks (exact string,
multiple choice, numbers) run in the caller; anything that needs sympy runs in a
module-level process pool with a per-item timeout (default 15 s). A timeout or a
crashed worker counts as wrong and is logged; the caller is never left waiting:
every wait has a deadline.

Safe from many threads (the pool is shared and thread-safe) and from many
processes (each process lazily creates its own pool; a forked child never uses
its parent's). Call :func:`shutdown_pool` to stop the workers early; it also runs
at interpreter exit.

The reward convention (README, "Rewards") lives with the caller: correct → +1, wrong → −1,
then ``(r − bias) · scaling``.
"""

from __future__ import annotations

import ast
import atexit
import concurrent.futures
import functools
import logging
import math
import multiprocessing
import os
import sys
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Dict, List, Optional, Sequence

from realhf.impl.reward.math_grader import math_equal, quick_equal, rely_on_caller_timeout
from realhf.impl.reward.math_normalize import (
    extract_answer,
    extract_solution_answer,
    normalize_answer,
)

__all__ = [
    "extract_answer",
    "math_equal",
    "normalize_answer",
    "verify",
    "verify_batch",
    "reference_answers",
    "UngradableRow",
    "get_pool",
    "shutdown_pool",
    "DEFAULT_TIMEOUT",
]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 15.0
# Spawning a worker imports sympy and math-verify (about 1-2 s); a batch's
# deadline allows for that on top of the per-item timeouts.
_STARTUP_GRACE = 60.0

_pool_lock = threading.Lock()
_pool = None
_pool_pid: Optional[int] = None
_pool_workers = 0
_atexit_registered = False


def _default_workers() -> int:
    env = os.environ.get("REALHF_MATH_VERIFY_WORKERS")
    if env is not None:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(
                f"REALHF_MATH_VERIFY_WORKERS={env!r} is not a positive integer; "
                "set it to the number of verifier processes (e.g. 4) or unset it"
            )
        return n
    return max(1, min(4, os.cpu_count() or 1))


def _warm_worker() -> None:
    """Pool initializer: import and exercise the LaTeX parser before the first timed task.

    The first parse in a process builds the ANTLR parser (about a second), which
    would otherwise be charged to some unlucky item's timeout.  The pool's timeout bounds
    each item, so math-verify's own (wall-clock) alarm is turned off here
    (:func:`~realhf.impl.reward.math_grader.rely_on_caller_timeout`).
    """
    rely_on_caller_timeout()
    math_equal(r"\sqrt{2}", r"\frac{2}{\sqrt{2}}")


def get_pool(max_workers: Optional[int] = None):
    """The process pool of this process, created on first use.

    ``max_workers`` defaults to ``$REALHF_MATH_VERIFY_WORKERS`` or min(4, CPUs).
    Workers are spawned, not forked: the caller may be a trainer with live
    threads (torch, zmq) whose locks a fork would copy mid-use.  A spawned child
    re-runs the caller's main script (as ``__mp_main__``); when the first call comes
    from that script's top level outside an ``if __name__ == "__main__":`` block, the
    children would run the script again, so the workers are forked instead (such a
    script has not started a trainer's threads at that point).
    """
    global _pool, _pool_pid, _pool_workers, _atexit_registered
    import pebble

    with _pool_lock:
        if _pool is not None and _pool_pid == os.getpid() and _pool.active:
            return _pool
        n = max_workers or _default_workers()
        if n < 1:
            raise ValueError(f"get_pool: max_workers={max_workers} must be >= 1")
        # A pool inherited through fork belongs to the parent: leave it alone.
        method = "fork" if _called_from_unguarded_main() else "spawn"
        _pool = pebble.ProcessPool(
            max_workers=n,
            max_tasks=1000,  # recycle workers: sympy's caches only grow
            initializer=_warm_worker,
            context=multiprocessing.get_context(method),
        )
        _pool_pid = os.getpid()
        _pool_workers = n
        if not _atexit_registered:
            atexit.register(shutdown_pool)
            _atexit_registered = True
        logger.info("math verifier pool started: %d %s workers", n, method)
        return _pool


def _called_from_unguarded_main() -> bool:
    """Whether this call comes from the top level of the main script, outside an
    ``if __name__ == "__main__":`` block (spawned children would run that code again)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or not os.path.isfile(path):
        return False
    f = sys._getframe(1)
    while f is not None:
        if f.f_globals is main.__dict__ and f.f_code.co_name == "<module>":
            return not any(lo <= f.f_lineno <= hi for lo, hi in _main_guards(path))
        f = f.f_back
    return False


@functools.lru_cache(maxsize=8)
def _main_guards(path: str) -> tuple:
    """Line ranges of the ``if __name__ == "__main__":`` blocks of script ``path``."""
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
    except (OSError, SyntaxError, ValueError):
        return ()

    def is_guard(test) -> bool:
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
            return False
        sides = {ast.dump(test.left), ast.dump(test.comparators[0])}
        return isinstance(test.ops[0], ast.Eq) and sides == {
            ast.dump(ast.Name("__name__", ast.Load())),
            ast.dump(ast.Constant("__main__")),
        }

    return tuple(
        (node.lineno, node.end_lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and is_guard(node.test)
    )


def shutdown_pool(timeout: float = 10.0) -> None:
    """Stop this process's verifier workers (a no-op if none were started)."""
    global _pool, _pool_pid
    with _pool_lock:
        pool, pid = _pool, _pool_pid
        _pool, _pool_pid = None, None
    if pool is None or pid != os.getpid():
        return
    pool.stop()
    pool.join(timeout=timeout)


class UngradableRow(ValueError):
    """A dataset row whose reference solutions give nothing to grade against."""


def reference_answers(solutions: Sequence[str]) -> List[str]:
    """The answers that :func:`verify_batch` compares against, one per solution that has one.

    Raises :class:`UngradableRow` saying why when there is none: no solutions, a solution
    that is not a string, or no answer readable from any of them (every generation would
    be graded wrong, a silently useless row).
    """
    if isinstance(solutions, str):
        solutions = [solutions]
    if not solutions:
        raise UngradableRow("it has no reference solutions")
    for sol in solutions:
        if not isinstance(sol, str):
            raise UngradableRow(
                f"solution {_short(repr(sol))} ({type(sol).__name__}) is not a string; write "
                'solutions as strings such as "\\boxed{42}"'
            )
    answers = [a for a in (extract_solution_answer(s) for s in solutions) if a]
    if not answers:
        raise UngradableRow(
            f"no answer can be read from its solutions {[_short(s) for s in solutions]}"
        )
    return answers


def _grade_heavy(pred: str, golds: List[str]) -> bool:
    """Pool task: the full :func:`math_equal` against each reference answer."""
    return any(math_equal(pred, g) for g in golds)


def _short(s: str, n: int = 80) -> str:
    return s if len(s) <= n else s[:n] + "..."


def _triage(text: str, solutions: Sequence[str]):
    """(decided result or None, predicted answer, golds needing the pool)."""
    pred = extract_answer(text)
    if pred is None:
        return False, None, []
    heavy = []
    for sol in solutions:
        gold = extract_solution_answer(sol)
        if gold is None:
            continue
        try:
            quick = quick_equal(pred, gold)
        except Exception:  # a normaliser bug must not lose the item: let the pool decide
            logger.exception("quick_equal failed on pred=%r gold=%r", _short(pred), _short(gold))
            quick = None
        if quick:
            return True, pred, []
        if quick is None:
            heavy.append(gold)
    return (None if heavy else False), pred, heavy


def _schedule(pred: str, golds: List[str], timeout: float):
    try:
        return get_pool().schedule(_grade_heavy, args=(pred, golds), timeout=timeout)
    except RuntimeError:  # another thread shut the pool down between get and schedule
        return get_pool().schedule(_grade_heavy, args=(pred, golds), timeout=timeout)


def verify_batch(
    texts: Sequence[str],
    solutions_list: Sequence[Sequence[str]],
    timeout: float = DEFAULT_TIMEOUT,
) -> List[bool]:
    """For each generation, True iff its answer matches any of its solutions.

    Args:
        texts: generated texts, one per item.
        solutions_list: per item, the list of reference solutions (``"\\boxed{42}"``,
            a bare answer, or a prose solution).
        timeout: seconds each item may spend in the symbolic checks; past it the
            item is wrong (and logged).
    """
    if isinstance(texts, str) or len(texts) != len(solutions_list):
        raise ValueError(
            "verify_batch needs a list of texts and a list of solution lists of the "
            f"same length; got {type(texts).__name__} of length {len(texts)} and "
            f"{len(solutions_list)} solution lists"
        )
    if not timeout or timeout <= 0:
        raise ValueError(f"verify_batch: timeout={timeout} must be a positive number of seconds")
    results: List[bool] = [False] * len(texts)
    futures: Dict[int, concurrent.futures.Future] = {}
    preds: Dict[int, tuple] = {}
    for i, (text, sols) in enumerate(zip(texts, solutions_list)):
        if isinstance(sols, str):
            raise ValueError(
                f"verify_batch: solutions_list[{i}] is a str; pass a list of solutions, e.g. "
                f"[{sols!r}]"
            )
        decided, pred, heavy = _triage(text, sols)
        if decided is not None:
            results[i] = decided
            continue
        futures[i] = _schedule(pred, heavy, timeout)
        preds[i] = (pred, heavy)
    if not futures:
        return results
    # Tasks queue behind each other when there are more than workers; the
    # deadline allows every task its full timeout in the worst case.
    rounds = math.ceil(len(futures) / max(1, _pool_workers))
    deadline = time.monotonic() + rounds * (timeout + 1.0) + _STARTUP_GRACE
    for i, fut in futures.items():
        pred, golds = preds[i]
        try:
            results[i] = bool(fut.result(timeout=max(0.0, deadline - time.monotonic())))
        except concurrent.futures.TimeoutError:
            fut.cancel()
            logger.warning(
                "math verify timed out after %.1fs, counted as wrong: pred=%r golds=%r",
                timeout,
                _short(pred),
                [_short(g) for g in golds],
            )
        except BrokenProcessPool as e:
            # Workers cannot start or keep dying (e.g. the main module is not
            # import-safe under spawn): drop the pool so the next call retries.
            logger.error(
                "math verifier pool is broken (%s); it will be recreated on the next "
                "call. Items of this batch count as wrong.",
                e,
            )
            shutdown_pool()
        except Exception as e:  # worker died (memory, signal) or the grader raised
            logger.warning(
                "math verify failed (%s: %s), counted as wrong: pred=%r golds=%r",
                type(e).__name__,
                e,
                _short(pred),
                [_short(g) for g in golds],
            )
    return results


def verify(generated_text: str, solutions: Sequence[str], timeout: float = DEFAULT_TIMEOUT) -> bool:
    """True iff the final answer of ``generated_text`` matches any of ``solutions``."""
    if not isinstance(generated_text, str):
        raise TypeError(
            f"verify expects the generated text as str, got {type(generated_text).__name__}"
        )
    return verify_batch([generated_text], [solutions], timeout=timeout)[0]
