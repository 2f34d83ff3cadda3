"""Starting the processes of a training on one or several machines: Detectron2's ``launch`` flags
(``--num-gpus``, ``--num-machines``, ``--machine-rank``, ``--dist-url``), torchrun and SLURM's
``srun``, and a rendezvous that fails within ``--dist-timeout`` seconds naming who is missing.

Where the worker processes come from (:func:`plan_launch`, ``--launcher``):

* **spawn** (Detectron2's flags; ``auto`` without torchrun's variables): this process spawns
  ``--num-gpus`` workers (with ``--num-gpus 1`` it is the worker itself); worker ``l`` of machine
  ``--machine-rank m`` is global rank ``m * num_gpus + l``; all meet at ``--dist-url
  tcp://HOST:PORT`` (machine 0's address; ``auto``: a free port of this machine, one machine
  only).
* **torchrun** (``python -m torch.distributed.run``; ``auto`` when its variables are set): torchrun
  started one process per GPU with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``: this process *is* a worker, nothing is spawned
  (:func:`torchrun_env`).
* **slurm** (``srun`` with one task per GPU; asked for by name): ``SLURM_PROCID``,
  ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``, the tasks per node and the first host of
  the step's node list give the same (:func:`slurm_env`; ``MASTER_ADDR`` / ``MASTER_PORT`` win
  when set).

Every worker then joins the rendezvous (:func:`rendezvous`): a ``TCPStore`` served by rank 0 (by
torchrun's agent under torchrun) in which each rank marks itself present. A rank that waits longer
than ``--dist-timeout`` raises :class:`RendezvousTimeoutError` naming the URL, the missing ranks
with their machines, and the flag. Then, as in Detectron2's ``launch``: the default process group
(NCCL with CUDA, else gloo; its collectives time out after the same ``--dist-timeout``), the
per-machine group behind ``comm.get_local_rank()``, the CUDA device, a barrier, and
``main_func(*args)`` once per process. A collective that fails mid-run (a peer died: gloo raises
as soon as the peer's socket closes, NCCL's watchdog after the timeout) is re-raised as
:class:`PeerLostError`, which says what to do next.

The functions from environment variables to a :class:`DistEnv` are pure (the environment is an
argument): ``tests/engine/test_launch.py`` tests them without processes;
``tests/engine/test_multi_machine.py`` runs the process paths on one host.
"""
import dataclasses
import gc
import logging
import os
import re
import socket
import time
from datetime import timedelta
from typing import Callable, List, Mapping, Optional, Sequence, Tuple
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from ..utils.d2compat import create_local_process_group, release_local_process_group

__all__ = [
    "DEFAULT_DIST_TIMEOUT_S",
    "LAUNCHERS",
    "DistEnv",
    "LaunchConfigError",
    "RendezvousTimeoutError",
    "PeerLostError",
    "torchrun_env",
    "slurm_env",
    "slurm_first_host",
    "slurm_tasks_per_node",
    "plan_launch",
    "rendezvous",
    "add_launch_arguments",
    "launch",
]

logger = logging.getLogger(__name__)

#: ``--dist-timeout`` default, seconds: how long a rank waits for the others to join, and for
#: any collective, before it fails. 30 minutes, the default of Detectron2's ``launch`` and of
#: PyTorch's gloo groups: the machines of a cluster job can start minutes apart (queue, container
#: pull, data staging), and during training every other rank waits in a collective while rank 0
#: alone summarizes a COCO evaluation or writes a checkpoint to a network filesystem (minutes).
#: A smaller value fails a broken start sooner but must stay above those pauses.
DEFAULT_DIST_TIMEOUT_S = 1800.0

#: ``--launcher`` choices (see the module docstring).
LAUNCHERS = ("auto", "spawn", "torchrun", "slurm")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_KEY = "aadet_rendezvous"


class LaunchConfigError(ValueError):
    """The launcher's flags or environment variables do not describe one consistent run."""


class RendezvousTimeoutError(RuntimeError):
    """Ranks of the run did not all join the rendezvous within ``--dist-timeout``."""


