"""The launcher's pure parts (aadet/engine/launch.py): torchrun's and SLURM's variables -> one
worker's place in the run, the launcher choice, and the rendezvous' timeouts and messages (in this
process, on loopback, with 1-2 s timeouts). The multi-process runs: tests/engine/test_multi_machine.py."""
import logging
import re
import socket
import threading
import time

import pytest
import torch

from aadet.engine import launch as L
from aadet.engine import rank_sync

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
         "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]",
         "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- torchrun
def test_torchrun_env_maps_the_variables():
    env = L.torchrun_env(TORCHRUN)
    assert (env.world_size, env.rank, env.local_rank, env.local_world_size) == (8, 5, 1, 4)
    assert (env.machine_rank, env.num_machines) == (1, 2)
    assert env.dist_url == "tcp://10.0.0.1:29500"
    assert env.environ()["GROUP_RANK"] == "1"
    assert L.torchrun_env({}) is None
    assert L.torchrun_env({k: v for k, v in TORCHRUN.items() if k != "RANK"}) is None  # not torchrun
    assert L.torchrun_env(dict(TORCHRUN, MASTER_ADDR="fe80::1")).dist_url == "tcp://[fe80::1]:29500"


def test_torchrun_env_rejects_inconsistent_variables():
    with pytest.raises(L.LaunchConfigError, match="LOCAL_WORLD_SIZE is not set"):
        L.torchrun_env({k: v for k, v in TORCHRUN.items() if k != "LOCAL_WORLD_SIZE"})
    with pytest.raises(L.LaunchConfigError, match="GROUP_RANK=0"):
        L.torchrun_env(dict(TORCHRUN, GROUP_RANK="0"))
    with pytest.raises(L.LaunchConfigError, match="multiple"):
        L.torchrun_env(dict(TORCHRUN, WORLD_SIZE="6"))
    with pytest.raises(L.LaunchConfigError, match="not contiguous"):
        L.torchrun_env(dict(TORCHRUN, LOCAL_RANK="2", GROUP_RANK=""))
    with pytest.raises(L.LaunchConfigError, match="RANK='x' is not an integer"):
        L.torchrun_env(dict(TORCHRUN, RANK="x"))


# ----------------------------------------------------------------------------- SLURM
@pytest.mark.parametrize("nodelist, first", [
    ("gpu[07-08]", "gpu07"), ("node1,node2", "node1"), ("gpu[007-010,12],cpu1", "gpu007"),
    ("rack[1-2]-n[3,5]", "rack1-n3"), ("a-b.example.org", "a-b.example.org"), ("n[2]", "n2"),
])
def test_slurm_first_host(nodelist, first):
    assert L.slurm_first_host(nodelist) == first


def test_slurm_tasks_per_node():
    assert L.slurm_tasks_per_node("8(x2),4") == [8, 8, 4]
    assert L.slurm_tasks_per_node("2") == [2]
    with pytest.raises(L.LaunchConfigError, match="tasks per node"):
        L.slurm_tasks_per_node("8x2")


def test_slurm_env_maps_the_variables():
    env = L.slurm_env(SLURM)
    assert (env.world_size, env.rank, env.local_rank, env.local_world_size) == (8, 5, 1, 4)
    assert env.machine_rank == 1 and env.master_addr == "gpu07"
    assert env.master_port == 10000 + 123456 % 20000
    assert L.slurm_env(dict(SLURM, MASTER_ADDR="10.1.1.1", MASTER_PORT="4000")).dist_url == "tcp://10.1.1.1:4000"
    # The job's variables (sbatch) when srun's are absent.
    job = {k: v for k, v in SLURM.items() if not k.startswith("SLURM_STEP")}
    env = L.slurm_env(dict(job, SLURM_TASKS_PER_NODE="4(x2)", SLURM_JOB_NODELIST="n[1-2]"))
    assert env.master_addr == "n1" and env.local_world_size == 4
    assert L.slurm_env({"SLURM_NTASKS": "8"}) is None


def test_slurm_env_rejects_what_detectron2_cannot_run():
    with pytest.raises(L.LaunchConfigError, match="same number of tasks"):
        L.slurm_env(dict(SLURM, SLURM_STEP_TASKS_PER_NODE="4,3", SLURM_NTASKS="7"))
    with pytest.raises(L.LaunchConfigError, match="block"):  # cyclic distribution
        L.slurm_env(dict(SLURM, SLURM_NODEID="0"))
    with pytest.raises(L.LaunchConfigError, match="TASKS_PER_NODE"):
        L.slurm_env({k: v for k, v in SLURM.items() if k != "SLURM_STEP_TASKS_PER_NODE"})


# ----------------------------------------------------------------------------- the choice
def test_plan_launch_picks_the_launcher():
    assert L.plan_launch("auto", 8, 2, 1, {}) is None  # Detectron2's flags: spawn
    assert L.plan_launch("auto", 8, 1, 0, SLURM) is None  # SLURM is asked for by name
    assert L.plan_launch("auto", 1, 1, 0, TORCHRUN).rank == 5
    assert L.plan_launch("auto", 4, 2, 1, TORCHRUN).rank == 5  # flags that agree are accepted
    assert L.plan_launch("slurm", 0, 1, 0, SLURM).rank == 5
    assert L.plan_launch("spawn", 2, 1, 0, TORCHRUN) is None
    with pytest.raises(L.LaunchConfigError, match="leave those flags out"):
        L.plan_launch("auto", 8, 1, 0, TORCHRUN)
    with pytest.raises(L.LaunchConfigError, match="SLURM_PROCID"):
        L.plan_launch("slurm", 1, 1, 0, {})
    with pytest.raises(L.LaunchConfigError, match="--launcher must be one of"):
        L.plan_launch("mpi", 1, 1, 0, {})


