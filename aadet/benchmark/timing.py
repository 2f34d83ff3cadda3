"""Timing, peak-memory measurement, AMP settings and worker processes shared by
``tools/benchmark.py`` and ``dev/benchmark_layers.py`` (their report -- ratios, markdown, JSON --
is :mod:`aadet.benchmark.report`).

Timing (:func:`time_fn`): ``warmup`` untimed calls, then ``iters`` timed calls, each bracketed by
a device synchronization (``torch.cuda.synchronize`` on CUDA), summarised by the median (robust
to the odd slow iteration) and the 25/75 % quantiles. Besides wall-clock time, the process CPU
time of each call is recorded: on a CPU shared with other jobs it is far less sensitive to the
scheduler than wall time (with ``OMP_NUM_THREADS=1`` it *is* the compute time of the call).

AMP (:func:`autocast`): ``--amp-dtype`` of both tools, one of :data:`AMP_DTYPES`; by default
float16 on CUDA (with a GradScaler, like Detectron2's AMPTrainer) and bfloat16 on CPU
(:func:`default_amp_dtype`). bfloat16 has float32's exponent range, so it needs no loss scaling
(:func:`needs_grad_scaler`).

Peak memory (:class:`PeakMemory`), what "peak" means on each device:

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` -- the most bytes
  held by tensors during the block, relative to what was allocated at its start (the caching
  allocator's reserve is not counted).
* CPU: the process' resident-set high-water mark (``VmHWM``), reset at the start of the block
  by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0), minus the resident set at the
  start. Where ``clear_refs`` is unavailable, ``ru_maxrss`` (never reset) is used and ``exact``
  is False. Run cases in a fresh process (:func:`run_worker`) so that one case's heap does not
  hide another's.

The resident set also holds what glibc's malloc keeps of freed tensors: it raises its mmap
threshold as large blocks are freed (up to 32 MiB), after which tensors come from a heap whose
freed holes stay resident; how much that adds depends on the order of the allocations more than
on their sizes, and moves by about 20% between identical runs. So the CPU peak a benchmark
reports comes from a **memory pass** (:func:`memory_pass`): the case once more, in its own
process, one warm-up and one call per phase, under :data:`MEMORY_PASS_ENV`, where every
allocation of 128 KiB or more is mapped and returned to the system when freed -- the peak is
then the memory the block's tensors (and library scratch) needed, repeatable to about 1%. The
timed processes keep glibc's defaults (mapping every tensor would add page faults to their
times); their resident-set peak stays in the result as ``timed_rss_peak_bytes``.
"""

import json
import os
import platform
import resource
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..utils.collect_env import cpu_model

__all__ = [
    "AMP_DTYPES",
    "merge_rounds",
    "default_amp_dtype",
    "check_amp_dtype",
    "needs_grad_scaler",
    "autocast",
    "TimingResult",
    "quantile",
    "synchronize",
    "time_fn",
    "PeakMemory",
    "peak_memory_meaning",
    "report_peak_memory",
    "MEMORY_PASS_ENV",
    "memory_pass_spec",
    "with_memory_pass",
    "memory_pass",
    "measure",
    "combine_rounds",
    "environment_info",
    "run_worker",
    "TakeTurns",
    "run_interleaved",
    "run_case_in_subprocess",
    "worker_main",
]

#: ``--amp-dtype`` values and their autocast dtypes.
AMP_DTYPES: Dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def default_amp_dtype(device) -> str:
    """``"float16"`` on CUDA (tensor cores, Detectron2's AMP), ``"bfloat16"`` elsewhere (CPU
    autocast's native type)."""
    return "float16" if torch.device(device).type == "cuda" else "bfloat16"


def add_amp_dtype_argument(parser, when: str = "") -> None:
    """``--amp-dtype`` on a command line: one of :data:`AMP_DTYPES`, None meaning
    :func:`default_amp_dtype` (resolved per device by :func:`check_amp_dtype`); ``when`` says
    which flag turns autocast on."""
    parser.add_argument(
        "--amp-dtype", choices=sorted(AMP_DTYPES), default=None,
        help=f"autocast dtype{when} (default float16 + GradScaler on CUDA, bfloat16 on CPU)",
    )


