"""dev/gpu_loan.sh's handling of a call's files: what a call returns fits the device's 8 files, and
the first call's files carried into the second leave the checkout clean (at 3a55981 the second
call carried them inside the tree, and its stages were marked uncommitted; the first call's 9 files
lost work.tar.gz)."""
import json
import os
import subprocess
import tarfile

from tests.helpers import REPO

SCRIPT = os.path.join(REPO, "dev", "gpu_loan.sh")
#: What a device call returns at most (the device tool's limit).
MAX_FILES_BACK = 8
EVERY_STAGE = ("sweep", "tests", "configs", "benchmarks", "demo")


def _call(function: str, repo, *args, env=None) -> str:
    """Run one function of the script with ``REPO=repo`` (the functions only, not its main)."""
    body = subprocess.run(
        ["sed", "-n", "/^take_prev()/,/^}/p;/^pack_out()/,/^}/p", SCRIPT],
        check=True, capture_output=True, text=True).stdout
    script = f'set -euo pipefail\nREPO={repo}\n{body}\n{function} "$@"\n'
    return subprocess.run(["bash", "-c", script, "gpu_loan", *map(str, args)], check=True, capture_output=True,
                          text=True, env=dict(os.environ, **(env or {}))).stdout.strip()


def _a_call_out(out, repo):
    out.mkdir()
    for name in ("loan.log", "report.json", "report.md", "sweep.jsonl", "sweep.plan.json"):
        (out / name).write_text(name)
    for stage in EVERY_STAGE:
        (out / f"stage_{stage}.json").write_text(json.dumps({"status": "ok", "stage": stage}))
    work = repo / "output" / "gpu_check_work"
    work.mkdir(parents=True)
    (work / "pytest_cuda.log").write_text("238 passed")
    (repo / "output" / "gpu_check_stderr.log").write_text("")


def test_a_call_returns_its_report_and_one_archive(tmp_path):
    repo, out = tmp_path / "repo", tmp_path / "out"
    repo.mkdir()
    _a_call_out(out, repo)
    assert len(os.listdir(out)) > MAX_FILES_BACK  # what the stages write loose
    _call("pack_out", repo, out)
    assert sorted(os.listdir(out)) == ["loan.log", "report.json", "report.md", "run.tar.gz"]
    with tarfile.open(out / "run.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"stage_{s}.json" for s in EVERY_STAGE} | {"sweep.jsonl", "sweep.plan.json"} <= names
    assert "output/gpu_check_work/pytest_cuda.log" in names


def test_prev_carried_in_the_tree_leaves_it_with_its_stage_files(tmp_path):
    repo, first = tmp_path / "repo", tmp_path / "first"
    repo.mkdir()
    _a_call_out(first, repo)
    _call("pack_out", repo, first)
    prev = repo / ".loanprev"  # carried inside the checkout, as a call must
    os.rename(first, prev)
    dest = tmp_path / "prev"
    got = _call("take_prev", repo, prev, env={"AADET_LOAN_PREV": str(dest)})
    assert got == str(dest)
    assert not prev.exists()  # no untracked file left in the tree for the checkout check
    assert json.loads((dest / "stage_configs.json").read_text())["stage"] == "configs"
    assert not (dest / "output").exists()  # the first call's work folder stays packed


def test_a_call_that_wrote_no_sweep_or_stage_file_still_packs(tmp_path):
    """A call cut before its first stage file, or a second call without the sweep's rows (and every
    dry run, which stops at the first CUDA call), still returns its files: the listing of what to
    pack must not end the script under ``set -euo pipefail`` (it did, with exit 2, because ``ls``
    fails on a pattern without a match)."""
    repo, out = tmp_path / "repo", tmp_path / "out"
    repo.mkdir()
    out.mkdir()
    (out / "loan.log").write_text("log")
    (out / "stage_tests.json").write_text(json.dumps({"status": "ok", "stage": "tests"}))
    (repo / "output" / "gpu_check_work").mkdir(parents=True)
    (repo / "output" / "gpu_check_stderr.log").write_text("")
    _call("pack_out", repo, out)  # no sweep.jsonl, no sweep.plan.json
    assert sorted(os.listdir(out)) == ["loan.log", "run.tar.gz"]
    with tarfile.open(out / "run.tar.gz") as tar:
        assert "stage_tests.json" in tar.getnames()
    (out / "run.tar.gz").unlink()
    _call("pack_out", repo, out)  # nothing of the stages at all
    assert "run.tar.gz" in os.listdir(out)
