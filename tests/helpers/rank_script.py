"""``python -m rank_script SCRIPT ARGS``: run SCRIPT as ``python SCRIPT ARGS`` would.

The module form lets realhf's fork server (which forks ``python -m`` command lines) start a
test's rank processes with torch & co. already imported (see :mod:`rank_processes`).
"""

import os
import runpy
import sys

if __name__ == "__main__":
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    sys.path[0] = os.path.dirname(script)  # as for `python SCRIPT`
    runpy.run_path(script, run_name="__main__")