def command_device(device_name: str, amp_dtype: Optional[str]):
    """``(device, amp dtype name)`` of a benchmark command's ``--device`` and ``--amp-dtype``
    (:func:`check_amp_dtype`); SystemExit where CUDA is asked for and there is none."""
    device = torch.device(device_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    return device, check_amp_dtype(amp_dtype, device)


def check_amp_dtype(name: Optional[str], device) -> str:
    """``name`` if it is one of :data:`AMP_DTYPES`, :func:`default_amp_dtype` for None.

    Raises:
        ValueError: naming ``--amp-dtype`` and the allowed values.
    """
    if name is None:
        return default_amp_dtype(device)
    if name not in AMP_DTYPES:
        raise ValueError(f"--amp-dtype must be one of {sorted(AMP_DTYPES)}, got {name!r}")
    return name


def needs_grad_scaler(device, amp_dtype: str, enabled: bool = True) -> bool:
    """Loss scaling is needed for float16 on CUDA only (bfloat16 has float32's range)."""
    return enabled and torch.device(device).type == "cuda" and amp_dtype == "float16"


def autocast(device, amp_dtype: str, enabled: bool = True) -> torch.autocast:
    """``torch.autocast`` on ``device``'s type with :data:`AMP_DTYPES` ``[amp_dtype]``."""
    dtype = AMP_DTYPES[check_amp_dtype(amp_dtype, device)]
    return torch.autocast(torch.device(device).type, dtype=dtype, enabled=enabled)


def synchronize(device) -> None:
    """Wait for queued work on ``device`` (a no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TimingResult(dict):
    """``{"median_s", "p25_s", "p75_s", "min_s", "cpu_median_s", "iters", "warmup", "times_s"}``."""

    @property
    def median(self) -> float:
        return self["median_s"]


def quantile(xs: Sequence[float], q: float) -> float:
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def time_fn(
    fn: Callable[[], object], *, warmup: int, iters: int, device="cpu", turns: Optional["TakeTurns"] = None
) -> TimingResult:
    """Median time of ``fn()`` over ``iters`` calls after ``warmup`` untimed calls.

    Args:
        fn: the work of one iteration (e.g. forward + backward + optimizer step).
        warmup: untimed calls first (allocator, cuDNN autotuning, lazy init); >= 0.
        iters: timed calls; >= 1.
        device: synchronized before and after every timed call.
        turns: interleaved timing (:func:`run_interleaved`): every call, warm-up included, waits
            for this process' turn and hands it on after.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(
            f"time_fn needs iters >= 1 and warmup >= 0; got iters={iters}, warmup={warmup}"
        )
    for _ in range(warmup):
        if turns:
            turns.wait()
        fn()
        synchronize(device)
        if turns:
            turns.done()
    wall: List[float] = []
    cpu: List[float] = []
    for _ in range(iters):
        if turns:
            turns.wait()
        synchronize(device)
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        synchronize(device)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if turns:
            turns.done()
    return TimingResult(
        median_s=statistics.median(wall),
        p25_s=quantile(wall, 0.25),
        p75_s=quantile(wall, 0.75),
        min_s=min(wall),
        cpu_median_s=statistics.median(cpu),
        iters=iters,
        warmup=warmup,
        times_s=wall,
    )