class PeerLostError(RuntimeError):
    """A collective failed during the run: another process died or stopped answering."""


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """One worker's place in the run, as torchrun or SLURM describe it.

    Ranks are contiguous per machine: machine ``m`` holds ranks ``m * local_world_size`` to
    ``(m + 1) * local_world_size - 1`` (what Detectron2's per-machine group assumes).
    """

    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" or "slurm": named in error messages

    def __post_init__(self):
        w, r, lr, lw = self.world_size, self.rank, self.local_rank, self.local_world_size
        where = f"{self.source}: world size {w}, rank {r}, local rank {lr}, {lw} per machine"
        if w < 1 or lw < 1 or w % lw:
            raise LaunchConfigError(f"{where}: the world size must be a multiple (>= 1) of the "
                                    "processes per machine (every machine runs as many)")
        if not 0 <= r < w or not 0 <= lr < lw:
            raise LaunchConfigError(f"{where}: rank must be in [0, {w}), local rank in [0, {lw})")
        if r % lw != lr:
            raise LaunchConfigError(
                f"{where}: ranks are not contiguous per machine (rank % {lw} != local rank); "
                "with SLURM use the block task distribution (srun --distribution=block)")
        if not 0 < self.master_port < 2 ** 16:
            raise LaunchConfigError(f"{where}: master port must be in 1..65535; got {self.master_port}")

    @property
    def machine_rank(self) -> int:
        return self.rank // self.local_world_size

    @property
    def num_machines(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def dist_url(self) -> str:
        return _tcp_url(self.master_addr, self.master_port)

    def environ(self) -> dict:
        """The torchrun-style variables of this worker (``RANK``, ``WORLD_SIZE``, ...)."""
        return {
            "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.machine_rank), "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def _tcp_url(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _check_machine_rank(env: DistEnv, environ: Mapping[str, str], name: str, fix: str) -> DistEnv:
    """``env``, after checking that the machine the launcher's variable ``name`` gives (torchrun's
    ``GROUP_RANK``, SLURM's ``SLURM_NODEID``), when set, is ``rank // local_world_size``: ranks
    are contiguous per machine (:class:`DistEnv`). ``fix``: what the user should change."""
    if environ.get(name) and _int(environ, name, env.source) != env.machine_rank:
        raise LaunchConfigError(
            f"{env.source}: {name}={environ[name]} but rank {env.rank} // {env.local_world_size} "
            f"workers per machine = {env.machine_rank}: {fix}")
    return env


def _int(environ: Mapping[str, str], name: str, source: str) -> int:
    value = environ.get(name)
    if value is None or value == "":
        raise LaunchConfigError(f"{source}: environment variable {name} is not set")
    try:
        return int(value)
    except ValueError:
        raise LaunchConfigError(f"{source}: {name}={value!r} is not an integer") from None


# ----------------------------------------------------------------------------- torchrun
def torchrun_env(environ: Mapping[str, str]) -> Optional[DistEnv]:
    """The worker torchrun (or any ``env://`` launcher) describes in ``environ``; None unless all
    of ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` are set.

    ``LOCAL_WORLD_SIZE`` (processes on this machine; torchrun sets it) is required then.
    ``GROUP_RANK`` (torchrun's machine rank), when set, must agree with ``RANK // LOCAL_WORLD_SIZE``.
    """
    if not all(environ.get(v) for v in TORCHRUN_VARS):
        return None
    src = "torchrun"
    env = DistEnv(
        world_size=_int(environ, "WORLD_SIZE", src),
        rank=_int(environ, "RANK", src),
        local_rank=_int(environ, "LOCAL_RANK", src),
        local_world_size=_int(environ, "LOCAL_WORLD_SIZE", src),
        master_addr=environ["MASTER_ADDR"],
        master_port=_int(environ, "MASTER_PORT", src),
        source=src,
    )
    return _check_machine_rank(env, environ, "GROUP_RANK", "every machine must run the same --nproc-per-node")


# ----------------------------------------------------------------------------- SLURM
_TASKS_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def slurm_tasks_per_node(value: str) -> List[int]:
    """SLURM's compressed tasks-per-node list, expanded: ``"8(x2),4"`` -> ``[8, 8, 4]``."""
    out = []
    for item in value.split(","):
        m = _TASKS_ITEM.match(item.strip())
        if not m:
            raise LaunchConfigError(f"slurm: cannot read tasks per node {value!r} (expected e.g. '8(x2),4')")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def slurm_first_host(nodelist: str) -> str:
    """The first host of a SLURM host list (``scontrol show hostnames "$LIST" | head -n 1``):
    ``"gpu[07-09,12],cpu1"`` -> ``"gpu07"``; ``"rack[1-2]-n[3,5]"`` -> ``"rack1-n3"``."""
    first, depth = "", 0
    for ch in nodelist.strip():  # the first host expression: up to a comma outside brackets
        if ch == "," and depth == 0:
            break
        depth += (ch == "[") - (ch == "]")
        first += ch
    if not first or depth:
        raise LaunchConfigError(f"slurm: cannot read node list {nodelist!r}")
    # Each bracket range contributes its first value (zero padding kept: "[007-010]" -> "007").
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], first)


def slurm_default_port(job_id: Optional[str]) -> int:
    """A port derived from the job id (10000-29999, below Linux's ephemeral ports), so that jobs
    sharing a node do not collide; 29500 without a job id."""
    return 10000 + int(job_id) % 20000 if job_id and job_id.isdigit() else 29500


def slurm_env(environ: Mapping[str, str]) -> Optional[DistEnv]:
    """The worker an ``srun`` task is (one task per GPU), from ``environ``; None outside SLURM
    (no ``SLURM_PROCID``).

    World size ``SLURM_NTASKS``, rank ``SLURM_PROCID``, local rank ``SLURM_LOCALID``; tasks per
    node from ``SLURM_STEP_TASKS_PER_NODE`` (``srun``), ``SLURM_TASKS_PER_NODE`` or
    ``SLURM_NTASKS_PER_NODE`` (equal on every node); the master is ``MASTER_ADDR`` or the first
    host of ``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST``, its port ``MASTER_PORT`` or
    :func:`slurm_default_port` of ``SLURM_JOB_ID``. ``SLURM_NODEID``, when set, must be this
    task's machine (block distribution).
    """
    if not environ.get("SLURM_PROCID"):
        return None
    src = "slurm"
    world = _int(environ, "SLURM_NTASKS", src)
    tasks_var = next((v for v in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                                  "SLURM_NTASKS_PER_NODE") if environ.get(v)), None)
    if tasks_var is None:
        raise LaunchConfigError("slurm: none of SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE, "
                                "SLURM_NTASKS_PER_NODE is set (run the command under srun)")
    per_node = slurm_tasks_per_node(environ[tasks_var])
    if len(set(per_node)) != 1:
        raise LaunchConfigError(f"slurm: {tasks_var}={environ[tasks_var]}: every node must run "
                                "the same number of tasks (srun --ntasks-per-node=GPUS)")
    addr = environ.get("MASTER_ADDR")
    if not addr:
        nodes_var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                          if environ.get(v)), None)
        if nodes_var is None:
            raise LaunchConfigError("slurm: neither MASTER_ADDR nor SLURM_STEP_NODELIST / "
                                    "SLURM_JOB_NODELIST is set")
        addr = slurm_first_host(environ[nodes_var])
    port = (_int(environ, "MASTER_PORT", src) if environ.get("MASTER_PORT")
            else slurm_default_port(environ.get("SLURM_JOB_ID")))
    env = DistEnv(world_size=world, rank=_int(environ, "SLURM_PROCID", src),
                  local_rank=_int(environ, "SLURM_LOCALID", src), local_world_size=per_node[0],
                  master_addr=addr, master_port=port, source=src)
    return _check_machine_rank(
        env, environ, "SLURM_NODEID", "use the block task distribution (srun --distribution=block, the default)"
    )


