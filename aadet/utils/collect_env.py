"""Where a run ran: the machine and the code, as Detectron2's ``collect_env`` records them.

* :func:`machine_description`: CPU model, cores, torch threads, GPU name, torch and Python versions.
* :func:`git_state`: the commit of a git checkout and whether its tree differs from it.

A run summary (:mod:`aadet.engine.run_summary`), a benchmark's report (:mod:`aadet.benchmark`) and
the project's own records read these. :func:`git_state` is the one place in ``aadet`` that runs a
program (``git``), as Detectron2's ``collect_env`` runs ``git`` and ``nvcc``.
"""
import os
import platform
import subprocess
from typing import Dict, Optional

__all__ = ["cpu_model", "machine_description", "git_output", "git_state", "git_commit"]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; elsewhere what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_description() -> Dict[str, object]:
    """CPU model, cores, torch threads, GPU name (or None), torch and Python versions."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
        "torch": torch.__version__.split("+")[0],
        "python": platform.python_version(),
    }


def git_output(repo: str, *args: str) -> Optional[str]:
    """What ``git -C repo ARGS`` prints, or None where it fails (no git, not a checkout)."""
    try:
        p = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def git_state(repo: str, *, untracked: bool = False) -> Dict[str, object]:
    """``{"commit", "dirty", "changes"}`` of the git checkout holding ``repo`` (all None / empty
    where it is none): HEAD, whether ``git status --porcelain`` lists anything, and its first 20
    lines. ``untracked``: a file that ``.gitignore`` does not cover makes the tree dirty too (a
    new test module runs as surely as a changed one); else only tracked files count."""
    head = git_output(repo, "rev-parse", "HEAD")
    status = git_output(repo, "status", "--porcelain", f"--untracked-files={'all' if untracked else 'no'}")
    if head is None or status is None:
        return {"commit": None, "dirty": None, "changes": []}
    changes = status.splitlines()
    return {"commit": head.strip(), "dirty": bool(changes), "changes": changes[:20]}


def git_commit(repo: str) -> Dict[str, object]:
    """``{"commit", "dirty"}`` of :func:`git_state` (tracked files only): what a record of a run
    keeps of the code that ran."""
    state = git_state(repo)
    return {"commit": state["commit"], "dirty": state["dirty"]}