def _proc_status_kb(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Context manager measuring the peak memory of its block (see the module docstring).

    After the block: ``peak_bytes`` (peak above the start), ``peak_abs_bytes`` (the peak itself:
    all CUDA tensor memory, or the whole process' resident set), ``device`` and ``exact`` (False
    on CPU when the high-water mark could not be reset, i.e. the peak may predate the block)::

        with PeakMemory("cuda") as mem:
            step()
        print(mem.peak_bytes)
    """

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.peak_bytes: Optional[int] = None
        self.peak_abs_bytes: Optional[int] = None
        self.exact = True

    def __enter__(self):
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self.exact = _reset_rss_peak()
            rss = _proc_status_kb("VmRSS")
            self._start = (rss or 0) * 1024
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            synchronize(self.device)
            self.peak_abs_bytes = torch.cuda.max_memory_allocated(self.device)
            self.peak_bytes = self.peak_abs_bytes - self._start
        else:
            hwm = _proc_status_kb("VmHWM") if self.exact else None
            if hwm is None:  # ru_maxrss: KiB on Linux, never reset
                self.exact = False
                hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.peak_abs_bytes = hwm * 1024
            self.peak_bytes = max(0, self.peak_abs_bytes - self._start)
        return False


def peak_memory_meaning(device, memory_pass: bool = True) -> str:
    """What a benchmark result's ``peak_bytes`` is on ``device``, for report headers (the tools
    write it into their reports as ``peak_memory``; ``memory_pass=False``: a CPU report without
    it, whose peaks are its timed processes')."""
    if torch.device(device).type == "cuda":
        return "CUDA max allocated above the state before the phase"
    meaning = "process RSS high-water mark above the state before the phase"
    if memory_pass:
        meaning += ", in a memory pass where malloc maps every block >= 128 KiB and returns it when freed"
    return meaning


def report_peak_memory(report: dict) -> str:
    """What the peaks of a benchmark report mean: its ``peak_memory``, or for a report written
    without one, :func:`peak_memory_meaning` without the memory pass."""
    return report.get("peak_memory") or peak_memory_meaning(report["device"], memory_pass=False)


#: The environment of a CPU memory pass (module docstring): glibc's ``mallopt(M_MMAP_THRESHOLD)``
#: fixed at 128 KiB (fixed, it is no longer raised by frees).
MEMORY_PASS_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def memory_pass_spec(spec: dict) -> dict:
    """A case's spec for its memory pass: one warm-up and one timed call per phase, no turns, no
    profile."""
    return dict({k: v for k, v in spec.items() if k != "turns"}, warmup=1, iters=1, profile=False)


_PEAK_KEYS = ("peak_bytes", "peak_abs_bytes", "peak_exact")


def with_memory_pass(timed: dict, mem: dict) -> dict:
    """``timed`` (a case's result) with the peaks of its memory pass ``mem``: in the result
    itself and in each phase (a dict value) that measured one; the timed process' own peak is
    kept as ``timed_rss_peak_bytes``. A failed memory pass fails the case."""
    if "error" in timed:
        return timed
    if "error" in mem:
        return dict(timed, error=f"memory pass: {mem['error']}", detail=mem.get("detail"))

    def adopt(t: dict, m: dict) -> dict:
        return dict(t, timed_rss_peak_bytes=t["peak_bytes"], **{k: m.get(k) for k in _PEAK_KEYS})

    out = adopt(timed, mem) if "peak_bytes" in timed else dict(timed)
    for key, value in timed.items():
        if isinstance(value, dict) and "peak_bytes" in value:
            out[key] = adopt(value, mem.get(key, {}))
    return out


def memory_pass(
    script: str, results: Sequence[dict], specs: Sequence[dict], tmpdir: str, *,
    timeout: Optional[float] = None, run: Optional[Callable[..., dict]] = None,
) -> List[dict]:
    """``results`` (one per spec of ``specs``) with the peaks of a memory pass: each case that
    was measured (neither failed nor skipped) once more in ``script``'s worker, under
    :data:`MEMORY_PASS_ENV` with :func:`memory_pass_spec`, merged by :func:`with_memory_pass`.
    ``run``: :func:`run_case_in_subprocess` (the caller's, so tests that fake it fake both)."""
    run = run or run_case_in_subprocess
    return [
        r if "error" in r or "skipped" in r
        else with_memory_pass(r, run(script, memory_pass_spec(spec), tmpdir, timeout=timeout, env=MEMORY_PASS_ENV))
        for r, spec in zip(results, specs)
    ]


def measure(
    fn: Callable[[], object], *, warmup: int, iters: int, device="cpu", turns: Optional["TakeTurns"] = None
) -> dict:
    """:func:`time_fn` inside :class:`PeakMemory`: the timing keys plus ``peak_bytes``,
    ``peak_abs_bytes`` and ``peak_exact`` (the keys of every benchmark result)."""
    with PeakMemory(device) as mem:
        t = time_fn(fn, warmup=warmup, iters=iters, device=device, turns=turns)
    return dict(
        t, peak_bytes=mem.peak_bytes, peak_abs_bytes=mem.peak_abs_bytes, peak_exact=mem.exact
    )


def combine_rounds(rounds: Sequence[dict]) -> dict:
    """One :func:`measure` result from the same case measured in several rounds (the cases of a
    run taken round-robin, each round in fresh processes): ``median_s`` and ``cpu_median_s`` are
    the medians of the rounds' medians, so one round on a slowed machine (a shared host's speed
    drifts by tens of percent over minutes) moves neither; ``round_medians_s`` keeps each round's
    median, ``times_s`` and the quantiles pool every timed call, peak memory is the largest."""
    if not rounds:
        raise ValueError("combine_rounds needs at least one round")
    if len(rounds) == 1:
        return dict(rounds[0])
    times = [t for r in rounds for t in r["times_s"]]
    peaks = [r.get("peak_bytes") for r in rounds]
    return dict(
        rounds[0],
        median_s=statistics.median(r["median_s"] for r in rounds),
        p25_s=quantile(times, 0.25),
        p75_s=quantile(times, 0.75),
        min_s=min(times),
        cpu_median_s=statistics.median(r["cpu_median_s"] for r in rounds),
        iters=sum(r["iters"] for r in rounds),
        times_s=times,
        round_medians_s=[r["median_s"] for r in rounds],
        peak_bytes=None if None in peaks else max(peaks),
        peak_abs_bytes=max((r.get("peak_abs_bytes") or 0) for r in rounds) or None,
        peak_exact=all(r.get("peak_exact", False) for r in rounds),
    )


def merge_rounds(rounds: Sequence[List[dict]], combine: Callable[[List[dict]], dict],
                 failed: Callable[[dict], bool] = lambda r: "error" in r) -> List[dict]:
    """One result per case from several rounds, each listing the same cases in the same order: a
    case that ``failed`` in any round is reported by its first failure, the others by
    ``combine`` (the case's results of every round). One round is returned as it is."""
    if len(rounds) == 1:
        return rounds[0]
    merged = []
    for same in zip(*rounds):
        bad = [r for r in same if failed(r)]
        merged.append(bad[0] if bad else combine(list(same)))
    return merged


def environment_info(device="cpu") -> Dict[str, object]:
    """Device name, torch version, threads and cores: what a timing is only valid for."""
    device = torch.device(device)
    info = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    return info


def run_worker(argv: Sequence[str], timeout: Optional[float] = None,
               env: Optional[Dict[str, str]] = None) -> dict:
    """Run ``python argv...`` in a fresh process (``env``: variables added to this one's); its
    last stdout line must be one JSON object.

    Raises:
        RuntimeError: with the worker's stderr tail when it fails or prints no JSON.
    """
    cmd = [sys.executable, *argv]
    proc = subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout,
        env=dict(os.environ, **env) if env else None,
    )
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"benchmark worker failed (exit {proc.returncode}): {' '.join(cmd)}\n"
            f"--- stderr (last 3000 chars) ---\n{proc.stderr[-3000:]}"
        )
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError as e:
        raise RuntimeError(
            f"benchmark worker printed no JSON as its last line: {lines[-1][:300]!r}"
        ) from e


