"""The open GPU measurements in one command, for a device session's few calls of at most 10 minutes each.

    python scripts/gpu_checklist.py                       # every stage, in order, within --budget_s
    python scripts/gpu_checklist.py --stages correctness,attention --budget_s 560 --out $OUT
    python scripts/gpu_checklist.py --dry_run             # the commands only

Runs the README's "On a GPU: what is left to measure" commands stage by stage, each in its own process (a
stage's GPU memory is freed before the next; a correctness stage's tests in several at once, `Stage.shards`), in
the order of `STAGES`, stopping a command at its stage's time
limit or at what is left of `--budget_s` (keep it under the device's 10 minutes a call, with room for the start),
whichever comes first. Each stage's output goes, as it is printed, to `<out>/<stage>.log` (default out: $OUT
where it is set, else ./gpu_logs): a stopped command's log keeps what it printed. Prints a table last: each stage,
its exit (or "timeout", or "skipped: budget"), seconds, and the last lines of its log. Stages that do not fit
what is left of the budget are skipped, not started, so a later call can run them (`--stages`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    commands: tuple  # argument lists, each run as `python <args>` from the repository root ({out}: the logs')
    timeout_s: int  # the stage's time limit (all its commands)
    min_s: int  # not started with less than this left of the budget
    env: tuple = ()  # (name, value) pairs set for its commands
    why: str = ""
    # a pytest command's tests split among this many processes run at once (`run_sharded`): the kernels' compiles
    # and the reference's run on the host's cores in parallel, the GPU shared
    shards: int = 1


# the eighteenth session's default that the twenty-third session's H100 run undid (compute-bound two-consumer
# launches redistributing their registers: chunk 2048 at 1M 69.1 ms against 63.2 without), timed beside the defaults
EIGHTEENTH = "mosaic+max_registers=true"
# the `gpu` tests of what the defaults changed since a GPU last checked them: the thirty-eighth session's (three
# consumers with FlashAttention-3's loop for compute-bound prefill launches at head dim 64; the `gpu` tests of three
# consumers with `overlap` that passed on an H200 that session were split launches) and the `long-c3` stage's candidate
# on the same compute-bound step, the engine with them, and pages of 128 with the candidates timed at that size
# (`test_labels_timed_with_pages_of_128_have_their_gpu_test`)
NEW_CORRECT = "compute_bound or engine or pages_of_128"
# the Llama-3-8B shape's chunk 2048 against cuDNN (the target: at least as fast, in the same run), with pages of 128:
# FlashAttention-3's loop with turns won at the 8B shape on an H200 (thirty-eighth session: 256K 13.98 against
# 15.07 ms, cuDNN 14.59; 1M 59.59 against 61.60, cuDNN 59.19) and lost at the 70B shape's (1M: 129.2 against
# 126.9, cuDNN 117.2), one sample each: timed again before it becomes a default for some shapes
HD128_CANDIDATES = ("mosaic+overlap=true+pingpong=false", "mosaic+overlap=true")
# the llama3.2-1b shape's chunk 8192 at 1M (its TTFT's attention; the target of 150 s needs ~470 TFLOP/s), against
# the defaults (three consumers with FlashAttention-3's loop since the thirty-eighth session): on the H200 then,
# three consumers without `overlap` or turns were the fastest with pages of 128 (143.4 ms against 147.0) and the
# slowest of the three with pages of 16 (166.0 against 154.6); `overlap` without turns (154.6 / 158.9); two
# consumers, the old default (158.2 / 183.1). Options spelled out, as the defaults choose them per launch.
TTFT_CANDIDATES = ("mosaic+consumers=3+overlap=false+pingpong=false", "mosaic+consumers=3+overlap=true+pingpong=false",
                   "mosaic+consumers=2")
# the fastest at pages of 128, for the whole TTFT (152.3 s with the defaults' launches on the H200; projected from
# the attention alone, not measured, ~148.5 s with it)
TTFT_CANDIDATE = ("--attention", TTFT_CANDIDATES[0], "--page_size", "128")

# The `gpu` tests in TEST_SHARDS processes at once: each compiles its kernels and runs the float32 reference on the
# device machine's 16 cores, where one process left most of them idle (the sixteenth session's 17 tests took 161 s
# in one, at shapes of a few MiB: mostly compiling). Each process allocates GPU memory as it needs it (JAX's
# default takes 75% of it at start, which a second process would then not find).
TEST_SHARDS = 4
SHARDED_TESTS_ENV = (("JAX_PLATFORMS", "cuda,cpu"), ("XLA_PYTHON_CLIENT_PREALLOCATE", "false"))

STAGES = (
    Stage("new-correct", (("-m", "pytest", "-q", "-m", "gpu", "tests/models/test_mosaic_attention.py", "-k",
                           NEW_CORRECT),), 240, 120, env=SHARDED_TESTS_ENV, shards=TEST_SHARDS,
          why="the thirty-eighth session's default (three consumers with FlashAttention-3's loop for compute-bound "
              "prefill launches at head dim 64, pages of 16 and 128; the same launch without that loop or turns, "
              "the long-c3 stage's) and the candidates timed with pages of 128, "
              "against the float32 reference, and the engine's greedy tokens with attention='auto' (mosaic on "
              "Hopper)"),
    Stage("chunk-2048", tuple(("scripts/bench_attention.py", "--impl", ",".join(("mosaic",) + HD128_CANDIDATES),
                               *shape, "--page_size", "128", "--chunks", "2048", "--decode_batches", "", "--samples",
                               "1", "--calls", "10", "--repeats", "3")
                              for shape in (("--contexts", "262144,1048576"),
                                            ("--model_shape", "llama3-70b", "--contexts", "1048576"))), 240, 100,
          env=(("MOSAIC_GPU_DUMP_PTXAS", "1"),),
          why="issue 15: prefill attention at chunk 2048 against cuDNN in the same run (target: >= 550 TFLOP/s and "
              "at least as fast), with pages of 128: the defaults and FlashAttention-3's loop with and without "
              "turns, at the 8B shape (256K and 1M) then the 70B shape (1M), with torch SDPA and attention_mgpu"),
    Stage("head-dim-64", tuple(("scripts/bench_attention.py", "--impl", ",".join(("mosaic",) + TTFT_CANDIDATES),
                                "--model_shape", "llama3.2-1b", "--page_size", page, "--contexts", "1048576",
                                "--chunks", "8192", "--decode_batches", "", "--samples", "2", "--calls", "3",
                                "--no_baselines") for page in ("16", "128")), 200, 90,
          env=(("MOSAIC_GPU_DUMP_PTXAS", "1"),),
          why="issue 15: the llama3.2-1b TTFT's attention (chunk 8192 at 1M; ~470 TFLOP/s needed for 150 s): the "
              "defaults (three consumers, FlashAttention-3's loop) against three consumers without it or turns, "
              "without turns, and two consumers, with pages of 16 and of 128; ptxas's report in the log"),
    # the whole command took 216 s on an H200 with a 152-s TTFT (thirty-eighth session)
    Stage("long-c3", (("scripts/bench_step.py", "--long", *TTFT_CANDIDATE, "--decode_contexts", "32768"),), 590, 250,
          why="issue 15: the llama3.2-1b exact 1M-token prefill (TTFT, target <= 150 s) with three consumers "
              "without FlashAttention-3's loop or turns and pages of 128 (the fastest attention at pages of 128 on "
              "an H200; the defaults' launches took 152.3 s)"),
    # Decode against torch SDPA, timed in turns: the H100's separate medians put ours 3-7% behind, about the spread
    # of identical kernels within one run (sixteenth session), and the decode kernel's own GPU time at torch's whole
    # call (twenty-third); 30 rounds say which, and the profiles say where the rest goes. 50 calls a sample spread
    # its one dispatch and wait, which differ between jax and torch, to about 1 us a call. B=8 at 1M does not fit
    # an H100 beside torch's copy (the twenty-third session's run: out of memory).
    Stage("decode-paired", tuple(("scripts/bench_attention.py", "--impl", "mosaic", "--contexts", contexts,
                                  "--chunks", "", "--decode_batches", batches, "--paired_decode", "30", "--calls",
                                  "50", "--repeats", "3", "--no_baselines", "--profile")
                                 for contexts, batches in (("262144,1048576", "1"), ("262144", "8"))), 240, 120,
          why="issue 15: decode (8B shape, pages of 16) against torch SDPA in 30 alternating rounds (the target: at "
              "least as fast at every context), B=1 at 256K and 1M, B=8 at 256K; the GPU kernels of each at the "
              "largest context"),
    Stage("new-speed", (("scripts/bench_attention.py", "--impl", f"mosaic,{EIGHTEENTH}", "--contexts",
                         "262144,1048576", "--chunks", "32,2048", "--decode_batches", "1", "--samples", "3",
                         "--calls", "10", "--repeats", "3"),
                        ("scripts/bench_attention.py", "--impl", f"mosaic,{EIGHTEENTH}", "--model_shape",
                         "llama3-70b", "--contexts", "1048576", "--chunks", "32,2048", "--decode_batches", "1",
                         "--samples", "3", "--calls", "10", "--repeats", "3")), 300, 150,
          why="issue 15: the twenty-third session's default against the eighteenth's side by side (8B shape at "
              "256K and 1M, decode B=1; 70B shape at 1M), with cuDNN, torch SDPA and jax's attention_mgpu in the "
              "same run"),
    Stage("correctness", (("-m", "pytest", "-q", "-m", "gpu", "tests/models"),), 300, 120, env=SHARDED_TESTS_ENV,
          shards=TEST_SHARDS,
          why="every compiled kernel and option against the float32 reference, and the engine's greedy tokens "
              "with the compiled kernels (attention='auto' chooses mosaic on Hopper)"),
    Stage("long", (("scripts/bench_step.py", "--long", "--attention", "mosaic", "--page_size", "128",
                    "--decode_contexts", "32768"),), 590, 250,
          why="issue 15: the llama3.2-1b exact 1M-token prefill (TTFT, target <= 150 s) and its decode with the "
              "defaults and pages of 128"),
    Stage("attention", (("scripts/bench_attention.py", "--impl", "mosaic,pallas", "--chunks", "32,256,2048",
                         "--calls", "10"),), 540, 240,
          why="issue 15: Llama-3-8B chunk-size curves at 256K and 1M, decode, against cuDNN, torch SDPA and jax's "
              "FA3-style Mosaic kernel, one layer on the step's plan for the step's kind"),
    Stage("attention-70b", (("scripts/bench_attention.py", "--impl", "mosaic,pallas", "--model_shape", "llama3-70b",
                             "--chunks", "32,256,2048", "--decode_batches", "1", "--calls", "10"),), 540, 240,
          why="issue 15: the 70B shape (64 q heads) at 256K and 1M"),
    Stage("step", (("scripts/bench_step.py", "--attention", "pallas,mosaic"),), 540, 240,
          why="issues 12 and 15: prefill MFU at 32K, decode MBU at 32K-512K, each attention side by side"),
    Stage("profile", (("scripts/profile_step.py", "--model", "llama3-8b", "--dtype", "bfloat16", "--batch", "1",
                       "--context", "4096"),
                      ("scripts/profile_step.py", "--model", "llama3.2-1b", "--dtype", "bfloat16", "--batch", "32",
                       "--context", "4096", "--steps", "20")), 540, 180,
          why="issue 12: kernels and launches per step, device busy against wall time"),
    Stage("predictor", (("scripts/profile_predictor.py", "--out", "{out}/predictor-profile.json"),), 540, 300,
          why="issue 14: the GPU predictor profile, written to the logs' folder (commit it as "
              "mnemojax/scheduling/profiles/<hardware>.json)"),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default=",".join(STAGE_NAMES),
                   help=f"comma-separated stages to run, in this order: {', '.join(STAGE_NAMES)}")
    p.add_argument("--budget_s", type=float, default=540.0, help="seconds for all the stages of this call")
    p.add_argument("--out", default=None, help="folder of the logs (default: $OUT where set, else ./gpu_logs)")
    p.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    return p


def parse_args(argv=None):
    p = parser()
    args = p.parse_args(argv)
    names = [x for x in args.stages.split(",") if x]
    unknown = [x for x in names if x not in STAGE_NAMES]
    if unknown or not names:
        p.error(f"--stages: unknown {unknown or 'none given'}; known: {', '.join(STAGE_NAMES)}")
    args.stages = [s for s in STAGES if s.name in names]
    args.out = args.out or os.environ.get("OUT") or os.path.join(os.getcwd(), "gpu_logs")
    return args


def command_args(args: tuple, out: str) -> list[str]:
    return [a.replace("{out}", out) for a in args]


def command_line(stage: Stage, args: tuple, out: str) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in stage.env)
    return (env + " " if env else "") + shlex.join(["python", *command_args(args, out)])


def tail(path: str, n: int = 3) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [line.rstrip() for line in f.readlines()[-n:]]
    except OSError:
        return []


def is_pytest(args) -> bool:
    return tuple(args[:2]) == ("-m", "pytest")


def run_stage(stage: Stage, out: str, seconds: float) -> str:
    """Runs the stage's commands one after the other, output to <out>/<stage>.log, within `seconds`; returns
    the exit: "0", the first failing command's code, or "timeout". A pytest command of a stage with `shards` > 1
    runs as `run_sharded`."""
    log = os.path.join(out, f"{stage.name}.log")
    env = dict(os.environ, PYTHONUNBUFFERED="1", **dict(stage.env))
    end = time.monotonic() + seconds
    with open(log, "w", encoding="utf-8") as f:
        for args in stage.commands:
            f.write(f"$ {command_line(stage, args, out)}\n")
            f.flush()
            left = end - time.monotonic()
            if left <= 0:
                return "timeout"
            if stage.shards > 1 and is_pytest(args):
                rc = run_sharded(command_args(args, out), stage.shards, env, f, log, left)
            else:
                try:
                    rc = subprocess.run([sys.executable, *command_args(args, out)], cwd=REPO, env=env, stdout=f,
                                        stderr=subprocess.STDOUT, timeout=left).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            if rc == "timeout":
                f.write(f"\n[stopped after {seconds:.0f} s: the stage's time limit or the budget]\n")
                return "timeout"
            if rc:
                return str(rc)
    return "0"


def run_sharded(args: list[str], shards: int, env: dict, f, log: str, seconds: float):
    """The pytest command `args` (`-m pytest <options> <paths or -k ...>`) with its tests split among `shards`
    processes at once: the tests it collects (`--collect-only`), dealt round-robin in collection order, each
    process given `args[:5]` (`-m pytest -q -m gpu`) and its share's test ids. Each process writes
    `<log>.<i>` as it runs; they are appended to `f` when all have ended, then one line a process (its tests and
    pytest's last line). Returns the first failing process's code (or the collection's), 0, or "timeout" (every
    process stopped at `seconds`, their logs appended as far as they got)."""
    end = time.monotonic() + seconds
    try:
        found = subprocess.run([sys.executable, *args, "--collect-only"], cwd=REPO, env=env, capture_output=True,
                               text=True, timeout=seconds)
    except subprocess.TimeoutExpired:
        return "timeout"
    ids = [line for line in found.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if found.returncode or not ids:
        f.write(found.stdout + found.stderr)
        return found.returncode or 5  # pytest's "no tests collected"
    groups = [ids[i::shards] for i in range(min(shards, len(ids)))]
    f.write(f"[{len(ids)} tests in {len(groups)} processes at once]\n")
    f.flush()
    procs, logs = [], []
    for i, group in enumerate(groups):
        logs.append(open(f"{log}.{i}", "w", encoding="utf-8"))
        procs.append(subprocess.Popen([sys.executable, *args[:5], *group], cwd=REPO, env=env, stdout=logs[-1],
                                      stderr=subprocess.STDOUT))
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.0, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append("timeout")
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    summary = []
    for i, (group, handle, code) in enumerate(zip(groups, logs, codes)):
        handle.close()
        with open(handle.name, encoding="utf-8", errors="replace") as g:
            lines = g.readlines()
        os.remove(handle.name)
        f.write(f"\n[process {i}: {len(group)} tests]\n")
        f.writelines(lines)
        summary.append(f"process {i} ({len(group)} tests, exit {code}): {lines[-1].rstrip() if lines else ''}")
    f.write("\n" + "\n".join(summary) + "\n")
    f.flush()
    if "timeout" in codes:
        return "timeout"
    return next((c for c in codes if c), 0)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    start = time.monotonic()
    print("command:", shlex.join(["python", "scripts/gpu_checklist.py", *(sys.argv[1:] if argv is None else argv)]))
    if args.dry_run:
        for stage in args.stages:
            at_once = f", its tests in {stage.shards} processes at once" if stage.shards > 1 else ""
            print(f"# {stage.name} (up to {stage.timeout_s} s{at_once}): {stage.why}")
            for a in stage.commands:
                print(command_line(stage, a, args.out))
        return []
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for stage in args.stages:
        left = args.budget_s - (time.monotonic() - start)
        if left < stage.min_s:
            rows.append(dict(stage=stage.name, exit=f"skipped: budget ({left:.0f} s left, needs {stage.min_s})",
                             seconds=0.0, tail=[]))
            continue
        t0 = time.monotonic()
        print(f"{stage.name}: {stage.why}", flush=True)
        exit_ = run_stage(stage, args.out, min(stage.timeout_s, left))
        rows.append(dict(stage=stage.name, exit=exit_, seconds=time.monotonic() - t0,
                         tail=tail(os.path.join(args.out, f"{stage.name}.log"), max(3, stage.shards + 1))))
    print(f"\nlogs in {args.out}")
    print(f"{'stage':<14} {'exit':<40} {'s':>6}  last lines of the log")
    for r in rows:
        lines = r["tail"] or [""]
        print(f"{r['stage']:<14} {r['exit']:<40} {r['seconds']:>6.0f}  {lines[0]}")
        for line in lines[1:]:
            print(f"{'':<14} {'':<40} {'':>6}  {line}")
    return rows