# ----------------------------------------------------------------------------- choosing
def plan_launch(
    launcher: str,
    num_gpus_per_machine: int,
    num_machines: int,
    machine_rank: int,
    environ: Mapping[str, str],
) -> Optional[DistEnv]:
    """``None``: spawn ``num_gpus_per_machine`` workers here (Detectron2's way). A
    :class:`DistEnv`: this process is one worker that torchrun / srun started.

    ``auto`` is ``torchrun`` when torchrun's variables are set, else ``spawn``. Under torchrun or
    SLURM the process counts come from the environment; ``--num-gpus`` / ``--num-machines`` /
    ``--machine-rank`` must then be left out or agree with it (otherwise every worker would spawn
    workers of its own).
    """
    if launcher not in LAUNCHERS:
        raise LaunchConfigError(f"--launcher must be one of {LAUNCHERS}; got {launcher!r}")
    if launcher == "auto":
        launcher = "torchrun" if torchrun_env(environ) is not None else "spawn"
        if launcher == "spawn" and _srun_started_several(environ) and num_machines == 1:
            logger.warning(
                "srun started %s tasks, but this command trains alone on this machine (no "
                "--launcher slurm, --num-machines 1): pass --launcher slurm (one task per GPU) or "
                "--num-machines/--machine-rank/--dist-url (one task per machine)",
                environ.get("SLURM_NTASKS"))
    if launcher == "spawn":
        return None
    env = torchrun_env(environ) if launcher == "torchrun" else slurm_env(environ)
    if env is None:
        needs = ", ".join(TORCHRUN_VARS) if launcher == "torchrun" else "SLURM_PROCID (run under srun)"
        raise LaunchConfigError(f"--launcher {launcher}: {needs} not set in the environment")
    given = (max(num_gpus_per_machine, 1), num_machines, machine_rank)
    if given != (1, 1, 0) and given != (env.local_world_size, env.num_machines, env.machine_rank):
        raise LaunchConfigError(
            f"--launcher {launcher}: the environment says {env.local_world_size} processes per "
            f"machine, {env.num_machines} machines, this one machine {env.machine_rank}, but the "
            f"flags say --num-gpus {num_gpus_per_machine} --num-machines {num_machines} "
            f"--machine-rank {machine_rank}: leave those flags out under {launcher}")
    return env


