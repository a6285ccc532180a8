"""An attacker on the same host, without the run's secret, against each kind of ZMQ socket a
run listens on: a worker's control socket (REP), the master's request/reply socket (ROUTER)
and a consumer's push/pull socket (PULL).

Each gets a pickle that would create a file when unpickled, sent three ways — bare, in the
signed framing with a wrong MAC, and signed with another secret (e.g. a stale process of an
earlier launch) — and must create nothing, count the drops, log the sender once, and go on
serving the run's own messages.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import threading
import time

import pytest
import zmq

from realhf.base.net import auth
from realhf.system.transport import push_pull, request_reply
from realhf.system.transport.push_pull import PullerStream, PusherStream
from realhf.system.transport.request_reply import ReplyServer, RequestClient
from realhf.system.worker.base import CONTROL_KIND, ControlReply, WorkerControlServer

pytestmark = pytest.mark.usefixtures("memory_name_resolve")
EXP = "attack"


class _Evil:
    """Unpickling this creates ``path``: proof that the receiver unpickled it."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _attacks(kind: bytes, path: str):
    """The three forgeries, as lists of frames (before any ROUTER/DEALER prefix)."""
    body = pickle.dumps(_Evil(path))
    other = hmac.new(b"another run's secret, 32 bytes!!", kind + b"\0" + body, hashlib.sha256)
    return [
        [body],  # what an unmodified peer would send
        [b"\0" * auth.MAC_BYTES + body],  # the framing, a made-up MAC
        [other.digest() + body],  # a real MAC under another secret
    ]


def _attacker(ctx: zmq.Context, sock_type: int, address: str, **opts) -> zmq.Socket:
    s = ctx.socket(sock_type)
    s.setsockopt(zmq.LINGER, 0)
    for k, v in opts.items():
        s.setsockopt(getattr(zmq, k), v)
    s.connect(address)
    return s


def _dropped(kind: bytes) -> int:
    return auth.rejected().get(kind.decode(), 0)


def test_push_pull_consumer_drops_forged_messages_and_goes_on(trial, tmp_path, caplog):
    evil = str(tmp_path / "pwned")
    puller = PullerStream(EXP, trial, "roll", 0)
    pusher = PusherStream(EXP, trial, "roll", 0, 1, 1, connect_timeout=5)
    ctx = zmq.Context.instance()
    attacker = _attacker(ctx, zmq.PUSH, puller.address)
    before = _dropped(push_pull.STREAM_KIND)
    try:
        for frames in _attacks(push_pull.STREAM_KIND, evil):
            attacker.send_multipart(frames)
        pusher.push({"traj": 1}, timeout=5)
        # The socket fair-queues between senders: the real message may come before or after
        # the forgeries, which are skipped either way ...
        assert puller.pull(timeout=5) == {"traj": 1}
        # ... and never stand in for a message: with only forgeries left, the wait times out.
        with pytest.raises(push_pull.StreamTimeout):
            puller.pull(timeout=1)
        assert not os.path.exists(evil), "a forged message was unpickled"
        assert _dropped(push_pull.STREAM_KIND) - before == 3
        logged = [r for r in caplog.records if "without this run's MAC" in r.getMessage()]
        assert len(logged) == 1 and "127.0.0.1" in logged[0].getMessage(), "logged once, by sender"
    finally:
        attacker.close()
        pusher.close()
        puller.close()


def test_request_reply_master_drops_forged_messages_and_goes_on(trial, tmp_path):
    evil = str(tmp_path / "pwned")
    client = RequestClient(EXP, trial, "s", ["w0"], wait=False)
    served = threading.Event()

    def serve():
        server = ReplyServer(EXP, trial, "s", "w0", connect_timeout=5)
        try:
            req = server.poll(timeout=10)
            server.reply(req, req.data * 2)
            served.set()
        finally:
            server.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    ctx = zmq.Context.instance()
    # As a DEALER with the real worker's name: the ROUTER sees the frames the worker's would.
    attacker = _attacker(ctx, zmq.DEALER, client.address, IDENTITY=b"mallory")
    before = _dropped(request_reply.STREAM_KIND)
    try:
        for frames in _attacks(request_reply.STREAM_KIND, evil):
            attacker.send_multipart(frames)
        client.wait_for_handlers(10)
        [rid] = client.request(["w0"], "double", [21])
        assert [r.data for r in client.gather([rid], timeout=10)] == [42]
        assert served.wait(10)
        # The ROUTER fair-queues between peers: forgeries may still be queued.  Reading
        # on (all_connected reads what is queued) must drop them, not unpickle them.
        deadline = time.monotonic() + 10
        while _dropped(request_reply.STREAM_KIND) - before < 3 and time.monotonic() < deadline:
            assert client.all_connected()
            time.sleep(0.01)
        assert not os.path.exists(evil), "a forged message was unpickled"
        assert _dropped(request_reply.STREAM_KIND) - before == 3
    finally:
        attacker.close()
        t.join(10)
        client.close()


def test_worker_control_socket_drops_forged_requests_and_goes_on(trial, tmp_path):
    evil = str(tmp_path / "pwned")
    control = WorkerControlServer(EXP, trial, "model_worker/0")
    ctx = zmq.Context.instance()
    before = _dropped(CONTROL_KIND)
    try:
        for frames in _attacks(CONTROL_KIND, evil):
            # A REQ socket gets one answer per request: the worker must answer (or its REP
            # socket could never receive again), with an empty frame and nothing else.
            attacker = _attacker(ctx, zmq.REQ, control.address)
            attacker.send_multipart(frames)
            assert control.recv(timeout=5) is None, "a forged request reached the worker"
            assert attacker.poll(5000) and attacker.recv_multipart() == [b""]
            attacker.close()
        assert not os.path.exists(evil), "a forged request was unpickled"
        assert _dropped(CONTROL_KIND) - before == 3
        # The controller's own request still gets through, and its answer is signed.
        controller = _attacker(ctx, zmq.REQ, control.address)
        auth.send(controller, CONTROL_KIND, pickle.dumps("ping"))
        assert control.recv(timeout=5) == "ping"
        control.send(ControlReply("model_worker/0", "ping", result="pong"))
        assert controller.poll(5000)
        got = auth.recv(controller, CONTROL_KIND, "test controller")
        assert got is not None and pickle.loads(got[1]).result == "pong"
        controller.close()
    finally:
        control.close()
