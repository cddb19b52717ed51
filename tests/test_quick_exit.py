"""Leaving without the interpreter's teardown still does what an exit must."""

import signal
import subprocess
import sys

import pytest

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


# Says, as the command leaves through exit_now (which runs exit handlers), which heavy modules it loaded.
MISTAKE = """
import atexit, sys
atexit.register(lambda: print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy'})))
sys.argv = ['gpipe', *sys.argv[1:]]
from gpipe_cli.entry import main
main()
"""


@pytest.mark.parametrize("case", ["train a missing recipe", "train a misspelt key", "validate a bad recipe",
                                  "bench --partitions 0", "profile-memory --partitions 0"])
def test_mistakes_are_answered_before_torch_is_imported(tmp_path, case):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: typo\npipeline:\n  partitons: 2\n")
    args = {"train a missing recipe": ["train", "nowhere.yaml"],
            "train a misspelt key": ["train", str(recipe)],
            "validate a bad recipe": ["validate", str(recipe)],
            "bench --partitions 0": ["bench", "--partitions", "0"],
            "profile-memory --partitions 0": ["profile-memory", "--partitions", "0"]}[case]
    done = subprocess.run([sys.executable, "-c", MISTAKE, *args], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert done.stdout.strip() == "[]", f"{case}: loaded {done.stdout.strip()} before answering"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]  # nothing written


# K = 0 and M = 0 wherever a command takes them: one wording of the same bounds (profile-memory keeps its own
# largest K, the paper's, and says so).
SAME_LIMITS = [
    (["train", "--set", "pipeline.partitions=0"], "pipeline.partitions: must be >= 1 and <= 65536 (got 0)"),
    (["bench", "--partitions", "0"], "--partitions: must be >= 1 and <= 65536 (got 0)"),
    (["plan", "--devices", "0"], "--devices: must be >= 1 and <= 65536 (got 0)"),
    (["profile-memory", "--partitions", "0"], "--partitions: must list K values >= 1 and <= 128"),
    (["train", "--set", "pipeline.microbatches=0"], "pipeline.microbatches: must be >= 1 and <= 1048576 (got 0)"),
    (["bench", "--microbatches", "0"], "--microbatches: must be >= 1 and <= 1048576 (got 0)"),
    (["profile-memory", "--microbatches", "0"], "--microbatches: must be >= 1 and <= 1048576 (got 0)"),
]


@pytest.mark.parametrize("args, expected", SAME_LIMITS, ids=[" ".join(a) for a, _ in SAME_LIMITS])
def test_a_limit_reads_the_same_in_every_command(args, expected):
    done = subprocess.run([sys.executable, "-c", MISTAKE, *args], capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and expected in lines[0], done.stderr


def test_a_ctrl_c_while_the_entry_point_loads_is_one_line():
    # Between the entry point's first line and its handler's (`interrupts` loading), a Ctrl-C was a traceback.
    code = "import os, signal\nimport gpipe_cli.entry\nos.kill(os.getpid(), signal.SIGINT)\nimport time\ntime.sleep(5)"
    # As from a terminal: a test worker may run with SIGINT ignored, which the command would keep ignoring.
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert (proc.returncode, proc.stdout, proc.stderr) == (130, "", "gpipe: interrupted; nothing was written\n")
