"""Ending a process that used torch.distributed without the interpreter's teardown race.

A gloo process group runs its collectives on C++ threads.  After the last collective returns,
such a thread may still be destroying the finished work object, which drops the Python tensors
it held and so needs the GIL.  If the main thread has meanwhile begun interpreter finalization,
the thread cannot take the GIL, CPython unwinds it with ``pthread_exit``, the unwind passes a
``noexcept`` destructor and the process dies with SIGABRT ("terminate called without an active
exception") — after all its work was done and reported.  Seen as an occasional exit code -6 of
data-parallel ranks that had finished cleanly.

:func:`hard_exit` does everything a normal exit does that matters here (``atexit`` callbacks —
name-resolve cleanup, multiprocessing pools —, logging handlers, stdio) while the interpreter is
still fully alive, so those threads can finish, and then leaves with ``os._exit``, skipping the
finalization that races with them.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys


def hard_exit(code: int = 0) -> None:
    """Run exit callbacks, flush logs and stdio, then ``os._exit(code)``; never returns."""
    try:
        atexit._run_exitfuncs()
        logging.shutdown()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed or broken stream must not change the exit code
                pass
        os._exit(code)


def run_and_exit(main) -> None:
    """``sys.exit(main())`` with :func:`hard_exit`: the same exit codes and messages.

    ``SystemExit`` keeps its meaning (None → 0, an int → that code, anything else is printed
    to stderr → 1), another exception prints its traceback → 1, Ctrl-C → 130.
    """
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    hard_exit(code)