def test_srun_tasks_without_a_launcher_warn(caplog):
    with caplog.at_level(logging.WARNING, logger=L.__name__):
        assert L.plan_launch("auto", 1, 1, 0, SLURM) is None
    assert "--launcher slurm" in caplog.text


def test_launch_rejects_bad_flags():
    with pytest.raises(L.LaunchConfigError, match="--dist-timeout must be > 0"):
        L.launch(print, 2, timeout_s=0, environ={})
    with pytest.raises(L.LaunchConfigError, match="machine 0's address"):
        L.launch(print, 1, num_machines=2, dist_url="auto", environ={})
    with pytest.raises(L.LaunchConfigError, match="torchrun"):
        L.launch(print, 1, num_machines=2, dist_url="env://", environ={})
    with pytest.raises(L.LaunchConfigError, match="--machine-rank must be in"):
        L.launch(print, 1, num_machines=2, machine_rank=2, dist_url="tcp://h:1", environ={})
    calls = []
    L.launch(calls.append, 1, args=("alone",), environ={})  # one process: no torch.distributed
    assert calls == ["alone"]


def test_launch_arguments():
    from detectron2.engine import default_argument_parser

    parser = L.add_launch_arguments(default_argument_parser())
    args = parser.parse_args([])
    assert args.dist_timeout == L.DEFAULT_DIST_TIMEOUT_S == 1800 and args.launcher == "auto"
    args = parser.parse_args(["--dist-timeout", "20", "--launcher", "slurm"])
    assert args.dist_timeout == 20 and args.launcher == "slurm"


# ----------------------------------------------------------------------------- rendezvous
def test_describe_ranks():
    assert L._describe_ranks([1], 1) == "rank 1 (machine 1)"
    assert L._describe_ranks(list(range(8, 16)) + [17], 8) == "ranks 8-15 (machine 1), rank 17 (machine 2)"
    assert L._describe_ranks([0, 2], 4) == "ranks 0, 2 (machine 0)"


def _elapsed(message: str, words: str) -> float:
    return float(re.search(words + r" (\d+) s", message).group(1))


def test_rank_0_alone_times_out_naming_the_missing_rank():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(L.RendezvousTimeoutError) as e:
        L.rendezvous("127.0.0.1", port, 0, 2, timeout_s=1, poll_s=0.05)
    msg = str(e.value)
    assert f"tcp://127.0.0.1:{port}" in msg and "rank 1 (machine 1)" in msg and "--dist-timeout 1" in msg
    assert 1 <= time.monotonic() - t0 < 10


def test_a_rank_that_cannot_reach_rank_0_times_out_naming_it():
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(L.RendezvousTimeoutError) as e:
        L.rendezvous("127.0.0.1", port, 1, 2, local_world_size=1, timeout_s=1)
    msg = str(e.value)
    assert "could not reach" in msg and "rank 0 (machine 0)" in msg and "--dist-timeout 1" in msg
    assert time.monotonic() - t0 < 15  # PyTorch retries the connection: about 2x the timeout


def test_ranks_meet_and_duplicates_are_refused():
    port, errors, stores = free_port(), [], {}

    def join(rank):
        try:
            stores[rank] = L.rendezvous("127.0.0.1", port, rank, 2, timeout_s=20, poll_s=0.05)
        except Exception as e:
            errors.append(e)

    master = threading.Thread(target=join, args=(0,))
    master.start()
    join(1)
    master.join()
    assert not errors and set(stores) == {0, 1}
    with pytest.raises(L.LaunchConfigError, match="rank 1 joined the rendezvous at .* twice"):
        L.rendezvous("127.0.0.1", port, 1, 2, timeout_s=5)


# ----------------------------------------------------------------------------- rank_sync
def test_weights_fingerprint_is_exact_and_ignores_buffers():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    b = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    b.load_state_dict(a.state_dict())
    b[1].running_mean += 1  # per-rank statistics: not part of the fingerprint
    assert rank_sync.weights_fingerprint(a) == rank_sync.weights_fingerprint(b)
    with torch.no_grad():
        b[0].weight[0, 0, 0, 0] = torch.nextafter(b[0].weight[0, 0, 0, 0], torch.tensor(2.0))
    assert rank_sync.weights_fingerprint(a) != rank_sync.weights_fingerprint(b)


def test_check_ranks_agree_names_the_ranks(monkeypatch):
    monkeypatch.setattr(rank_sync.comm, "all_gather", lambda v: [(6, "ab"), (6, "ab"), (0, "cd")])
    with pytest.raises(rank_sync.RanksDisagreeError) as e:
        rank_sync.check_ranks_agree("the start", (6, "ab"), "Share OUTPUT_DIR.")
    assert str(e.value) == ("the 3 ranks disagree on the start: ranks 0, 1: (6, 'ab'); rank 2: (0, 'cd'). "
                            "Share OUTPUT_DIR.")
    monkeypatch.setattr(rank_sync.comm, "all_gather", lambda v: [v, v])
    assert rank_sync.check_ranks_agree("x", 3) == 3
