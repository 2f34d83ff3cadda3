"""``dev/aadet_dev/checkout.py``: when a tree is the commit it names. In a git checkout any
modified, staged, deleted or untracked (not ignored) file makes it dirty; a copied tree without
``.git`` is verified against the manifest written in the checkout, file by file."""
import os
import shutil
import subprocess

import pytest

from aadet_dev import checkout


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("X = 1\n")
    (root / "README.md").write_text("# r\n")
    (root / ".gitignore").write_text("/output/\n__pycache__/\n*.pyc\n/.whl/\n")
    _git(root, "init", "-q")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    return root


def test_git_checkout_is_dirty_with_any_change_untracked_files_included(repo):
    clean = checkout.git_state(str(repo))
    assert clean["dirty"] is False and len(clean["commit"]) == 40
    (repo / "output").mkdir()
    (repo / "output" / "report.json").write_text("{}")  # ignored: still clean
    assert checkout.git_state(str(repo))["dirty"] is False
    (repo / "pkg" / "new_test.py").write_text("def test(): pass\n")  # untracked: runs too
    state = checkout.git_state(str(repo))
    assert state["dirty"] is True and "?? pkg/new_test.py" in state["changes"]
    os.remove(repo / "pkg" / "new_test.py")
    (repo / "pkg" / "mod.py").write_text("X = 2\n")
    assert checkout.git_state(str(repo))["dirty"] is True
    assert checkout.git_state(str(repo.parent))["commit"] is None  # not a checkout


def test_copied_tree_is_verified_against_the_manifest(repo, tmp_path, monkeypatch):
    manifest = repo / ".whl" / "checkout.txt"
    state = checkout.write_manifest(str(repo), str(manifest))
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    monkeypatch.setenv(checkout.MANIFEST_ENV, str(copy / ".whl" / "checkout.txt"))
    got = checkout.checkout_state(str(copy))
    assert (got["commit"], got["dirty"]) == (state["commit"], False) and got["how"].startswith("manifest")
    (copy / "output").mkdir()
    (copy / "output" / "x.json").write_text("{}")
    (copy / "pkg" / "__pycache__").mkdir()
    (copy / "pkg" / "__pycache__" / "mod.cpython-312.pyc").write_bytes(b"\0")
    assert checkout.checkout_state(str(copy))["dirty"] is False  # what runs write, .gitignore covers
    (copy / "pkg" / "mod.py").write_text("X = 2\n")
    (copy / "pkg" / "extra.py").write_text("")
    os.remove(copy / "README.md")
    got = checkout.checkout_state(str(copy))
    assert got["dirty"] is True and set(got["changes"]) == {" M pkg/mod.py", "?? pkg/extra.py", " D README.md"}
    # a manifest written from a dirty checkout never verifies clean
    (repo / "pkg" / "mod.py").write_text("X = 3\n")
    checkout.write_manifest(str(repo), str(manifest))
    assert checkout.verify_manifest(str(repo), str(manifest))["dirty"] is True
    monkeypatch.delenv(checkout.MANIFEST_ENV)
    assert checkout.checkout_state(str(copy))["dirty"] is None  # no .git, no manifest: unknown
    with pytest.raises(ValueError, match="not a checkout manifest"):
        checkout.verify_manifest(str(copy), str(copy / "pkg" / "extra.py"))
