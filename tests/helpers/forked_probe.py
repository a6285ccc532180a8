"""Run by the fork server's tests as ``python -m forked_probe OUT.json CODE [sleep S]``:
writes what the process sees of itself to OUT.json, prints a line, exits with CODE
(or sleeps S seconds first)."""

import json
import os
import sys
import time

import numpy as np

if __name__ == "__main__":
    out, code = sys.argv[1], int(sys.argv[2])
    with open(out + ".tmp", "w") as f:  # renamed when complete: tests poll for OUT
        json.dump(
            {
                "argv": sys.argv[1:],
                "pid": os.getpid(),
                "ppid": os.getppid(),
                "sid": os.getsid(0),
                "pgid": os.getpgid(0),
                "env_x": os.environ.get("REALHF_PROBE_X"),
                "parent_env": os.environ.get("REALHF_PARENT_PID"),
                "main": __name__,
                "torch_preloaded": "torch" in sys.modules,
                "np_random": float(np.random.random()),
                "stdin": os.read(0, 10).decode(),
                "cmdline": open("/proc/self/cmdline").read().strip("\0"),
            },
            f,
        )
    os.replace(out + ".tmp", out)
    print("probe says hello", flush=True)
    print("probe warns", file=sys.stderr, flush=True)
    if len(sys.argv) > 4 and sys.argv[3] == "sleep":
        print("probe is sleeping")  # not flushed: seen in the log only if unbuffered
        time.sleep(float(sys.argv[4]))
    sys.exit(code)
