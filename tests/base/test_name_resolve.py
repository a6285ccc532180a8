"""name_resolve against real backends: memory, file, a real etcd server and a Ray GCS.

Multi-process tests run the file, etcd3 and ray backends from separate Python
processes (the memory backend is process-local by design).
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
import ray_cluster

from realhf.base import name_resolve
from realhf.base.name_resolve import NameEntryExistsError, NameEntryNotFoundError
from realhf.base.net import network

RAY = pytest.param("ray", marks=pytest.mark.ray)
BACKENDS = ["memory", "file", pytest.param("etcd3", marks=pytest.mark.etcd), RAY]
MULTIPROC_BACKENDS = ["file", pytest.param("etcd3", marks=pytest.mark.etcd), RAY]


@pytest.fixture(scope="module")
def ray_gcs():
    """The GCS address of a one-node Ray cluster started for this module."""
    if not ray_cluster.ray_importable():
        pytest.skip("ray is not installed (pip install ray)")
    cluster = ray_cluster.start_ray_cluster(n_nodes=1)
    with cluster.client_env():  # worker subprocesses inherit the token
        yield cluster.address
    cluster.stop()


def _spec(backend, tmp_path, request):
    """A REALHF_NAME_RESOLVE spec string for a backend (for child processes)."""
    if backend == "memory":
        return "memory"
    if backend == "file":
        return f"file://{tmp_path / 'nr'}"
    if backend == "ray":
        return f"ray://{request.getfixturevalue('ray_gcs')}"
    return f"etcd3://{request.getfixturevalue('etcd_server').address}"


@pytest.fixture
def spec(request, tmp_path):
    return _spec(request.param, tmp_path, request)


@pytest.fixture
def repo(spec):
    r = name_resolve.from_spec(spec)
    yield r
    r.close()


@pytest.fixture
def root():
    """A key prefix unique to the test (the etcd server is shared by all tests)."""
    return f"test/{uuid.uuid4().hex[:8]}"


def _child(spec, code, *args):
    """Start a Python child that has `repo` (built from spec) and runs code."""
    prog = textwrap.dedent(
        """
        import sys, time
        from realhf.base import name_resolve
        repo = name_resolve.from_spec(sys.argv[1])
        args = sys.argv[2:]
        """
    ) + textwrap.dedent(code)
    return subprocess.Popen(
        [sys.executable, "-c", prog, spec, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_line(proc, expected, timeout=20):
    """Read the child's stdout until a line equals `expected`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.strip() == expected:
            return
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"child never printed {expected!r}; stderr:\n{proc.stderr.read()}")


def _gone_within(repo, key, limit):
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        try:
            repo.get(key)
        except NameEntryNotFoundError:
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


# ---- single-process behaviour, every backend ---------------------------------


@pytest.mark.parametrize("spec", BACKENDS, indirect=True)
def test_add_get_replace_delete(repo, root):
    key = f"{root}/a"
    with pytest.raises(NameEntryNotFoundError, match=key):
        repo.get(key)
    repo.add(key, "v1")
    assert repo.get(key) == "v1"
    with pytest.raises(NameEntryExistsError, match=key):
        repo.add(key, "v2")
    assert repo.get(key) == "v1"
    repo.add(key, 7, replace=True)  # numbers are stored as text
    assert repo.get(key) == "7"
    repo.delete(key)
    with pytest.raises(NameEntryNotFoundError):
        repo.get(key)
    with pytest.raises(NameEntryNotFoundError, match=key):
        repo.delete(key)


