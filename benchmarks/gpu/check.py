"""The GPU check: every claim CPU CI cannot test, asserted stock-red and safe_zero-green, with a JSON report.

Run it from the repository root through ``benchmarks/gpu_check.sh`` (or ``python benchmarks/gpu/check.py``) on a
machine with CUDA torch and DeepSpeed (and, for the JIT ops, nvcc). Without CUDA it prints
``no CUDA: skipped`` and exits 2. Otherwise it:

1. starts DeepSpeed's JIT builds the checks need (``fused_adam``, ``quantizer``) in the background, each in its own
   process, and runs the checks that need none meanwhile (after the two-rank probe below, where there is one GPU);
2. runs each check in its own launch (``python -m torch.distributed.run --standalone --nproc_per_node N``): one
   rank, or two NCCL ranks. With one GPU a two-rank check runs both ranks on it if NCCL allows that (a probe
   says); NCCL refuses two ranks on one device, so there those checks are skipped, and listed as skipped;
3. judges each check's records (``benchmarks/gpu/checks.py``) and writes the report: per check what it proves,
   what stock DeepSpeed was expected to do and did, what safe_zero did, pass/fail/skip/error, the reasons and the
   seconds. Exit status: 0 when nothing failed (skips allowed), 1 otherwise.

Sized for under 8 minutes on one H100/H200 (``--budget``, default 460 s, bounds the whole run; each launch has its
own timeout, the JIT builds theirs); on one H200 the whole run took 113 s (``report_h200_2026-12-04.json``). The
report goes to ``--report PATH``, else ``$OUT/gpu_check_report.json`` when ``$OUT`` is set, else ``benchmarks/gpu/report.json``; each launch's output lies beside it in ``<report>.logs/``.

``--list`` prints the checks as a Markdown table (no CUDA needed); ``--only NAME`` runs some of them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.gpu.checks import BY_NAME, CHECKS, Check, judge  # noqa: E402

NO_CUDA_EXIT = 2
FAILED_EXIT = 1
#: The whole run, builds included (the brief: under 8 minutes on one H100/H200).
BUDGET_S = 460
#: A JIT build that takes longer than this is stopped (it still counts against the budget).
BUILD_TIMEOUT_S = 420
#: How long a rank waits, after a leg, for the other rank to finish it before it stops the launch.
LEG_SYNC_S = 30
#: NCCL's own timeout for a collective, so a hang that slips past the leg sync still ends.
COLLECTIVE_TIMEOUT_S = 180
PROBE_TIMEOUT_S = 60
#: A launch is not started with less than this left of the budget.
MIN_LAUNCH_S = 20

#: DeepSpeed op builder class and build-directory name of each JIT op a check may need.
OPS = {"fused_adam": ("FusedAdamBuilder", "fused_adam"), "quantizer": ("QuantizerBuilder", "quantizer")}


def report_path(arg: str | None, environ: dict | None = None) -> str:
    """``--report``, else ``$OUT/gpu_check_report.json`` when ``$OUT`` is set, else ``benchmarks/gpu/report.json``."""
    environ = os.environ if environ is None else environ
    if arg:
        return os.path.abspath(arg)
    if environ.get("OUT"):
        return os.path.join(os.path.abspath(environ["OUT"]), "gpu_check_report.json")
    return os.path.join(ROOT, "benchmarks", "gpu", "report.json")


def write_json(path: str, data: Any) -> None:
    """Write ``data`` to ``path`` atomically (a reader never sees half a file)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


def check_entry(check: Check, status: str, **fields: Any) -> dict:
    """One check's entry in the report."""
    entry = {"name": check.name, "proves": check.proves, "fails_how": check.fails_how,
             "world_size": check.world_size, "status": status, "stock_expected": "", "stock_observed": "",
             "stock_as_expected": None, "safe_zero": "", "safe_zero_ok": None, "reasons": [], "notes": [],
             "seconds": 0.0}
    entry.update(fields)
    return entry


def overall(entries: list) -> str:
    statuses = {e["status"] for e in entries}
    return "fail" if statuses & {"fail", "error"} else "pass"


