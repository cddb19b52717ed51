"""Slurm: the node list syntax, defaults from an srun step that flags override, two fake nodes training K=2."""

import copy
import json
import os
import subprocess
import sys

import pytest

from gpipe_cli.errors import UserError
from gpipe_cli.launch import launch_options
from gpipe_cli.launch.slurm import expand_nodelist, first_host, slurm_step
from tests.multiproc import free_port
from tests.train.recipes import TINY_AMOEBANET, write


def step_env(node: int, nodes: int = 2, nodelist: str = "node[07-08]", port: int = 29600, **extra: str) -> dict:
    """The variables srun sets in each task of `srun --nodes N --ntasks-per-node 1` (as in docs/gpus-and-nodes.md)."""
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes),
           "SLURM_JOB_NODELIST": nodelist, "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_NODELIST": nodelist,
           "SLURM_STEP_NUM_TASKS": str(nodes), "SLURM_NTASKS": str(nodes), "SLURM_NODEID": str(node),
           "SLURM_PROCID": str(node), "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0", "MASTER_PORT": str(port)}
    env.update(extra)
    return env


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu1,gpu3", ["gpu1", "gpu3"]),
    ("a[1-2]-b[08-09],c", ["a1-b08", "a1-b09", "a2-b08", "a2-b09", "c"]),
    ("localhost,localhost", ["localhost", "localhost"]),
])
def test_compressed_node_lists_expand_as_slurm_writes_them(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_a_node_list_that_cannot_be_read_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "")  # no scontrol
    with pytest.raises(UserError, match="--rdzv-endpoint"):
        first_host("node[3-1]")


def test_an_srun_step_gives_nodes_node_rank_endpoint_and_job_id(monkeypatch):
    monkeypatch.setenv("PATH", "")
    options = launch_options(environ=step_env(1))
    assert (options.nnodes, options.node_rank, options.rdzv_endpoint) == ("2", 1, "node07:29600")
    assert options.rdzv_id is not None and "4242" in options.rdzv_id


def test_flags_given_win_over_slurm(monkeypatch):
    monkeypatch.setenv("PATH", "")
    options = launch_options(rdzv_endpoint="head:1234", node_rank=0, environ=step_env(1))
    assert (options.nnodes, options.node_rank, options.rdzv_endpoint) == ("2", 0, "head:1234")
    by_hand = launch_options(nnodes="1", environ=step_env(1))  # --nnodes: the layout is the user's
    assert (by_hand.nnodes, by_hand.node_rank, by_hand.rdzv_endpoint) == ("1", None, None)
    c10d = launch_options(rdzv_backend="c10d", environ=step_env(1))
    assert c10d.node_rank is None and c10d.rdzv_backend == "c10d"


def test_outside_a_multi_node_srun_step_nothing_changes():
    batch_script = {k: v for k, v in step_env(0).items() if not k.startswith("SLURM_STEP")}
    assert slurm_step(batch_script) is None
    assert slurm_step(step_env(0, nodes=1, nodelist="node1")) is None
    assert slurm_step({}) is None


def test_more_than_one_task_per_node_is_refused():
    with pytest.raises(UserError, match="one task per node"):
        launch_options(environ=step_env(0, SLURM_STEP_NUM_TASKS="8"))


@pytest.mark.slow
def test_two_fake_slurm_nodes_train_k2_with_the_same_command(tmp_path):
    recipe = copy.deepcopy(TINY_AMOEBANET)
    recipe["train"]["steps"] = 2
    recipe["eval"] = {}
    path = write(tmp_path, recipe)
    port, out = free_port(), tmp_path / "run"
    command = [sys.executable, "-m", "gpipe_cli.cli", "train", str(path), "--plain", "--threads", "1",
               "--output-dir", str(out)]  # the same on both nodes, no node flags
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not os.path.exists(os.path.join(p, "scontrol")))
    nodes = [subprocess.Popen(command, env={**env, **step_env(node, nodelist="localhost,localhost", port=port)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 2 and all(isinstance(loss, float) for loss in losses)
