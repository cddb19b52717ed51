"""Slurm: the node list syntax, defaults from an srun step that flags override, a port per job, the dry run, two
fake nodes training K=2."""

import copy
import json
import os
import subprocess
import sys

import pytest

from gpipe_cli.cli import run
from gpipe_cli.errors import UserError
from gpipe_cli.launch import launch_options
from gpipe_cli.launch.slurm import PORT_BASE, PORT_SPAN, expand_nodelist, first_host, job_port, slurm_step
from tests.multiproc import free_port
from tests.train.recipes import TINY_AMOEBANET, write


def step_env(node: int, nodes: int = 2, nodelist: str = "node[07-08]", port: int | None = 29600, job: str = "4242",
             **extra: str) -> dict:
    """The variables srun sets in each task of `srun --nodes N --ntasks-per-node 1` (as in docs/gpus-and-nodes.md);
    `port`: the script's MASTER_PORT (None: not set)."""
    env = {"SLURM_JOB_ID": job, "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes),
           "SLURM_JOB_NODELIST": nodelist, "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_NODELIST": nodelist,
           "SLURM_STEP_NUM_TASKS": str(nodes), "SLURM_NTASKS": str(nodes), "SLURM_NODEID": str(node),
           "SLURM_PROCID": str(node), "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0"}
    if port is not None:
        env["MASTER_PORT"] = str(port)
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


def test_the_port_comes_from_the_job_id_unless_master_port_is_set(monkeypatch):
    monkeypatch.setenv("PATH", "")
    ports = {}
    for job in ("4242", "4243", "987654321"):
        nodes = [launch_options(environ=step_env(node, port=None, job=job)) for node in (0, 1)]
        assert nodes[0].rdzv_endpoint == nodes[1].rdzv_endpoint  # every node of a job meets at one place
        host, _, port = str(nodes[0].rdzv_endpoint).rpartition(":")
        assert host == "node07" and PORT_BASE <= int(port) < PORT_BASE + PORT_SPAN < 32768  # not ephemeral
        ports[job] = int(port)
    assert len(set(ports.values())) == 3  # two jobs on one first node no longer meet at one port
    assert ports["4242"] == job_port("4242") == PORT_BASE + 4242  # stable: the same in every process
    assert PORT_BASE <= job_port("4242_7") < PORT_BASE + PORT_SPAN  # an id that is not a number
    assert launch_options(environ=step_env(0, port=29600)).rdzv_endpoint == "node07:29600"  # the script's own


def test_a_master_port_that_is_no_number_is_one_line(monkeypatch):
    monkeypatch.setenv("PATH", "")
    with pytest.raises(UserError, match="^MASTER_PORT is not a number"):
        launch_options(environ=step_env(0, MASTER_PORT="auto"))


def _in_step(monkeypatch, env: dict) -> None:
    """Make this process a task of a fake srun step (no scontrol: the node list is read here)."""
    for name in [n for n in os.environ if n.startswith("SLURM_") or n == "MASTER_PORT"]:
        monkeypatch.delenv(name)
    for name, value in {**env, "PATH": ""}.items():
        monkeypatch.setenv(name, value)


def _nothing_starts(*args, **kwargs):
    raise AssertionError("--dry-run started the ranks")


