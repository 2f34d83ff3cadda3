"""``tools/setup_env.sh`` and ``dev/make_wheelhouse.sh``: installing aadet on a machine without a
package index, reusing the machine's own torch.

The slow test does what a cluster or the lent GPU machine does, with this machine standing in:
make a wheelhouse for this Python (with the index), then, with every pip source but that folder
switched off (``PIP_CONFIG_FILE=/dev/null``, no ``PIP_*`` variables, ``--no-index``), install
aadet + the offline Detectron2 into an environment whose torch is "the system's" -- a venv that
sees this environment's torch, torchvision and their dependencies (and nothing else) through a
``.pth`` file, as ``/opt/torch/.venv`` holds the GPU image's torch -- and check that torch was
kept, not replaced, that aadet builds a model there, and that the demo data is made from the
deepforest wheel in the same folder.
"""
import glob
import importlib.metadata as md
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO

SETUP = os.path.join(REPO, "tools", "setup_env.sh")
WHEELHOUSE = os.path.join(REPO, "dev", "make_wheelhouse.sh")


def _bash(script, *args, env=None, timeout=120):
    return subprocess.run(["bash", script, *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})), cwd=REPO)


def _offline_env(**extra):
    """The environment with every pip source switched off but the ones named on the command line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


# ----------------------------------------------------------------------------- argument checks (fast)
def test_scripts_parse_and_document_the_offline_modes():
    for script in (SETUP, WHEELHOUSE):
        assert subprocess.run(["bash", "-n", script]).returncode == 0, script
    help_text = _bash(SETUP, "--help").stdout
    assert "AADET_WHEELHOUSE=DIR" in help_text and "AADET_SYSTEM_SITE=1" in help_text
    help_text = _bash(WHEELHOUSE, "--help").stdout
    for flag in ("--python-version", "--platform", "--with-torch", "--exclude-installed", "--dry-run"):
        assert flag in help_text, flag


@pytest.mark.parametrize("args,env,message", [
    (["--bogus"], {}, "unknown option --bogus"),
    (["a", "b"], {}, "one VENV_DIR only"),
    ([], {"AADET_WHEELHOUSE": "/nonexistent/wheels"}, "/nonexistent/wheels is not a directory"),
    (["--wheelhouse", "/nonexistent/wheels"], {}, "is not a directory"),
    ([], {"AADET_SYSTEM_SITE": "yes"}, "AADET_SYSTEM_SITE must be 0 or 1"),
])
def test_setup_env_rejects_bad_arguments_before_doing_anything(args, env, message, tmp_path):
    p = _bash(SETUP, *args, env=dict(env, PYTHON="/nonexistent/python"))
    assert p.returncode == 2 and message in p.stderr, p.stderr


@pytest.mark.parametrize("args,message", [
    ([], "Download every wheel"),  # usage
    (["--python-version", "3.12"], "first argument is DIR"),
    (["DIR", "--frobnicate"], "unknown option --frobnicate"),
    (["DIR", "--exclude-installed", "/nonexistent/list"], "not found"),
])
def test_make_wheelhouse_rejects_bad_arguments(args, message, tmp_path):
    args = [str(tmp_path / "wh") if a == "DIR" else a for a in args]
    p = _bash(WHEELHOUSE, *args)
    assert p.returncode == 2 and message in p.stdout + p.stderr, p.stdout + p.stderr


# ----------------------------------------------------------------------------- the offline install (slow)
def _requirements(dist, extras):
    """``(name, extras)`` of ``dist``'s requirements that apply here, with the ``extras`` asked."""
    from packaging.requirements import Requirement

    out = []
    for line in md.requires(dist) or ():
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
            out.append((req.name, tuple(req.extras)))
    return out


