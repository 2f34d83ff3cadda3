"""``dev/check_detectron2.sh``: the tests run against another Detectron2 source (upstream main),
imported from a side environment, in the tests and in the subprocesses they start."""
import os
import shutil
import subprocess

import pytest

from tests.helpers import REPO

SCRIPT = os.path.join(REPO, "dev", "check_detectron2.sh")
MARK = "CHECK_DETECTRON2_MARK"

# A test run by the script: the Detectron2 it imports, and a subprocess's, are the marked copy.
PROBE = f'''
import subprocess, sys
import detectron2

def test_the_marked_detectron2_is_imported_here_and_in_subprocesses():
    assert detectron2.{MARK} is True
    code = "import detectron2; print(detectron2.{MARK})"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "True"
'''


def test_a_folder_without_detectron2_is_refused_by_name(tmp_path):
    r = subprocess.run(["bash", SCRIPT, str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2
    assert str(tmp_path) in r.stderr and "detectron2/__init__.py" in r.stderr


@pytest.mark.slow  # makes a virtual environment and starts pytest in it (about 20 s)
def test_tests_and_their_subprocesses_import_the_given_detectron2(tmp_path):
    import detectron2

    src = tmp_path / "d2src"
    shutil.copytree(os.path.dirname(detectron2.__file__), src / "detectron2",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    with open(src / "detectron2" / "__init__.py", "a") as f:
        f.write(f"\n{MARK} = True\n")
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE)
    r = subprocess.run(["bash", SCRIPT, str(src), str(probe), "--rootdir", str(tmp_path)],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"Detectron2 source {src} (commit not a git checkout)" in r.stdout
    assert "1 passed" in r.stdout