@pytest.mark.parametrize("spec", BACKENDS, indirect=True)
def test_subtrees_are_path_wise_and_sorted(repo, root):
    keys = [repo.add_subentry(f"{root}/peers", f"addr{i}") for i in range(4)]
    assert all(k.startswith(f"{root}/peers/") and len(k.split("/")[-1]) == 8 for k in keys)
    repo.add(f"{root}/peers2", "sibling")  # shares the string prefix only
    repo.add(f"{root}/peers", "self")
    found = repo.find_subtree(f"{root}/peers")
    assert found == sorted(keys + [f"{root}/peers"])
    by_key = dict(zip(keys, [f"addr{i}" for i in range(4)]))
    by_key[f"{root}/peers"] = "self"
    assert repo.get_subtree(f"{root}/peers/") == [by_key[k] for k in sorted(by_key)]
    repo.clear_subtree(f"{root}/peers")
    assert repo.find_subtree(f"{root}/peers") == []
    assert repo.get(f"{root}/peers2") == "sibling"


@pytest.mark.parametrize("spec", BACKENDS, indirect=True)
def test_reset_removes_only_delete_on_exit_and_only_own_entries(repo, spec, root):
    repo.add(f"{root}/tmp", "x")
    repo.add(f"{root}/keep", "y", delete_on_exit=False)
    repo.add(f"{root}/taken", "mine")
    if spec != "memory":  # another client replaces one of our entries
        other = name_resolve.from_spec(spec)
        other.add(f"{root}/taken", "theirs", replace=True, delete_on_exit=False)
        other.close()
    else:
        repo.add(f"{root}/taken", "theirs", replace=True, delete_on_exit=False)
    repo.reset()
    assert repo.find_subtree(root) == [f"{root}/keep", f"{root}/taken"]
    assert repo.get(f"{root}/taken") == "theirs"
    repo.clear_subtree(root)


@pytest.mark.parametrize("spec", BACKENDS, indirect=True)
def test_wait_returns_late_value_and_times_out_naming_key(repo, root):
    key = f"{root}/late"
    threading.Timer(0.2, lambda: repo.add(key, "here")).start()
    assert repo.wait(key, timeout=5, poll_frequency=0.02) == "here"
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=f"{root}/never"):
        repo.wait(f"{root}/never", timeout=0.3, poll_frequency=0.05)
    assert time.monotonic() - t0 < 2


@pytest.mark.parametrize("spec", BACKENDS, indirect=True)
def test_watch_names_calls_back_once_when_all_gone(repo, root):
    a, b = f"{root}/w/a", f"{root}/w/b"
    repo.add(a, "1")
    repo.add(b, "2")
    calls = []
    thread = repo.watch_names([a, b], lambda: calls.append(time.monotonic()), poll_frequency=0.05)
    assert thread.daemon
    repo.delete(a)
    time.sleep(0.3)
    assert calls == []  # b still there
    repo.delete(b)
    thread.join(timeout=5)
    assert len(calls) == 1
    with pytest.raises(TimeoutError, match=f"{root}/w/missing"):
        repo.watch_names([f"{root}/w/missing"], lambda: None, wait_timeout=0.2)


@pytest.mark.parametrize("spec", BACKENDS, indirect=True)
def test_ttl_entry_is_kept_alive_by_owner(repo, spec, root):
    # etcd rounds leases up to its minimum (2 s here); wait well past the TTL.
    ttl, wait = (1, 3.5) if spec.startswith("etcd3") else (0.2, 0.7)
    repo.add(f"{root}/alive", "v", keepalive_ttl=ttl)
    time.sleep(wait)
    assert repo.get(f"{root}/alive") == "v"


@pytest.mark.parametrize("spec", BACKENDS, indirect=True)
def test_bad_keys_values_and_closed_repo(repo, root):
    for bad in ["", "/", "a//b", "a/../b", "a/.hidden"]:
        with pytest.raises(ValueError, match="name-resolve key"):
            repo.add(bad, "v")
    with pytest.raises(TypeError, match="json.dumps"):
        repo.add(f"{root}/d", {"a": 1})
    with pytest.raises(ValueError, match="keepalive_ttl"):
        repo.add(f"{root}/d", "v", keepalive_ttl=0)
    repo.close()
    with pytest.raises(RuntimeError, match="closed"):
        repo.get(f"{root}/d")


# ---- module-level API and configuration ---------------------------------------


