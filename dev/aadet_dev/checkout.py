"""Which commit a checkout holds and whether its tree is that commit, clean: what makes a GPU
check's stage "fresh".

* In a git checkout: ``git rev-parse HEAD``, and the tree is dirty when ``git status
  --porcelain`` lists anything: a modified, staged or deleted file, or an untracked one that
  ``.gitignore`` does not cover (a new test module runs as surely as a changed one).
* In a copied tree without ``.git`` (a lent GPU machine gets the working tree, not the
  repository): a manifest written beside the git checkout (:func:`write_manifest`: the commit and
  the git blob id of every tracked file) and carried with the copy; :func:`verify_manifest`
  hashes the copy's files as git does and compares. A file that differs or is gone, or a file
  the manifest does not list and ``.gitignore`` does not cover, makes the tree dirty.
* Neither: commit and state unknown (``None``), which is not fresh.
"""
import fnmatch
import hashlib
import os
from typing import Dict, List

from aadet.utils import collect_env

__all__ = ["git_state", "write_manifest", "verify_manifest", "checkout_state", "MANIFEST_ENV"]

#: The environment variable naming the manifest of a copied tree (``dev/gpu_loan.sh`` sets it).
MANIFEST_ENV = "AADET_CHECKOUT_MANIFEST"


def git_state(repo: str) -> Dict[str, object]:
    """:func:`aadet.utils.collect_env.git_state` of ``repo`` itself, untracked files counted:
    ``commit`` None where ``repo`` holds no ``.git`` (a copied tree inside another checkout is
    not that checkout)."""
    if not os.path.exists(os.path.join(repo, ".git")):
        return {"commit": None, "dirty": None, "changes": []}
    return collect_env.git_state(repo, untracked=True)


def write_manifest(repo: str, path: str) -> Dict[str, object]:
    """Write the manifest of ``repo``'s HEAD to ``path``: ``commit SHA``, ``dirty 0|1`` (the
    checkout's state as it was written), then ``BLOB PATH`` per tracked file. Returns
    :func:`git_state`; raises RuntimeError where ``repo`` is no git checkout."""
    state = git_state(repo)
    listing = collect_env.git_output(repo, "ls-tree", "-r", "-z", "--full-tree", "HEAD")
    if state["commit"] is None or listing is None:
        raise RuntimeError(f"{repo} is not a git checkout: a manifest needs one")
    lines = [f"commit {state['commit']}", f"dirty {int(bool(state['dirty']))}"]
    for line in filter(None, listing.split("\0")):
        meta, name = line.split("\t", 1)
        mode, kind, blob = meta.split()
        if kind == "blob":
            lines.append(f"{blob} {name}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return state


def blob_id(path: str) -> str:
    """The git blob id of a file (of a symlink: of its target's path, as git stores it)."""
    data = os.readlink(path).encode() if os.path.islink(path) else open(path, "rb").read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _ignore_patterns(repo: str) -> List[str]:
    try:
        with open(os.path.join(repo, ".gitignore")) as f:
            return [line.strip() for line in f if line.strip() and not line.startswith(("#", "!"))]
    except OSError:
        return []


def _ignored(rel: str, is_dir: bool, patterns: List[str]) -> bool:
    """``.gitignore``'s simple patterns (``name``, ``*.ext``, ``/anchored``, ``dir/``); enough for
    this repository's own file, whose patterns are all of these kinds."""
    name = os.path.basename(rel)
    for pattern in patterns:
        dir_only = pattern.endswith("/")
        pat = pattern.rstrip("/")
        if dir_only and not is_dir:
            continue
        if pat.startswith("/"):
            if fnmatch.fnmatch(rel, pat[1:]):
                return True
        elif fnmatch.fnmatch(name, pat) or fnmatch.fnmatch(rel, pat):
            return True
    return False


def verify_manifest(repo: str, manifest: str) -> Dict[str, object]:
    """``{"commit", "dirty", "changes"}`` of the copied tree ``repo`` against its manifest:
    ``changes`` names each file modified (``M``), gone (``D``) or not in it (``??``)."""
    with open(manifest) as f:
        lines = f.read().splitlines()
    if len(lines) < 2 or not lines[0].startswith("commit ") or not lines[1].startswith("dirty "):
        raise ValueError(f"{manifest}: not a checkout manifest (expected 'commit SHA', 'dirty 0|1', "
                         f"then 'BLOB PATH' lines; got {lines[:2]})")
    commit, was_dirty = lines[0].split()[1], lines[1].split()[1] != "0"
    blobs = dict(reversed(line.split(" ", 1)) for line in lines[2:] if line)
    changes = ["   (the checkout was dirty when the manifest was written)"] if was_dirty else []
    for rel, blob in blobs.items():
        path = os.path.join(repo, rel)
        if not os.path.lexists(path):
            changes.append(f" D {rel}")
        elif blob_id(path) != blob:
            changes.append(f" M {rel}")
    patterns = _ignore_patterns(repo)
    for dirpath, dirnames, filenames in os.walk(repo):
        rel_dir = os.path.relpath(dirpath, repo)
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = sorted(d for d in dirnames if d != ".git" and not _ignored(rel_dir + d, True, patterns))
        for f in sorted(filenames):
            rel = rel_dir + f
            if rel not in blobs and not _ignored(rel, False, patterns):
                changes.append(f"?? {rel}")
    return {"commit": commit, "dirty": bool(changes), "changes": changes[:20]}


def checkout_state(repo: str) -> Dict[str, object]:
    """``{"commit", "dirty", "changes", "how"}`` of ``repo``: git where it is a git checkout, else
    the manifest named by ``$AADET_CHECKOUT_MANIFEST``, else unknown (``None``, not fresh)."""
    state = git_state(repo)
    if state["commit"] is not None:
        return dict(state, how="git")
    manifest = os.environ.get(MANIFEST_ENV)
    if manifest:
        return dict(verify_manifest(repo, manifest), how=f"manifest {manifest}")
    return {"commit": None, "dirty": None, "changes": [], "how": f"no .git and no ${MANIFEST_ENV}"}