def run_case_in_subprocess(
    script: str, spec: dict, tmpdir: str, timeout: Optional[float] = None,
    env: Optional[Dict[str, str]] = None,
) -> dict:
    """Run ``python script --worker SPEC.json`` (one benchmark case) in a fresh process (``env``:
    :func:`run_worker`'s).

    The script's worker mode reads the JSON spec and prints its result as one JSON line. A
    failing case does not stop the run: its result is ``{**spec-identity, "error": <the
    exception line>, "detail": <stderr tail>}``.
    """
    fd, spec_file = tempfile.mkstemp(suffix=".json", dir=tmpdir)
    with os.fdopen(fd, "w") as f:
        json.dump(spec, f)
    try:
        return run_worker([os.path.abspath(script), "--worker", spec_file], timeout=timeout, env=env)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        return {
            "spec": spec,
            "error": (lines[-1] if lines else repr(e))[:300],
            "detail": str(e)[-3000:],
        }
    finally:
        os.remove(spec_file)


def worker_main(spec_file: str, run_case: Callable[[dict], dict]) -> int:
    """The ``--worker SPEC.json`` mode of a benchmark tool: print ``run_case(spec)`` as one JSON
    line. CUDA out of memory is a result (``{"error": ...}``), so the table shows it and the run
    goes on; any other exception fails the worker (its stderr reaches the report's ``detail``)."""
    with open(spec_file) as f:
        spec = json.load(f)
    try:
        out = run_case(spec)
    except torch.cuda.OutOfMemoryError as e:
        out = {"error": f"CUDA out of memory: {e}"[:500]}
    print(json.dumps(out))
    return 0