def test_module_api_follows_reconfigure(tmp_path):
    first = name_resolve.reconfigure("memory")
    name_resolve.add("m/a", "1")
    assert name_resolve.get("m/a") == "1"
    name_resolve.reconfigure("file", root=str(tmp_path / "nr"))
    assert first.closed
    with pytest.raises(NameEntryNotFoundError):
        name_resolve.get("m/a")
    key = name_resolve.add_subentry("m/s", "x")
    assert name_resolve.find_subtree("m") == [key]
    assert name_resolve.get_subtree("m") == ["x"]
    assert name_resolve.wait(key, timeout=1) == "x"
    name_resolve.reset()
    assert name_resolve.find_subtree("m") == []
    name_resolve.add("m/b", "1")
    name_resolve.delete("m/b")
    name_resolve.add("m/c/d", "1")
    name_resolve.clear_subtree("m")
    assert name_resolve.find_subtree("m") == []
    name_resolve.reconfigure("memory")


def test_unknown_backend_lists_valid_ones():
    with pytest.raises(ValueError, match="memory, file, etcd3"):
        name_resolve.reconfigure("redis")
    with pytest.raises(ValueError, match="REALHF_NAME_RESOLVE"):
        name_resolve.from_spec("redis://x:1")
    with pytest.raises(ValueError, match="absolute"):
        name_resolve.from_spec("file://relative/path")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"address": "localhost"},
        {"address": "localhost:http"},
        {"address": "localhost:99999"},
        {"address": ":2379"},
        {"host": "a:b", "port": 1},
        {"host": "localhost", "port": "x"},
    ],
)
def test_malformed_etcd_address(kwargs):
    with pytest.raises(ValueError, match="etcd"):
        name_resolve.make_repository("etcd3", **kwargs)


def test_unreachable_etcd_fails_fast_naming_host_port():
    (port,) = network.find_multiple_free_ports(1)  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        name_resolve.make_repository("etcd3", host="127.0.0.1", port=port, timeout=2.0)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("address", ["localhost", "ray://host:port", "h:99999", ":6379"])
def test_malformed_ray_address(address):
    with pytest.raises(ValueError, match="Ray GCS address"):
        name_resolve.make_repository("ray", address=address)


@pytest.mark.ray
def test_unreachable_ray_gcs_fails_fast_naming_address():
    if not ray_cluster.ray_importable():
        pytest.skip("ray is not installed (pip install ray)")
    (port,) = network.find_multiple_free_ports(1)  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        name_resolve.from_spec(f"ray://127.0.0.1:{port}")
    assert time.monotonic() - t0 < 5


@pytest.mark.ray
@pytest.mark.slow
def test_ray_lock_abandoned_by_a_dead_holder_is_broken(ray_gcs, root):
    # A process that died between taking a key's lock and releasing it must not
    # block that key forever: the lock expires after LOCK_TTL.
    from realhf.base.name_resolve import ray_kv

    repo = name_resolve.from_spec(f"ray://{ray_gcs}")
    try:
        key = f"{root}/k"
        repo.add(key, "v1")
        stale = {"owner": "dead", "expires_at": time.time() - 1}
        assert repo._put_raw(key, stale, False, ray_kv.LOCK_NAMESPACE)
        t0 = time.monotonic()
        repo.add(key, "v2", replace=True)
        assert time.monotonic() - t0 < 1
        assert repo.get(key) == "v2"
        assert repo._get_raw(key, ray_kv.LOCK_NAMESPACE) is None
        repo.clear_subtree(root)
    finally:
        repo.close()