def exit_code(report: dict) -> int:
    if report.get("status") == "skipped":
        return NO_CUDA_EXIT
    return FAILED_EXIT if report.get("status") != "pass" else 0


def markdown_table(checks: tuple = CHECKS) -> str:
    rows = ["| check | ranks | what it proves | how it fails |", "|---|---|---|---|"]
    rows += [f"| `{c.name}` | {c.world_size} | {c.proves} | {c.fails_how} |" for c in checks]
    return "\n".join(rows)


def skipped_report(reason: str, checks: tuple = CHECKS) -> dict:
    return {"script": "benchmarks/gpu/check.py", "status": "skipped", "reason": reason,
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "checks": [check_entry(c, "skip", reasons=[reason]) for c in checks]}


# ------------------------------------------------------------------------------------------------ launches


def arch_list_for_deepspeed(arch_list: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` without the arch-specific suffixes (``9.0a`` -> ``9.0``, ``10.0f`` -> ``10.0``) that
    DeepSpeed's JIT builder cannot parse (0.19.8: ``int('0a')`` raises ``ValueError`` in
    ``compute_capability_args``, so every build fails). Images for Hopper set ``9.0a``; the ops built here use none
    of its arch-specific instructions."""
    return re.sub(r"(\d+\.\d+)[a-z]\b", r"\1", arch_list)


def _env() -> dict:
    env = dict(os.environ)
    env.pop("DS_ACCELERATOR", None)  # DeepSpeed picks CUDA itself; "cpu" left over from CPU runs would hide the GPU
    if env.get("TORCH_CUDA_ARCH_LIST"):
        env["TORCH_CUDA_ARCH_LIST"] = arch_list_for_deepspeed(env["TORCH_CUDA_ARCH_LIST"])
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("NCCL_DEBUG", "WARN")  # NCCL's refusals (a duplicate GPU) reach the log
    return env


#: Launches still running: stopped with the driver (they run in sessions of their own, which a signal to the
#: driver's process group would not reach).
_LIVE: set = set()


def _stop_all(*_: Any) -> None:
    for launch in list(_LIVE):
        launch.kill()
    raise SystemExit(FAILED_EXIT)


class Launch:
    """A process group in its own session, its output in ``log``; ``wait`` kills the whole group on timeout."""

    def __init__(self, cmd: list, log: str) -> None:
        _LIVE.add(self)
        self.log = log
        self.started = time.monotonic()
        os.makedirs(os.path.dirname(log), exist_ok=True)
        with open(log, "w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=_env(),
                                         start_new_session=True)
        self.timed_out = False
        self.ended: float | None = None
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:  # when the process ended, also for one nobody waited on then (a background build)
        self.proc.wait()
        self.ended = time.monotonic()
        _LIVE.discard(self)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.kill()
            return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        """SIGTERM to the whole group (torchrun passes it on to its ranks), then SIGKILL to whatever is left."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=15 if sig == signal.SIGTERM else 5)
            except subprocess.TimeoutExpired:
                pass
            time.sleep(1)  # the ranks torchrun was stopping

    @property
    def seconds(self) -> float:
        return round((self.ended or time.monotonic()) - self.started, 1)

    def tail(self, chars: int = 3000) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""


def torchrun(nproc: int, *args: str) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            os.path.abspath(__file__), *args]


class Build:
    """A JIT build of one DeepSpeed op in the background (``check.py --build OP``)."""

    def __init__(self, op: str, log_dir: str) -> None:
        self.op = op
        self.launch = Launch([sys.executable, os.path.abspath(__file__), "--build", op],
                             os.path.join(log_dir, f"build_{op}.log"))
        self.result: dict | None = None

    def wait(self, deadline: float) -> dict:
        if self.result is None:
            code = self.launch.wait(deadline - time.monotonic())
            ok = code == 0 and not self.launch.timed_out
            self.result = {"ok": ok, "seconds": self.launch.seconds, "log": self.launch.log}
            if not ok:
                lines = self.launch.tail(1500).strip().splitlines()
                self.result["error"] = ("timed out" if self.launch.timed_out else f"exit {code}") + \
                    (f": {lines[-1]}" if lines else "")
                if self.launch.timed_out:
                    _release_lock(self.op)
        return self.result


def _release_lock(op: str) -> None:
    """A build killed half-way leaves its lock file, and every later load would wait on it forever."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = os.path.join(_get_build_directory(OPS[op][1], verbose=False), "lock")
        if os.path.exists(lock):
            os.remove(lock)
    except Exception:  # noqa: BLE001 - best effort; safe_zero.op_builds names a stale lock on the next run
        pass


def probe_two_ranks_one_gpu(log_dir: str, out_dir: str, deadline: float) -> dict:
    """Whether NCCL runs two ranks on this machine's one GPU (recent NCCL refuses: 'Duplicate GPU detected')."""
    launch = Launch(torchrun(2, "--probe-nccl", "--out", out_dir), os.path.join(log_dir, "probe_nccl.log"))
    launch.wait(min(PROBE_TIMEOUT_S, deadline - time.monotonic()))
    ranks = [_load(os.path.join(out_dir, f"probe.rank{r}.json")) for r in range(2)]
    ok = all(r and r.get("ok") for r in ranks)
    result = {"ok": ok, "seconds": launch.seconds, "log": launch.log}
    if not ok:
        errors = [r.get("error") for r in ranks if r and r.get("error")]
        duplicate = [line for line in launch.tail(20000).splitlines() if "Duplicate GPU" in line]
        result["error"] = (duplicate or errors or ["timed out" if launch.timed_out else "no result"])[0][-300:]
    return result


def _load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def collect(out_dir: str, check: Check) -> tuple:
    """``(legs, facts, stops)``: each leg's record per rank (``None`` where a rank left none), the first rank's facts,
    and each rank's note of why it stopped early."""
    ranks = [_load(os.path.join(out_dir, f"{check.name}.rank{r}.json")) for r in range(check.world_size)]
    legs = {leg.name: [(r or {}).get("legs", {}).get(leg.name) for r in ranks] for leg in check.legs}
    facts = next((r["facts"] for r in ranks if r and r.get("facts")), {})
    stops = [r["stopped"] for r in ranks if r and r.get("stopped")]
    return legs, facts, stops


def _trimmed(legs: dict) -> dict:
    """The records as the report keeps them: tracebacks cut to their last lines."""
    out = {}
    for name, records in legs.items():
        out[name] = []
        for record in records:
            if isinstance(record, dict) and record.get("traceback"):
                record = dict(record, traceback=record["traceback"][-1200:])
            out[name].append(record)
    return out


def run_check(check: Check, out_dir: str, log_dir: str, deadline: float) -> dict:
    remaining = deadline - time.monotonic()
    if remaining < MIN_LAUNCH_S:
        return check_entry(check, "error", reasons=[f"the {BUDGET_S} s budget ran out before this check"])
    launch = Launch(torchrun(check.world_size, "--worker", check.name, "--out", out_dir),
                    os.path.join(log_dir, f"{check.name}.log"))
    code = launch.wait(min(check.timeout_s, remaining))
    legs, facts, stops = collect(out_dir, check)
    fields = judge(check, legs, facts).as_dict()
    entry = check_entry(check, fields.pop("status"), **fields, seconds=launch.seconds, exit_code=code,
                        log=os.path.relpath(launch.log, ROOT) if launch.log.startswith(ROOT) else launch.log,
                        facts=facts, legs=_trimmed(legs))
    if launch.timed_out:
        entry["notes"].append(f"the launch was stopped after {launch.seconds} s")
    entry["notes"] += stops
    if entry["status"] in ("fail", "error"):
        entry["log_tail"] = launch.tail()
    return entry


def drive(args: argparse.Namespace, path: str) -> int:
    import torch

    started = time.monotonic()
    deadline = started + args.budget
    selected = tuple(BY_NAME[n] for n in args.only) if args.only else CHECKS
    log_dir = os.path.splitext(path)[0] + ".logs"
    out_dir = tempfile.mkdtemp(prefix="safe_zero_gpu_")
    devices = torch.cuda.device_count()
    report: dict = {
        "script": "benchmarks/gpu/check.py", "status": "running",
        "started": datetime.datetime.now().isoformat(timespec="seconds"), "budget_s": args.budget,
        "environment": {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                        "devices": [torch.cuda.get_device_name(i) for i in range(devices)],
                        "TORCH_CUDA_ARCH_LIST": [os.environ.get("TORCH_CUDA_ARCH_LIST"),
                                                 _env().get("TORCH_CUDA_ARCH_LIST")]},
        "builds": {}, "checks": [],
    }
    print(f"safe_zero GPU check: {len(selected)} check(s) on {devices} GPU(s) "
          f"({', '.join(report['environment']['devices'])}); report {path}", flush=True)

    two_ranks = {"ok": True}
    if any(c.world_size == 2 for c in selected):
        if devices >= 2:
            two_ranks = {"ok": True, "how": f"{devices} GPUs: one rank per GPU"}
        else:
            two_ranks = probe_two_ranks_one_gpu(log_dir, out_dir, deadline)
            two_ranks["how"] = "2 ranks on 1 GPU"
        report["two_ranks"] = two_ranks
    runnable = [c for c in selected if c.world_size == 1 or two_ranks["ok"]]
    builds = {op: Build(op, log_dir) for op in dict.fromkeys(op for c in runnable for op in c.needs)}

    # Checks that need no JIT op first: they run while the ops build.
    for check in sorted(selected, key=lambda c: bool(c.needs)):
        begun = time.monotonic()
        if check not in runnable:
            entry = check_entry(check, "skip", reasons=[
                f"2-rank NCCL: needs 2 GPUs; this machine has {devices}, and 2 ranks on one GPU failed "
                f"({two_ranks.get('error', '?')})"])
        else:
            failed = []
            for op in check.needs:
                result = builds[op].wait(min(deadline, builds[op].launch.started + BUILD_TIMEOUT_S))
                report["builds"][op] = result
                if not result["ok"]:
                    failed.append(f"DeepSpeed's {op} JIT build failed ({result.get('error')}; {result['log']})")
            waited = round(time.monotonic() - begun, 1)
            if failed:
                entry = check_entry(check, "error", reasons=failed)
            else:
                entry = run_check(check, out_dir, log_dir, deadline)
            entry["waited_for_builds_s"] = waited
        report["checks"].append(entry)
        first = (entry["reasons"] or entry["notes"] or [""])[0]
        print(f"[{entry['status'].upper():5}] {check.name} ({entry['seconds']} s){': ' + first[:300] if first else ''}",
              flush=True)
        write_json(path, dict(report, status="running"))

    for build in builds.values():  # a build still running (the budget ran out before a check waited for it)
        if build.launch.poll() is None:
            build.launch.kill()
            _release_lock(build.op)
    report["seconds"] = round(time.monotonic() - started, 1)
    report["status"] = overall(report["checks"])
    write_json(path, report)
    counts = {s: sum(1 for e in report["checks"] if e["status"] == s) for s in ("pass", "fail", "error", "skip")}
    print(f"safe_zero GPU check: {report['status'].upper()} in {report['seconds']} s "
          f"({', '.join(f'{n} {s}' for s, n in counts.items() if n)}); report {path}", flush=True)
    return exit_code(report)


# ------------------------------------------------------------------------------------------- in the launches


def _rank() -> tuple:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _peers_finished(check: str, leg: str, rank: int, world_size: int, timeout_s: float) -> bool:
    """Post that this rank finished ``leg`` to the process group's store and wait for the others.

    A rank that raised while another waits in a collective (stock ZeRO-3 on rank-dependent experts) would leave
    the group hung; the store is not a collective, so this returns ``False`` instead, and the launch stops.
    """
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    prefix = f"safe_zero_gpu/{check}/{leg}/"
    store.set(prefix + str(rank), "done")
    try:
        store.wait([prefix + str(r) for r in range(world_size)], datetime.timedelta(seconds=timeout_s))
        return True
    except Exception:  # noqa: BLE001 - a timeout: some rank is stuck
        return False


def worker(check_name: str, out_dir: str) -> int:
    """One rank of one check's launch: run its legs in order, rewriting this rank's record file after each."""
    import gc

    rank, local_rank, world_size = _rank()
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        device = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(device)
        # Two ranks on one GPU (where NCCL allows it): DeepSpeed places its engine on cuda:$LOCAL_RANK.
        os.environ["LOCAL_RANK"] = str(device)
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo",
                               timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    from benchmarks.gpu import bodies

    check = BY_NAME[check_name]
    path = os.path.join(out_dir, f"{check_name}.rank{rank}.json")
    record: dict = {"rank": rank, "facts": bodies.facts(), "legs": {}}
    write_json(path, record)
    linear = torch.nn.functional.linear
    for leg in check.legs:
        begun = time.monotonic()
        result = bodies.run_leg(getattr(bodies, leg.body), **leg.kwargs)
        result["seconds"] = round(time.monotonic() - begun, 2)
        record["legs"][leg.name] = result
        write_json(path, record)
        print(f"rank {rank}: {check_name}/{leg.name}: {result.get('error') or 'ok'} ({result['seconds']} s)",
              flush=True)
        # A ZeRO-3 engine leaves torch's linear replaced by DeepSpeed's wrapper: each leg starts with torch's own.
        torch.nn.functional.linear = linear
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        if world_size > 1 and not _peers_finished(check_name, leg.name, rank, world_size, LEG_SYNC_S):
            record["stopped"] = (f"rank {rank} stopped the launch after {leg.name}: another rank did not finish it "
                                 f"within {LEG_SYNC_S} s (left waiting in a collective)")
            write_json(path, record)
            os._exit(3)
    import torch.distributed as dist

    if world_size > 1:
        dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def build(op: str) -> int:
    """JIT-build (or load) DeepSpeed's ``op``, saying how long it took; a stale lock is named, not waited on."""
    from deepspeed.accelerator import get_accelerator

    from safe_zero.op_builds import check_op_build

    builder_name = OPS[op][0]
    check_op_build(builder_name, say=lambda message: print(message, flush=True))
    begun = time.monotonic()
    get_accelerator().create_op_builder(builder_name).load(verbose=False)
    print(f"{op}: loaded in {time.monotonic() - begun:.1f} s", flush=True)
    return 0


def probe_nccl(out_dir: str) -> int:
    """One rank of the two-ranks-on-one-GPU probe: an NCCL all-reduce with both ranks on device 0."""
    rank, local_rank, _ = _rank()
    path = os.path.join(out_dir, f"probe.rank{rank}.json")
    try:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60))
        t = torch.ones(1, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        write_json(path, {"ok": t.item() == 2.0})
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - the refusal is the answer
        write_json(path, {"ok": False, "error": f"{type(e).__name__}: {e}"[-2000:]})
        os._exit(1)
    os._exit(0)


# ------------------------------------------------------------------------------------------------------ main


def parse(argv: list) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", help="where the JSON report goes (default: $OUT/gpu_check_report.json when $OUT "
                                         "is set, else benchmarks/gpu/report.json)")
    parser.add_argument("--only", nargs="+", choices=sorted(BY_NAME), help="run these checks only")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run (default %(default)s)")
    parser.add_argument("--list", action="store_true", help="print the checks as a Markdown table and exit")
    parser.add_argument("--worker", metavar="CHECK", help=argparse.SUPPRESS)
    parser.add_argument("--build", choices=sorted(OPS), help=argparse.SUPPRESS)
    parser.add_argument("--probe-nccl", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.list:
        print(markdown_table())
        return 0
    if args.worker:
        return worker(args.worker, args.out)
    if args.build:
        return build(args.build)
    if args.probe_nccl:
        return probe_nccl(args.out)
    path = report_path(args.report)
    import torch

    if torch.cuda.is_available():
        signal.signal(signal.SIGTERM, _stop_all)
        signal.signal(signal.SIGINT, _stop_all)
    else:
        why = (f"torch {torch.__version__} in {sys.executable} is a CPU build: set PYTHON to an interpreter with CUDA "
               "torch" if torch.version.cuda is None else f"torch {torch.__version__} sees no GPU")
        print(f"no CUDA: skipped ({why})", flush=True)
        write_json(path, skipped_report(f"no CUDA: {why}"))
        return NO_CUDA_EXIT
    try:
        return drive(args, path)
    finally:
        for launch in list(_LIVE):
            launch.kill()


if __name__ == "__main__":
    sys.exit(main())