@pytest.mark.parametrize("node", [0, 1])
def test_dry_run_prints_the_rendezvous_and_the_torchrun_command_and_starts_nothing(tmp_path, monkeypatch, capsys,
                                                                                   node):
    recipe = write(tmp_path, {**TINY_AMOEBANET, "pipeline": {"partitions": 2, "data_parallel": 2}})
    _in_step(monkeypatch, step_env(node, port=None))
    monkeypatch.setattr("gpipe_cli.train.run.launch", _nothing_starts)
    monkeypatch.chdir(tmp_path)
    assert run(["train", str(recipe), "--set", "train.steps=2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    port = PORT_BASE + 4242
    assert "nothing is started" in out and "job 4242" in out
    assert f"host node07, port {port} (from SLURM_JOB_ID 4242" in out
    assert "nodes:          2" in out and "4 (K=2 x D=2), 2 per node" in out
    assert f"node rank {node}, ranks {2 * node} to {2 * node + 1}" in out
    command = next(line for line in out.splitlines() if "torchrun:" in line).split("torchrun:", 1)[1].split()
    assert command[command.index("torchrun"):] == [
        "torchrun", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node), "--rdzv-backend", "static",
        "--rdzv-endpoint", f"node07:{port}", "--rdzv-id", "slurm-4242", "-m", "gpipe_cli", "train", str(recipe),
        "--set", "train.steps=2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]  # no run directory


def _alone(tmp_path, monkeypatch, capsys, *flags) -> tuple:
    """The recipe and what `train --dry-run` with `flags` prints outside Slurm."""
    recipe = write(tmp_path, TINY_AMOEBANET)
    _in_step(monkeypatch, {})
    monkeypatch.setattr("gpipe_cli.train.run.launch", _nothing_starts)
    assert run(["train", str(recipe), *flags, "--dry-run"]) == 0
    return recipe, capsys.readouterr().out


def test_dry_run_outside_slurm_says_the_node_runs_alone(tmp_path, monkeypatch, capsys):
    recipe, out = _alone(tmp_path, monkeypatch, capsys, "--threads", "3")
    assert "this node alone" in out and "Slurm" not in out
    assert f"OMP_NUM_THREADS=3 GPIPE_THREADS=3 torchrun --standalone --nproc-per-node 2 -m gpipe_cli train {recipe}" \
        in out


def test_dry_run_of_one_node_at_a_given_endpoint_shows_that_endpoint(tmp_path, monkeypatch, capsys):
    # It said "id None" and gave `torchrun --standalone`, where the launch would meet at the endpoint.
    recipe, out = _alone(tmp_path, monkeypatch, capsys, "--rdzv-endpoint", "localhost:29500")
    assert "rendezvous:     static, host localhost, port 29500, id a fresh one chosen at launch" in out
    assert f"torchrun --nnodes 1 --nproc-per-node 2 --node-rank 0 --rdzv-backend static --rdzv-endpoint " \
           f"localhost:29500 -m gpipe_cli train {recipe}" in out and "None" not in out


def test_dry_run_warns_of_ranks_sharing_the_cores_as_a_launch_does(tmp_path, monkeypatch, capsys):
    recipe = write(tmp_path, TINY_AMOEBANET)  # K=2
    _in_step(monkeypatch, {})
    monkeypatch.setattr("gpipe_cli.train.run.launch", _nothing_starts)
    monkeypatch.setattr("gpipe_cli.contention.usable_cores", lambda: 1)
    assert run(["train", str(recipe), "--dry-run"]) == 0
    assert "warning: 2 ranks x 1 thread on 1 CPU core (oversubscribed)" in capsys.readouterr().out


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


@pytest.mark.parametrize("sets,message", [
    (["pipeline.backend=nccl"], ": --set pipeline.backend: nccl needs a CUDA GPU"),
    (["train.device=cuda"], ": --set train.device: cuda needs a CUDA GPU"),
    (["data.batch_size=4096", "pipeline.checkpoint=never"], "the plan does not fit this machine"),
])
def test_a_dry_run_refuses_what_a_launch_would(tmp_path, monkeypatch, capsys, sets, message):
    # It exited 0 for launches that `gpipe train` refuses, so it could not tell whether a job would start.
    import torch

    if "CUDA" in message and torch.cuda.is_available():
        pytest.skip("this machine has the GPU the setting needs")
    recipe = write(tmp_path, TINY_AMOEBANET)
    _in_step(monkeypatch, {})
    monkeypatch.setattr("gpipe_cli.train.run.launch", _nothing_starts)
    monkeypatch.setattr("gpipe_cli.memory_model.available_bytes", lambda device: 2**26)  # 64 MiB of RAM
    assert run(["train", str(recipe), *(item for s in sets for item in ("--set", s)), "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "nothing is started" not in captured.out, captured


@pytest.mark.parametrize(("env", "flags", "line"), [
    # A node index from Slurm was called --node-rank, a flag never typed.
    (step_env(5, port=None), [],
     "error: SLURM_NODEID 5: must be >= 0 and < the number of nodes, 2 from SLURM_STEP_NUM_NODES"),
    (step_env(1, port=None), ["--node-rank", "7"],
     "error: --node-rank: must be >= 0 and < the number of nodes, 2 from SLURM_STEP_NUM_NODES (got 7)"),
    # The 3 nodes came from Slurm; the line did not say so.
    (step_env(1, nodes=3, nodelist="node[07-09]", port=None), [],
     "error: the job needs 2 processes, which does not divide over 3 nodes (SLURM_STEP_NUM_NODES, this srun "
     "step's); run the step on a number of nodes that divides 2, e.g. srun --nodes 2"),
    # MASTER_PORT is the job script's variable, not Slurm's.
    (step_env(1, port=None, MASTER_PORT="abc"), [],
     "error: MASTER_PORT is not a number ('abc'): set it to a port from 1 to 65535, or unset it for one derived "
     "from SLURM_JOB_ID"),
    (step_env(1, port=70000), [],
     "error: MASTER_PORT is not a port ('70000'): set it to a port from 1 to 65535, or unset it for one derived "
     "from SLURM_JOB_ID"),
])
def test_a_value_from_slurm_is_named_by_its_variable_and_a_flag_only_when_typed(tmp_path, monkeypatch, capsys, env,
                                                                                  flags, line):
    recipe = write(tmp_path, TINY_AMOEBANET)
    _in_step(monkeypatch, env)
    monkeypatch.setattr("gpipe_cli.train.run.launch", _nothing_starts)
    assert run(["train", str(recipe), *flags, "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [line], captured.err
    if not flags:
        assert "--" not in line.split("; ")[0]  # no flag named for what the user never typed


def test_an_endpoint_from_the_node_list_is_named_by_its_variables_not_by_a_flag(monkeypatch):
    from gpipe_cli.launch.preflight import reach, rendezvous

    monkeypatch.setenv("PATH", "")
    options = launch_options(environ=step_env(1, nodelist="host[0-1].invalid", port=None))
    with pytest.raises(UserError) as caught:
        reach(rendezvous(2, options), lambda line: None)
    text = str(caught.value)
    assert text.startswith(f"the rendezvous endpoint host0.invalid:{PORT_BASE + 4242} (host from "
                           f"SLURM_STEP_NODELIST, port from SLURM_JOB_ID): host0.invalid is not a host name"), text
    assert not text.startswith("--rdzv-endpoint")
    typed = launch_options(rdzv_endpoint="host0.invalid:29500", environ=step_env(1))
    with pytest.raises(UserError, match=r"^--rdzv-endpoint host0\.invalid:29500: host0\.invalid is not a host"):
        reach(rendezvous(2, typed), lambda line: None)


def test_a_device_this_machine_lacks_is_named_as_every_recipe_error_names_a_key(monkeypatch):
    # It lacked the recipe's label, and said "(given by --set ...)" after the line's reason.
    import torch

    from gpipe_cli.launch.preflight import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError) as caught:
        check_device("nccl", "cuda", 2, {"pipeline.backend"}, "r.yaml")
    assert str(caught.value) == ("r.yaml: --set pipeline.backend: nccl needs one GPU per rank, but 2 ranks on this "
                                 "node share 1 GPU; use backend gloo or auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError) as caught:
        check_device("gloo", "cuda", 2, (), "r.yaml")
    assert str(caught.value) == ("r.yaml: train.device: cuda needs a CUDA GPU and this machine has none visible; "
                                 "use device cpu or auto")


def test_ranks_share_the_cores_this_process_may_use_not_the_whole_machine(tmp_path, monkeypatch, capsys):
    # Under `taskset -c 0` (or a Slurm job's share of a large node) each rank was given the machine's cores.
    from gpipe_cli.launch.launcher import LaunchOptions
    from gpipe_cli.launch.preflight import threads_per_rank

    monkeypatch.setattr("os.cpu_count", lambda: 128)
    monkeypatch.setattr("gpipe_cli.contention.usable_cores", lambda: 4)
    assert threads_per_rank(LaunchOptions(), 2) == 2 and threads_per_rank(LaunchOptions(), 8) == 1
    assert threads_per_rank(LaunchOptions(threads=3), 2) == 3