# ----------------------------------------------------------------------------- interleaved timing
class TakeTurns:
    """The worker's side of :func:`run_interleaved`: :meth:`wait` blocks until the parent gives
    this process its turn (one byte on the ``go`` FIFO), :meth:`done` hands it back (one byte on
    ``ack``). The FIFOs are opened at the first turn, after the worker has built its model."""

    def __init__(self, go_path: str, ack_path: str):
        self._paths = (go_path, ack_path)
        self._go = self._ack = None

    @classmethod
    def from_spec(cls, spec: dict) -> Optional["TakeTurns"]:
        """The turns a worker's spec asks for (its ``"turns"``: the two FIFO paths), or None."""
        return cls(*spec["turns"]) if spec.get("turns") else None

    def wait(self) -> None:
        if self._go is None:
            self._go = open(self._paths[0], "rb", buffering=0)
            self._ack = open(self._paths[1], "wb", buffering=0)
        if self._go.read(1) != b"g":
            raise RuntimeError("interleaved timing: the parent stopped giving turns")

    def done(self) -> None:
        self._ack.write(b"a")


def run_interleaved(
    script: str, specs: Sequence[dict], tmpdir: str, calls: int, timeout: Optional[float] = None
) -> List[dict]:
    """Run one worker per spec (:func:`run_case_in_subprocess`), all alive at once, and let them
    take turns call by call: worker 1's call, worker 2's, ..., worker 1's next call, and so on,
    ``calls`` times each (what each worker's :func:`time_fn` makes: warm-up and timed calls of
    every phase it measures). Only one of them computes at any moment, so every case is timed on
    the same machine at the same minutes: a shared host whose speed drifts by tens of percent
    over minutes moves all cases alike and leaves their ratios. Each worker keeps its own
    process (its peak memory is its own). A worker that fails drops out of the turns; its result
    is the failure.
    """
    fds, threads = [], []
    results: List[Optional[dict]] = [None] * len(specs)
    for i, spec in enumerate(specs):
        go, ack = os.path.join(tmpdir, f"turn{i}.go"), os.path.join(tmpdir, f"turn{i}.ack")
        os.mkfifo(go)
        os.mkfifo(ack)
        fds.append((os.open(go, os.O_RDWR), os.open(ack, os.O_RDWR)))  # O_RDWR: never blocks

        def run(i=i, spec=dict(spec, turns=[go, ack])):
            results[i] = run_case_in_subprocess(script, spec, tmpdir, timeout)

        threads.append(threading.Thread(target=run, daemon=True))
    for t in threads:
        t.start()
    alive = list(range(len(specs)))
    try:
        for _ in range(calls):
            for i in list(alive):
                os.write(fds[i][0], b"g")
                while not select.select([fds[i][1]], [], [], 1.0)[0]:
                    if not threads[i].is_alive():  # failed (or finished early): out of the turns
                        alive.remove(i)
                        break
                else:
                    os.read(fds[i][1], 1)
        for t in threads:
            t.join()
    finally:
        for go_fd, ack_fd in fds:
            os.close(go_fd)
            os.close(ack_fd)
    return results
