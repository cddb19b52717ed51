"""Leaving without the interpreter's teardown still does what an exit must."""

import subprocess
import sys

PROGRAM = """
import atexit, sys, threading, time
from gpipe_cli.quick_exit import exit_now
atexit.register(lambda: print("exit handler ran"))
worker = threading.Thread(target=lambda: (time.sleep(0.5), print("thread finished")))
worker.start()
print("buffered line", end="")
sys.stderr.write("error line")
exit_now(3)
"""


def test_exit_now_keeps_the_code_joins_threads_runs_handlers_and_flushes_output():
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3
    assert done.stdout == "buffered linethread finished\nexit handler ran\n"
    assert done.stderr == "error line"