def make_system_torch(target):
    """``target/`` with links to this environment's torch, torchvision and their dependency
    closure, extras included (code and ``.dist-info``): the stand-in for a machine's
    preinstalled CUDA torch, a consistent environment of its own."""
    todo, seen = [("torch", ()), ("torchvision", ())], set()
    while todo:
        name, extras = todo.pop()
        key = (re.sub(r"[-_.]+", "-", name).lower(), extras)
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        site = str(dist.locate_file(""))
        tops = {str(f).split("/")[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops:
            src, dst = os.path.join(site, top), os.path.join(target, top)
            if os.path.exists(src) and not os.path.lexists(dst) and not top.endswith(".pth"):
                os.symlink(src, dst)
        todo += _requirements(name, extras)
    return sorted({name for name, _ in seen})


@pytest.mark.packaging
@pytest.mark.slow
def test_install_from_a_wheelhouse_without_an_index_keeps_the_system_torch(tmp_path):
    py = sys.executable
    wh = tmp_path / "wheelhouse"
    # 1. The wheelhouse, made with the index (this Python, this platform).
    p = _bash(WHEELHOUSE, str(wh), env={"PYTHON": py}, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    wheels = {os.path.basename(w).split("-")[0].lower() for w in glob.glob(str(wh / "*.whl"))}
    assert {"sal_detectron2", "deepforest", "fvcore", "iopath", "pycocotools", "yacs", "numpy"} <= wheels, wheels
    assert not wheels & {"torch", "torchvision"}  # the machine's own are reused
    assert glob.glob(str(wh / "fvcore-*-py3-none-any.whl"))  # built from its sdist: fits every target

    # 2. "The machine's python": a venv whose torch comes from elsewhere, like /opt/torch/.venv.
    env_dir = tmp_path / "machine"
    subprocess.run([py, "-m", "venv", str(env_dir)], check=True)
    mpy = str(env_dir / "bin" / "python")
    offline = _offline_env(PYTHON=mpy, AADET_SYSTEM_SITE="1", AADET_WHEELHOUSE=str(wh))
    venv = str(tmp_path / "venv")  # VENV_DIR: gets the wrapper that runs the machine's python
    p = subprocess.run(["bash", SETUP, venv], env=offline, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 1 and "cannot import torch" in p.stderr, p.stderr  # nothing installs one
    system = tmp_path / "system_site"
    system.mkdir()
    closure = make_system_torch(str(system))
    assert "torch" in closure and "numpy" in closure
    site = subprocess.run([mpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "system_torch.pth"), "w") as f:
        f.write(str(system) + "\n")

    # 3. Install with no index: only the wheelhouse.
    p = subprocess.run(["bash", SETUP, venv], env=offline, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "installing into" in p.stdout and "keeping torch" in p.stdout and "offline route" in p.stdout
    assert os.path.isfile(os.path.join(venv, ".aadet-setup-done"))
    vpy = os.path.join(venv, "bin", "python")  # what `make test` / `make gpu-check` run

    # 4. torch is the system's (not reinstalled), aadet this checkout's, Detectron2 the snapshot.
    check = (
        "import os, torch, numpy, detectron2, aadet\n"
        "from detectron2.modeling import build_model\n"
        "from aadet.engine import load_config\n"
        f"cfg = load_config({os.path.join(REPO, 'configs/Demo/trees_R_26_slim_FPN.yaml')!r}, ['MODEL.DEVICE', 'cpu'])\n"
        "model = build_model(cfg).eval()\n"
        "with torch.no_grad():\n"
        "    (out,) = model([{'image': torch.rand(3, 64, 64) * 255, 'height': 64, 'width': 64}])\n"
        "print(torch.__file__, aadet.__file__, detectron2.__version__, numpy.__file__, len(out['instances']))\n"
    )
    p = subprocess.run([vpy, "-c", check], capture_output=True, text=True, timeout=300,
                       env=_offline_env(OMP_NUM_THREADS="1"), cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    torch_file, aadet_file, d2_version, numpy_file, _ = p.stdout.split()
    assert torch_file.startswith(str(system)) and numpy_file.startswith(str(system))  # kept, not replaced
    assert aadet_file.startswith(REPO) and d2_version == "0.7.2"
    assert not os.path.exists(os.path.join(site, "torch"))

    # 5. The demo data from the deepforest wheel in the same folder (no download).
    root = tmp_path / "data"
    p = subprocess.run([vpy, os.path.join(REPO, "datasets", "prepare_trees.py"), "--root", str(root),
                        "--wheelhouse", str(wh)], capture_output=True, text=True, timeout=300,
                       env=_offline_env(), cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(glob.glob(str(root / "trees" / "**" / "*.png"), recursive=True)) > 50
    p = subprocess.run([mpy, os.path.join(REPO, "datasets", "prepare_trees.py"), "--root", str(root / "x"),
                        "--wheelhouse", str(tmp_path)], capture_output=True, text=True, timeout=120,
                       env=_offline_env(), cwd=str(tmp_path))
    assert p.returncode == 1 and "deepforest-2.1.0-py3-none-any.whl" in p.stderr


@pytest.mark.packaging
@pytest.mark.slow
def test_wheelhouse_for_the_lent_gpu_python_resolves(tmp_path):
    # The GPU machines run CPython 3.12 on manylinux x86_64: every requirement must resolve to
    # wheels for it (metadata only: --dry-run downloads nothing but the built pure-Python wheels).
    p = _bash(WHEELHOUSE, str(tmp_path / "wh"), "--python-version", "3.12", "--dry-run",
              env={"PYTHON": sys.executable}, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    (line,) = [ln for ln in p.stdout.splitlines() if "wheels resolve:" in ln]
    resolved = {x.split("==")[0].lower() for x in line.split("resolve:")[1].split()}
    assert {"fvcore", "iopath", "pycocotools", "omegaconf", "hydra-core", "yacs", "numpy", "wheel"} <= resolved
    assert not resolved & {"torch", "torchvision"}
    assert "sal-detectron2==0.7.2 resolves" in p.stdout