def _srun_started_several(environ: Mapping[str, str]) -> bool:
    n = environ.get("SLURM_NTASKS", "")
    return bool(environ.get("SLURM_STEP_ID")) and n.isdigit() and int(n) > 1


# ----------------------------------------------------------------------------- rendezvous
def _describe_ranks(ranks: Sequence[int], local_world_size: int) -> str:
    """``[8, 9, ..., 15, 17]`` with 8 per machine -> ``"ranks 8-15 (machine 1), rank 17 (machine 2)"``."""
    parts = []
    for m in sorted({r // local_world_size for r in ranks}):
        mine = sorted(r for r in ranks if r // local_world_size == m)
        if len(mine) == 1:
            what = f"rank {mine[0]}"
        elif mine == list(range(mine[0], mine[-1] + 1)):
            what = f"ranks {mine[0]}-{mine[-1]}"
        else:
            what = "ranks " + ", ".join(map(str, mine))
        parts.append(f"{what} (machine {m})")
    return ", ".join(parts)


def rendezvous(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    *,
    local_world_size: int = 1,
    timeout_s: float = DEFAULT_DIST_TIMEOUT_S,
    dist_url: Optional[str] = None,
    agent_store: bool = False,
    attempt: int = 0,
    poll_s: float = 0.2,
) -> "dist.Store":
    """Meet the other ``world_size - 1`` ranks at ``host:port``; the store to build the process
    group on.

    Rank 0 serves a ``TCPStore`` at ``port`` (unless ``agent_store``: torchrun's agent serves it
    there); every rank connects, marks itself present and waits until all are.

    Raises:
        RendezvousTimeoutError: after ``timeout_s`` seconds, naming ``dist_url``, the ranks (and
            machines) that did not join, and ``--dist-timeout``; on a non-zero rank also when rank
            0's store cannot be reached (within about twice ``timeout_s``: PyTorch's connection
            retries) or goes away.
        LaunchConfigError: two processes claim the same rank; rank 0 cannot listen on ``port``.
    """
    url = dist_url or _tcp_url(host, port)
    flag = f"--dist-timeout {timeout_s:g}"
    master = rank == 0 and not agent_store
    t0 = time.monotonic()
    try:
        store = dist.TCPStore(host, port, None, is_master=master, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False, multi_tenant=True)
    except Exception as e:  # the store raises RuntimeErrors of several kinds
        if master:
            raise LaunchConfigError(
                f"rank 0 could not serve the rendezvous at {url} ({e}); is port {port} in use? "
                "Pick another port in --dist-url (or torchrun's --master-port)") from e
        raise RendezvousTimeoutError(
            f"rank {rank} of {world_size} could not reach the rendezvous at {url} within "
            f"{time.monotonic() - t0:.0f} s ({flag}): {_describe_ranks([0], local_world_size)}, "
            f"which serves it, has not started, or {host}:{port} is not reachable from this "
            "machine (address, firewall). Start every machine with the same --dist-url; raise "
            "--dist-timeout if machines start far apart.") from e

    prefix = f"{_KEY}/{attempt}/"
    if store.add(f"{prefix}rank{rank}", 1) > 1:
        raise LaunchConfigError(
            f"rank {rank} joined the rendezvous at {url} twice: two processes were given the same "
            "rank (the same --machine-rank on two machines, or a second run on the same port)")
    try:
        joined = store.add(prefix + "joined", 1)
        deadline, next_note = t0 + timeout_s, t0 + min(60.0, timeout_s / 2)
        while joined < world_size:
            now = time.monotonic()
            if now >= deadline or now >= next_note:
                missing = [r for r in range(world_size) if not store.check([f"{prefix}rank{r}"])]
                if now >= deadline:
                    raise RendezvousTimeoutError(
                        f"rendezvous at {url} timed out after {now - t0:.0f} s ({flag}): rank "
                        f"{rank} of {world_size} waited for "
                        f"{_describe_ranks(missing, local_world_size)}, which never joined. Start "
                        "the same command on every machine (same --dist-url and --num-machines, "
                        "each its own --machine-rank; torchrun: --nnodes/--node-rank; SLURM: all "
                        f"tasks), check that each reaches {host}:{port} (firewall, interface: "
                        "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME), or raise --dist-timeout if "
                        "machines start far apart.")
                logger.warning("rendezvous at %s: rank %d waiting %.0f s for %s (%s)", url, rank,
                               now - t0, _describe_ranks(missing, local_world_size), flag)
                next_note = now + 60.0
            time.sleep(poll_s)
            joined = store.add(prefix + "joined", 0)
    except (RendezvousTimeoutError, LaunchConfigError):
        raise
    except Exception as e:
        raise RendezvousTimeoutError(
            f"rank {rank} of {world_size} lost the rendezvous at {url} while waiting for the other "
            f"ranks ({e}): rank 0, which serves it, stopped (its log has the cause)") from e
    return store


# ----------------------------------------------------------------------------- the workers
@dataclasses.dataclass(frozen=True)
class _Plan:
    """What every worker of this machine needs: its global rank is
    ``machine_rank * local_world_size + local_rank``."""

    world_size: int
    local_world_size: int
    machine_rank: int
    dist_url: str  # tcp://HOST:PORT, or file://... (no rendezvous of ours: init_method)
    timeout_s: float
    agent_store: bool = False
    attempt: int = 0


def _init_process_group(plan: _Plan, rank: int) -> Optional["dist.Store"]:
    """The default process group of ``rank``; returns the rendezvous store (None with file://)."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=plan.timeout_s)
    url = urlparse(plan.dist_url)
    if url.scheme != "tcp":
        dist.init_process_group(backend, init_method=plan.dist_url, world_size=plan.world_size,
                                rank=rank, timeout=timeout)
        return None
    store = rendezvous(url.hostname, url.port, rank, plan.world_size,
                       local_world_size=plan.local_world_size, timeout_s=plan.timeout_s,
                       dist_url=plan.dist_url, agent_store=plan.agent_store, attempt=plan.attempt)
    try:
        dist.init_process_group(backend, store=dist.PrefixStore(f"{_KEY}/{plan.attempt}/pg", store),
                                world_size=plan.world_size, rank=rank, timeout=timeout)
    except Exception as e:
        raise RendezvousTimeoutError(
            f"rank {rank} of {plan.world_size}: every rank joined the rendezvous at "
            f"{plan.dist_url}, but creating the {backend} process group failed ({e}); a peer may "
            f"have died meanwhile, or cannot open connections to this machine (firewall, "
            f"interface: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME). Timeout: --dist-timeout "
            f"{plan.timeout_s:g}.") from e
    return store


def _leave(plan: _Plan, rank: int, store: Optional["dist.Store"]) -> None:
    """Leave a finished run so that no process aborts on its way out.

    Left to interpreter shutdown, the teardown can crash: the trainer and its
    DistributedDataParallel model (reference cycles, freed only by the garbage collector) keep the
    process groups alive, whose gloo threads may still be at work, or see a peer's sockets close,
    when Python no longer lets a thread take the GIL; the process then aborts after a finished run
    ("terminate called without an active exception", SIGABRT). So every rank waits for the others,
    frees those objects and destroys every group while the interpreter is whole; then rank 0, which
    serves the rendezvous store, waits (at most a minute) until every rank has done so before it
    exits and takes the store with it.
    """
    from detectron2.utils import comm

    comm.synchronize()
    gc.collect()
    release_local_process_group()
    dist.destroy_process_group()
    if store is None:
        return
    key = f"{_KEY}/{plan.attempt}/left"
    left = store.add(key, 1)
    if rank != 0 or plan.agent_store:
        return
    deadline = time.monotonic() + min(plan.timeout_s, 60.0)
    while left < plan.world_size and time.monotonic() < deadline:
        time.sleep(0.05)
        left = store.add(key, 0)
    if left < plan.world_size:
        logger.warning("rank 0 exits before %d of %d ranks left the run cleanly",
                       plan.world_size - left, plan.world_size)


def _looks_like_peer_failure(e: BaseException) -> bool:
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo", "NCCL",
        "Timed out waiting", "ProcessGroup"))


def _worker(local_rank: int, main_func: Callable, plan: _Plan, args: Tuple) -> None:
    rank = plan.machine_rank * plan.local_world_size + local_rank
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise LaunchConfigError(
                f"local rank {local_rank} but this process sees {torch.cuda.device_count()} GPU(s) "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}): each process "
                "must see all GPUs of its machine (SLURM: no --gpus-per-task / --gpu-bind)")
        torch.cuda.set_device(local_rank)
    store = _init_process_group(plan, rank)
    create_local_process_group(plan.local_world_size)
    from detectron2.utils import comm

    # As Detectron2's launch: a barrier right after init prevents a timeout in the first collective.
    comm.synchronize()
    try:
        main_func(*args)
    except Exception as e:
        if plan.world_size > 1 and _looks_like_peer_failure(e):
            raise PeerLostError(
                f"rank {rank} of {plan.world_size} (machine {plan.machine_rank}, {plan.dist_url}) "
                f"stops: a collective failed ({str(e).splitlines()[0][:300]}). Another process of "
                "the run most likely died or became unreachable (its log has the cause), or did not "
                f"reach the collective within --dist-timeout {plan.timeout_s:g}. Restart every "
                "machine with --resume to continue from the last checkpoint.") from e
        raise
    _leave(plan, rank, store)


def _parse_spawn_url(dist_url: Optional[str], num_machines: int) -> str:
    if dist_url in (None, "", "auto"):
        if num_machines != 1:
            raise LaunchConfigError(
                "--dist-url auto picks a port of this machine: with --num-machines > 1 give "
                "machine 0's address, e.g. --dist-url tcp://10.0.0.1:29500")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return _tcp_url("127.0.0.1", s.getsockname()[1])
    url = urlparse(dist_url)
    if url.scheme == "tcp" and url.hostname and url.port:
        return dist_url
    if url.scheme == "file":
        if num_machines > 1:
            logger.warning("file:// is not a reliable init_method across machines; prefer tcp://")
        return dist_url
    raise LaunchConfigError(
        f"--dist-url must be tcp://HOST:PORT (machine 0's address), file://PATH or auto; got "
        f"{dist_url!r} (env:// is torchrun's: start the command with torchrun instead)")


def launch(
    main_func: Callable,
    num_gpus_per_machine: int,
    num_machines: int = 1,
    machine_rank: int = 0,
    dist_url: Optional[str] = None,
    args: Tuple = (),
    *,
    timeout_s: float = DEFAULT_DIST_TIMEOUT_S,
    launcher: str = "auto",
    environ: Optional[Mapping[str, str]] = None,
) -> None:
    """Run ``main_func(*args)`` in every process of the run (Detectron2's ``launch`` arguments,
    plus ``timeout_s`` (``--dist-timeout``) and ``launcher`` (``--launcher``); see the module
    docstring). One process in all (``--num-gpus 0/1``, one machine, no torchrun/SLURM): called
    here, without ``torch.distributed``."""
    environ = os.environ if environ is None else environ
    if timeout_s <= 0:
        raise LaunchConfigError(f"--dist-timeout must be > 0 seconds; got {timeout_s}")
    env = plan_launch(launcher, num_gpus_per_machine, num_machines, machine_rank, environ)
    if env is not None:  # torchrun / srun started this process as one worker
        if environ is os.environ:
            os.environ.update(env.environ())  # the same variables under SLURM as under torchrun
        plan = _Plan(
            world_size=env.world_size, local_world_size=env.local_world_size,
            machine_rank=env.machine_rank, dist_url=env.dist_url, timeout_s=timeout_s,
            # torchrun's agent serves the store at MASTER_ADDR:MASTER_PORT, for every attempt.
            agent_store=env.source == "torchrun" and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            attempt=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        )
        _worker(env.local_rank, main_func, plan, args)
        return
    world_size = num_machines * num_gpus_per_machine
    if world_size <= 1:
        main_func(*args)
        return
    if not 0 <= machine_rank < num_machines:
        raise LaunchConfigError(f"--machine-rank must be in [0, {num_machines}); got {machine_rank}")
    plan = _Plan(world_size=world_size, local_world_size=num_gpus_per_machine,
                 machine_rank=machine_rank, dist_url=_parse_spawn_url(dist_url, num_machines),
                 timeout_s=timeout_s)
    if num_gpus_per_machine == 1:  # one process per machine: it is the worker, nothing to spawn
        _worker(0, main_func, plan, args)
        return
    import torch.multiprocessing as mp

    mp.start_processes(_worker, nprocs=num_gpus_per_machine, args=(main_func, plan, args),
                       daemon=False)


def add_launch_arguments(parser):
    """``--dist-timeout`` and ``--launcher`` on a Detectron2 ``default_argument_parser()``."""
    parser.add_argument(
        "--dist-timeout", type=float, default=DEFAULT_DIST_TIMEOUT_S, metavar="SECONDS",
        help="how long a process waits for the others to join the run, and for any collective, "
        f"before it fails naming who is missing (default {DEFAULT_DIST_TIMEOUT_S:g}: machines of "
        "a cluster job may start minutes apart, and rank 0 alone evaluates or writes checkpoints "
        "while the others wait)")
    parser.add_argument(
        "--launcher", choices=LAUNCHERS, default="auto",
        help="spawn: start --num-gpus processes here (Detectron2's launch); torchrun: this process "
        "is one worker of torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); slurm: "
        "one worker per srun task (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, ...); auto (default): "
        "torchrun when its variables are set, else spawn. See docs/multi_machine.md")
    return parser