def test_file_backend_unwritable_root_names_path(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    bad = blocker / "name_resolve"
    # Fails for root too: no one can create a directory under a regular file.
    with pytest.raises(PermissionError, match=str(bad)):
        name_resolve.make_repository("file", root=str(bad))


def test_default_backend_is_file_under_fileroot_and_env_overrides(tmp_path):
    code = (
        "from realhf.base import name_resolve as nr\n"
        "nr.add('d/k', 'v', delete_on_exit=False)\n"
        "print(type(nr.repository()).__name__, getattr(nr.repository(), 'root', '-'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != name_resolve.ENV_VAR}
    env["REALHF_FILEROOT"] = str(tmp_path / "root")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [
        "FileNameRecordRepository",
        str(tmp_path / "root" / "name_resolve"),
    ]
    assert (tmp_path / "root" / "name_resolve" / "d" / "k" / ".entry").exists()
    env[name_resolve.ENV_VAR] = f"file://{tmp_path / 'other'}"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["FileNameRecordRepository", str(tmp_path / "other")]
    env[name_resolve.ENV_VAR] = "memory"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split()[0] == "MemoryNameRecordRepository"


def test_forked_child_exit_keeps_parent_entries(tmp_path):
    code = textwrap.dedent(
        """
        import os, sys
        from realhf.base import name_resolve as nr
        nr.reconfigure("file", root=sys.argv[1])
        nr.add("p/k", "parent's")
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # runs atexit handlers inherited from the parent
        os.waitpid(pid, 0)
        print(nr.get("p/k"))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "parent's"
    # ...and the parent's own clean exit removed it.
    assert name_resolve.make_repository("file", root=str(tmp_path)).find_subtree("p") == []


def test_file_entries_expire_for_readers_and_are_overwritable(tmp_path):
    # A writer that stops refreshing (closed without reset) leaves an expired
    # entry on disk; readers must treat it as absent and add() may reuse it.
    a = name_resolve.make_repository("file", root=str(tmp_path))
    a.add("x/k", "old", keepalive_ttl=0.2, delete_on_exit=False)
    a.close()
    b = name_resolve.make_repository("file", root=str(tmp_path))
    time.sleep(0.35)
    assert (tmp_path / "x" / "k" / ".entry").exists()
    with pytest.raises(NameEntryNotFoundError):
        b.get("x/k")
    assert b.find_subtree("x") == []
    b.add("x/k", "new")
    assert b.get("x/k") == "new"
    b.close()


def _files_under(path):
    return sorted(
        os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs
    )


def test_file_backend_leaves_no_lock_behind_and_keeps_its_files_private(tmp_path):
    """A lock file lives as long as its key: 200 keys added and deleted leave no file (one
    lock file per key, never removed, used to leave 200), and what the backend makes is
    its user's alone (lock files were 0666: any local user could hold one)."""
    root = tmp_path / "nr"
    repo = name_resolve.make_repository("file", root=str(root))
    try:
        assert os.stat(root).st_mode & 0o777 == 0o700
        repo.add("run/trial/kept", "v")
        for i in range(200):
            repo.add(f"run/trial/worker/{i}", "addr")
            repo.delete(f"run/trial/worker/{i}")
            repo.add("run/trial/again", "x", keepalive_ttl=30)  # refreshes lock it too
            repo.delete("run/trial/again")
        assert _files_under(root) == ["run/trial/kept/.entry", "run/trial/kept/.lock"]
        key_dir = root / "run" / "trial" / "kept"
        assert os.stat(key_dir / ".lock").st_mode & 0o777 == 0o600
        for d in (root / "run", root / "run" / "trial", key_dir):
            assert os.stat(d).st_mode & 0o777 == 0o700, d
        # A refresh or delete of a key that is gone leaves nothing behind either...
        with pytest.raises(NameEntryNotFoundError):
            repo.delete("run/trial/never")
        assert not repo._refresh("run/trial/never", "token", 1.0)
        # ...and clearing a subtree takes its locks with it.
        repo.clear_subtree("run")
        assert _files_under(root) == []
    finally:
        repo.close()


def test_file_backend_remakes_a_parent_another_process_pruned_meanwhile(tmp_path, monkeypatch):
    """Seen under load: a process made ``shared/`` for ``shared/key``'s lock, another one
    releasing its own key pruned the empty ``shared/``, and making ``key`` in it failed."""
    repo = name_resolve.make_repository("file", root=str(tmp_path / "nr"))
    real_mkdir, pruned = os.mkdir, []

    def mkdir(d, mode=0o777):
        parent = os.path.dirname(d)
        if d.endswith(os.path.join("shared", "key")) and not pruned and os.path.isdir(parent):
            pruned.append(parent)
            os.rmdir(parent)  # the other process's _prune, between our two mkdirs
        return real_mkdir(d, mode)

    monkeypatch.setattr(os, "mkdir", mkdir)
    try:
        with repo._locked("shared/key"):
            assert os.path.isdir(tmp_path / "nr" / "shared" / "key")
        assert pruned
    finally:
        repo.close()


@pytest.mark.slow
def test_file_backend_lock_stays_exclusive_while_its_file_comes_and_goes(tmp_path):
    """Every release of a key with no entry removes its lock file; processes that opened
    the removed file meanwhile must not hold it alongside the one that made the next
    file. Three processes increment a counter under the lock 150 times each: a lost
    update would show two holders."""
    counter = tmp_path / "counter"
    counter.write_text("0")
    code = textwrap.dedent(
        """
        import sys, time
        from realhf.base import name_resolve
        repo = name_resolve.make_repository("file", root=sys.argv[1])
        for _ in range(150):
            with repo._locked("shared/key"):
                with open(sys.argv[2]) as f:
                    n = int(f.read())
                time.sleep(0.0005)
                with open(sys.argv[2], "w") as f:
                    f.write(str(n + 1))
        """
    )
    args = [sys.executable, "-c", code, str(tmp_path / "nr"), str(counter)]
    procs = [subprocess.Popen(args, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    assert int(counter.read_text()) == 450
    assert _files_under(tmp_path / "nr") == []


@pytest.mark.slow
def test_file_backend_a_hung_lock_holder_blocks_only_its_key(tmp_path, monkeypatch):
    """A process stopped (SIGSTOP) while holding a key's lock: other keys' adds and
    keepalives go on (a tree-wide lock froze every process's keepalives, so live workers
    read as LOST); the held key fails after LOCK_WAIT naming the key, not forever."""
    from realhf.base.name_resolve import file as file_backend

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import os, signal, sys
                from realhf.base import name_resolve
                repo = name_resolve.make_repository("file", root={str(tmp_path)!r})
                with repo._locked("stuck/key"):
                    print("holding", flush=True)
                    os.kill(os.getpid(), signal.SIGSTOP)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        repo = name_resolve.make_repository("file", root=str(tmp_path))
        t = time.monotonic()
        repo.add("other/key", "v", keepalive_ttl=0.6)
        time.sleep(1.5)  # refreshed every ttl/3 meanwhile
        assert repo.get("other/key") == "v" and time.monotonic() - t < 5
        monkeypatch.setattr(file_backend, "LOCK_WAIT", 0.3)
        with pytest.raises(TimeoutError, match="'stuck/key'.*held its lock"):
            repo.add("stuck/key", "v")
        repo.close()
    finally:
        holder.kill()
        holder.wait()


# ---- several processes --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("spec", MULTIPROC_BACKENDS, indirect=True)
def test_ttl_entry_disappears_after_owner_is_killed(repo, spec, root):
    ttl = 1
    proc = _child(
        spec,
        """
        repo.add(args[0], "alive", keepalive_ttl=float(args[1]))
        repo.add(args[0] + "_nottl", "stays")
        print("READY", flush=True)
        time.sleep(60)
        """,
        f"{root}/ttl",
        str(ttl),
    )
    try:
        _wait_line(proc, "READY")
        # Outlive the TTL once to show the child's keepalive works...
        time.sleep(ttl + 1.2)
        assert repo.get(f"{root}/ttl") == "alive"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.kill()
    # ...then it must vanish within about the TTL (etcd rounds leases up to
    # 2 s and checks expiry every 0.5 s).
    limit = ttl + 0.5 if spec.startswith(("file", "ray")) else 2 + 1.5
    elapsed = _gone_within(repo, f"{root}/ttl", limit + 2)
    assert elapsed is not None and elapsed <= limit, elapsed
    # SIGKILL skips atexit, so an entry without TTL survives its owner.
    assert repo.get(f"{root}/ttl_nottl") == "stays"
    repo.clear_subtree(root)


@pytest.mark.slow
@pytest.mark.parametrize("spec", MULTIPROC_BACKENDS, indirect=True)
def test_clean_exit_removes_delete_on_exit_entries(repo, spec, root):
    # The child uses the module-level API, configured by the environment
    # variable as a launched worker would be, and exits normally: atexit
    # must remove its delete_on_exit entries and keep the others.
    proc = _child(
        spec,
        """
        import os
        os.environ[name_resolve.ENV_VAR] = sys.argv[1]
        name_resolve.add(args[0] + "/tmp", "x")
        name_resolve.add(args[0] + "/ttl", "x", keepalive_ttl=30)
        name_resolve.add(args[0] + "/keep", "y", delete_on_exit=False)
        """,
        root,
    )
    assert proc.wait(timeout=20) == 0, proc.stderr.read()
    assert repo.find_subtree(root) == [f"{root}/keep"]
    repo.clear_subtree(root)


@pytest.mark.slow
@pytest.mark.parametrize("spec", MULTIPROC_BACKENDS, indirect=True)
def test_concurrent_subentries_from_many_processes(repo, spec, root):
    n_procs, per_proc = 4, 5
    procs = [
        _child(
            spec,
            """
            for i in range(int(args[2])):
                repo.add_subentry(args[0], f"{args[1]}-{i}", delete_on_exit=False)
            repo.close()
            """,
            f"{root}/sub",
            str(p),
            str(per_proc),
        )
        for p in range(n_procs)
    ]
    for p in procs:
        assert p.wait(timeout=30) == 0, p.stderr.read()
    values = repo.get_subtree(f"{root}/sub")
    assert sorted(values) == sorted(f"{p}-{i}" for p in range(n_procs) for i in range(per_proc))
    repo.clear_subtree(root)


@pytest.mark.slow
@pytest.mark.parametrize("spec", MULTIPROC_BACKENDS, indirect=True)
def test_add_race_has_exactly_one_winner(repo, spec, root):
    n_procs = 4
    go = f"{root}/go"
    procs = [
        _child(
            spec,
            """
            repo.wait(args[1], timeout=20, poll_frequency=0.005)
            try:
                repo.add(args[0], args[2], delete_on_exit=False)
                print("WON", flush=True)
            except name_resolve.NameEntryExistsError:
                print("LOST", flush=True)
            repo.close()
            """,
            f"{root}/leader",
            go,
            f"proc{p}",
        )
        for p in range(n_procs)
    ]
    time.sleep(0.5)  # let every child reach its wait()
    repo.add(go, "1")
    outcomes = []
    for p in procs:
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0, err
        outcomes.append(out.strip())
    assert sorted(outcomes) == ["LOST"] * (n_procs - 1) + ["WON"]
    assert repo.get(f"{root}/leader") == f"proc{outcomes.index('WON')}"
    repo.clear_subtree(root)


def test_a_keepalive_that_runs_late_is_logged_with_the_main_threads_stack(caplog):
    from realhf.base.name_resolve import _repository as repo

    now = time.monotonic()
    on_time = repo._Owned(token=None, delete_on_exit=True, ttl=6.0, next_refresh=now - 1.5)
    repo._warn_if_late("k/on-time", on_time, now)
    assert "late" not in caplog.text  # within a third of the TTL: the schedule's slack
    late = repo._Owned(token=None, delete_on_exit=True, ttl=6.0, next_refresh=now - 3.0)
    repo._warn_if_late("k/late", late, now)
    assert "'k/late' ran 3.0s late (TTL 6s)" in caplog.text
    # the main thread's stack says what the process was busy with
    assert "test_a_keepalive_that_runs_late_is_logged" in caplog.text
