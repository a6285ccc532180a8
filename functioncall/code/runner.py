"""Test-case runner executed *inside* the sandbox (standard library only).

It is copied next to the program and started as

    python -I runner.py CODE_DIR stdio [--block-sockets]
    python -I runner.py CODE_DIR call FN_NAME [--block-sockets]

``stdio``: runs ``CODE_DIR/program.py`` as ``__main__``; the test input arrives on
stdin and the program's stdout is the answer.

``call``: loads the program as a module (so a ``__main__`` block does not run),
finds ``FN_NAME`` (a top-level function, or a method of ``class Solution`` as in
LeetCode-style tasks), calls it with the JSON list of arguments in
``CODE_DIR/args.json`` and writes the JSON-encoded return value to the original
stdout. Whatever the program prints goes to stderr, so it cannot be mistaken for
the result.

``--block-sockets`` (the fallback sandbox mode, which has no network namespace)
installs a seccomp filter that makes socket(2) fail, and replaces Python's socket
constructors with functions that raise, before the program runs.
"""

import json
import os
import sys
import traceback

# seccomp-BPF: the kernel refuses socket(2) whatever way the program calls it
# (ctypes included), and io_uring, which can open sockets too. socketpair(2)
# stays allowed: it reaches nothing outside and multiprocessing uses it.
_ARCHS = {  # machine: (AUDIT_ARCH_*, __NR_socket)
    "x86_64": (0xC000003E, 41),
    "aarch64": (0xC00000B7, 198),
}
_NR_IO_URING_SETUP = 425  # the same on both
_RET_ALLOW = 0x7FFF0000
_RET_EACCES = 0x00050000 | 13


def _install_seccomp():
    import ctypes
    import platform

    machine = platform.machine()
    if machine not in _ARCHS:
        return False
    arch, nr_socket = _ARCHS[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06

    def insn(code, jt, jf, k):
        return (code, jt, jf, k)

    prog = [
        insn(ld, 0, 0, 4),  # 0: A = arch
        insn(jeq, 1, 0, arch),  # 1: native? go on : deny (i386 int 0x80 too)
        insn(ret, 0, 0, _RET_EACCES),  # 2
        insn(ld, 0, 0, 0),  # 3: A = syscall nr
        insn(jge, 3, 0, 0x40000000),  # 4: x32 ABI -> deny
        insn(jeq, 2, 0, nr_socket),  # 5: socket -> deny
        insn(jeq, 1, 0, _NR_IO_URING_SETUP),  # 6: io_uring_setup -> deny
        insn(ret, 0, 0, _RET_ALLOW),  # 7
        insn(ret, 0, 0, _RET_EACCES),  # 8
    ]

    class SockFilter(ctypes.Structure):
        _fields_ = [
            ("code", ctypes.c_uint16),
            ("jt", ctypes.c_uint8),
            ("jf", ctypes.c_uint8),
            ("k", ctypes.c_uint32),
        ]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]

    filters = (SockFilter * len(prog))(*[SockFilter(*i) for i in prog])
    fprog = SockFprog(len(prog), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    # The kernel accepts a filter from a process without CAP_SYS_ADMIN only
    # once no_new_privs is set (the sandbox uid has no capabilities).  The
    # filter is inherited by every child and cannot be removed.
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")
    return True


def block_sockets():
    """Refuse sockets in the kernel (seccomp); where no filter exists for this
    machine, replace Python's socket constructors instead (weaker: ctypes gets by)."""
    if _install_seccomp():
        return
    print(
        "runner: no seccomp filter for this machine; sockets blocked in Python only",
        file=sys.stderr,
    )
    import _socket
    import socket

    def refuse(*args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")

    for mod in (socket, _socket):
        for name in (
            "socket",
            "socketpair",
            "fromfd",
            "create_connection",
            "create_server",
            "getaddrinfo",
            "gethostbyname",
            "gethostbyname_ex",
        ):
            if hasattr(mod, name):
                setattr(mod, name, refuse)


def to_jsonable(value):
    """Tuples become lists, sets sorted lists, so results compare like the dataset's JSON."""
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((to_jsonable(v) for v in value), key=repr)
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    return value


def main(argv):
    code_dir, mode = argv[1], argv[2]
    if "--block-sockets" in argv:
        block_sockets()
    program = os.path.join(code_dir, "program.py")
    with open(program, encoding="utf-8") as f:
        source = f.read()
    # Contest solutions often recurse deeply (DFS over 1e5 nodes); the default
    # limit of 1000 would fail correct programs.  A real C-stack overflow only
    # crashes this sandboxed process.
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 100000))
    if mode == "stdio":
        namespace = {"__name__": "__main__", "__file__": program, "__builtins__": __builtins__}
        exec(compile(source, program, "exec"), namespace)
        sys.stdout.flush()
        return 0
    if mode != "call":
        print(f"runner: unknown mode {mode!r}", file=sys.stderr)
        return 2
    fn_name = argv[3]
    with open(os.path.join(code_dir, "args.json"), encoding="utf-8") as f:
        args = json.load(f)
    result_fd = os.dup(1)
    os.dup2(2, 1)  # the program's prints go to stderr
    namespace = {"__name__": "solution", "__file__": program, "__builtins__": __builtins__}
    exec(compile(source, program, "exec"), namespace)
    fn = namespace.get(fn_name)
    if not callable(fn) and isinstance(namespace.get("Solution"), type):
        fn = getattr(namespace["Solution"](), fn_name, None)
    if not callable(fn):
        print(f"runner: the program defines no function {fn_name!r}", file=sys.stderr)
        return 3
    result = fn(*args)
    sys.stdout.flush()
    with os.fdopen(result_fd, "w", encoding="utf-8") as out:
        out.write(json.dumps(to_jsonable(result)))
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    # os._exit: atexit hooks, __del__ methods and non-daemon threads of the
    # program must not run (print, or hang until the wall timeout) after the
    # result has been written.
    os._exit(code)
