"""What the run's MAC costs per ZMQ message: signed vs plain send + receive, in one process.

The baseline is what the transport did before messages were signed (one frame, pickled,
unpickled on arrival); ours is :func:`realhf.base.net.auth.send` / :func:`~.auth.recv` (an
HMAC-SHA256 frame in front, checked before unpickling).  Both go over the same kind of TCP
PUSH/PULL pair on 127.0.0.1, one message in flight at a time, for payloads the size of a
control request (~1 KB), a trajectory of the tiny task (~16 KB) and a large batch (~4 MB).

    python benchmark/zmq_mac.py [--n 2000]
"""

from __future__ import annotations

import argparse
import pickle
import platform
import time

import numpy as np
import zmq

from realhf.base.net import auth

KIND = b"bench"


def _pair():
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    pull.bind("tcp://127.0.0.1:*")
    push = ctx.socket(zmq.PUSH)
    push.connect(pull.getsockopt_string(zmq.LAST_ENDPOINT))
    return push, pull


def _plain(push, pull, msg) -> None:
    push.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
    pickle.loads(pull.recv())


def _signed(push, pull, msg) -> None:
    auth.send(push, KIND, pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
    got = auth.recv(pull, KIND, "bench")
    assert got is not None
    pickle.loads(got[1])


def _time_both(push, pull, msg, n: int, rounds: int = 7):
    """Best seconds per message of plain and signed, measured in alternating rounds (so a
    burst of other load on the machine hits both alike; the best only ever loses load)."""
    for fn in (_plain, _signed):
        for _ in range(min(50, n)):
            fn(push, pull, msg)
    best = {_plain: float("inf"), _signed: float("inf")}
    for _ in range(rounds):
        for fn in best:
            t0 = time.perf_counter()
            for _ in range(n):
                fn(push, pull, msg)
            best[fn] = min(best[fn], (time.perf_counter() - t0) / n)
    return best[_plain], best[_signed]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="messages per measurement")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    payloads = {
        "control (~1 KB)": {"cmd": "configure", "blob": rng.bytes(1000)},
        "trajectory (~16 KB)": {"ids": rng.integers(0, 268, 2000), "logp": rng.random(1000)},
        "batch (~4 MB)": {"x": rng.random(512 * 1024)},
    }
    push, pull = _pair()
    print(f"host: {platform.processor() or platform.machine()}; {platform.python_version()}")
    print(f"{'message':<22}{'bytes':>10}{'plain µs':>11}{'signed µs':>11}{'MAC µs':>9}{'ratio':>7}")
    for name, msg in payloads.items():
        size = len(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        n = args.n if size < 1 << 20 else max(20, args.n // 50)
        plain, signed = (t * 1e6 for t in _time_both(push, pull, msg, n))
        print(
            f"{name:<22}{size:>10}{plain:>11.1f}{signed:>11.1f}{signed - plain:>9.1f}"
            f"{signed / plain:>7.2f}"
        )
    push.close(linger=0)
    pull.close(linger=0)


if __name__ == "__main__":
    main()
