"""scripts/gpu_checklist.py: every stage's command parses with its own script's arguments (a typo would cost a
GPU session's minutes), and the runner's mechanics on the CPU with stand-in stages: logs as printed, a failing
command's code, a command stopped at its time limit keeping what it printed, stages past the budget skipped."""
import inspect
import os
import re
import textwrap

import pytest

from mnemojax.bench import attention, gpu_checklist, profile_predictor, profile_step, step
from models import mosaic_attention, pallas_attention
from models.attention import split_kernel_options
from tests import REPO


def check_kernel_options(label: str):
    """Each option of a bench_attention label (`impl+name=value`) is a parameter of the step's planner or of the
    kernels' call for that implementation, so a misspelt option fails here rather than on the GPU."""
    impl, options = attention.split_label(label)
    kernels = {"mosaic": (mosaic_attention.plan_step, mosaic_attention._paged_attention_mosaic),
               "pallas": (pallas_attention.plan_step, pallas_attention._paged_attention_pallas)}
    if impl not in kernels:
        assert not options, label
        return
    planner, call = (inspect.signature(f).parameters for f in kernels[impl])
    tiling, codegen = split_kernel_options(impl, options)
    assert set(tiling) <= set(planner) and set(codegen) <= set(call), (label, set(codegen) - set(call))


def test_every_stage_command_parses_with_its_script():
    parsers = {"scripts/bench_attention.py": attention.parse_args, "scripts/bench_step.py": step.parse_args,
               "scripts/profile_step.py": profile_step.parser().parse_args,
               "scripts/profile_predictor.py": profile_predictor.parser().parse_args}
    seen = set()
    for stage in gpu_checklist.STAGES:
        for args in stage.commands:
            args = gpu_checklist.command_args(args, "/tmp/out")
            if args[0] == "-m":  # pytest: the marker it selects exists
                assert args[:5] == ["-m", "pytest", "-q", "-m", "gpu"]  # what each process of a shard gets
                assert dict(stage.env)["JAX_PLATFORMS"] == "cuda,cpu"
                if stage.shards > 1:  # processes that share the GPU allocate as they go
                    assert dict(stage.env)["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
                continue
            parsed = parsers[args[0]](args[1:])
            seen.add(args[0])
            if args[0] in ("scripts/bench_attention.py", "scripts/bench_step.py"):
                for label in parsed.impls:
                    check_kernel_options(label)
    assert seen == set(parsers)
    assert gpu_checklist.command_args(("--out", "{out}/p.json"), "/x") == ["--out", "/x/p.json"]


def test_labels_timed_with_pages_of_128_have_their_gpu_test():
    """Each Mosaic label a stage times with pages of 128 runs kernel options that the `gpu` test of pages of 128
    checks (`new-correct` selects it), so a candidate changed in one place and not the other fails here."""
    from tests.models.test_mosaic_attention import PAGES_OF_128
    tested = [options for _, options in PAGES_OF_128.values()]
    timed = set()
    for stage in gpu_checklist.STAGES:
        for args in stage.commands:
            if "--page_size" in args and args[args.index("--page_size") + 1] == "128":
                flag = "--impl" if "--impl" in args else "--attention"
                timed.update(args[args.index(flag) + 1].split(","))
    assert {"mosaic", "mosaic+overlap=true+pingpong=false", "mosaic+consumers=3+overlap=false+pingpong=false"} <= timed
    for label in timed:
        assert attention.split_label(label)[1] in tested, label
    assert "pages_of_128" in gpu_checklist.NEW_CORRECT


def _stage(name, code, timeout_s=30, min_s=0):
    return gpu_checklist.Stage(name, (("-c", code),), timeout_s, min_s, env=(("CHECKLIST_TEST", "yes"),), why=name)


def test_runner_logs_exits_timeouts_and_budget(tmp_path, monkeypatch, capsys):
    stages = (_stage("ok", "import os; print('hello', os.environ['CHECKLIST_TEST'])"),
              _stage("fails", "import sys; print('bad'); sys.exit(3)"),
              _stage("slow", "import time; print('started', flush=True); time.sleep(60)", timeout_s=2),
              _stage("late", "print('never')", min_s=10 ** 6))
    monkeypatch.setattr(gpu_checklist, "STAGES", stages)
    monkeypatch.setattr(gpu_checklist, "STAGE_NAMES", tuple(s.name for s in stages))
    rows = gpu_checklist.main(["--out", str(tmp_path), "--budget_s", "100"])
    assert [(r["stage"], r["exit"].split(":")[0]) for r in rows] == [
        ("ok", "0"), ("fails", "3"), ("slow", "timeout"), ("late", "skipped")]
    assert rows[0]["tail"][-1] == "hello yes" and rows[1]["tail"][-1] == "bad"
    log = (tmp_path / "slow.log").read_text()
    assert "started" in log and "[stopped after 2 s" in log and 1.5 < rows[2]["seconds"] < 30
    assert not (tmp_path / "late.log").exists()
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("late") and "skipped: budget" in out


def test_unknown_stage_is_refused(capsys):
    with pytest.raises(SystemExit):
        gpu_checklist.parse_args(["--stages", "correctness,speed"])
    assert "--stages: unknown ['speed']" in capsys.readouterr().err
    assert [s.name for s in gpu_checklist.parse_args(["--stages", "step,correctness"]).stages] == [
        "correctness", "step"]  # run in the checklist's order


STAND_IN_TESTS = textwrap.dedent("""
    import os
    import time

    import pytest


    @pytest.mark.gpu
    @pytest.mark.parametrize("i", range(7))
    def test_one(i):
        with open(f"ran.{i}", "w") as f:
            f.write(str(os.getpid()))
        if i == 0:  # process 0's first test: processes 1 and 2 run meanwhile, or this waits in vain
            deadline = time.monotonic() + 60
            while not (os.path.exists("ran.1") and os.path.exists("ran.2")) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert os.path.exists("ran.1") and os.path.exists("ran.2"), "not at once"
        assert i != 5, "five fails"


    def test_not_gpu():  # deselected by -m gpu
        open("never", "w").close()


    @pytest.mark.slowgpu
    @pytest.mark.parametrize("i", range(2))
    def test_sleeps(i):
        open(f"started.{os.getpid()}", "w").close()
        time.sleep(120)
""")


def _sharded(monkeypatch, tmp_path, marker, timeout_s):
    (tmp_path / "test_stand_in.py").write_text(STAND_IN_TESTS)
    # The stand-in needs none of the installed pytest plugins, whose loading (hypothesis's and schemathesis's above
    # all) took ~5 s a process on the 2-core VM: the collection and two processes' start then filled the 10-s limit
    # before a test began when another pytest worker held the other core (CI with `-n 2` failed so)
    stage = gpu_checklist.Stage("tests", (("-m", "pytest", "-q", "-m", marker, "test_stand_in.py"),), timeout_s, 0,
                                shards=3, why="tests", env=(("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1"),))
    monkeypatch.setattr(gpu_checklist, "REPO", str(tmp_path))  # pytest's rootdir there, as the repository's is
    monkeypatch.setattr(gpu_checklist, "STAGES", (stage,))
    monkeypatch.setattr(gpu_checklist, "STAGE_NAMES", ("tests",))
    [row] = gpu_checklist.main(["--out", str(tmp_path / "logs"), "--budget_s", "300"])
    return row, (tmp_path / "logs" / "tests.log").read_text()


def test_sharded_tests_run_in_processes_at_once(tmp_path, monkeypatch):
    row, log = _sharded(monkeypatch, tmp_path, "gpu", 120)
    pids = {i: (tmp_path / f"ran.{i}").read_text() for i in range(7)}
    # dealt round-robin in collection order to 3 processes, which ran at the same time (test 0 waited for 1 and 2)
    assert pids[0] == pids[3] == pids[6] and pids[1] == pids[4] and pids[2] == pids[5]
    assert len({pids[0], pids[1], pids[2]}) == 3 and str(os.getpid()) not in pids.values()
    assert not (tmp_path / "never").exists()
    assert row["exit"] == "1"  # process 2's test 5 failed
    assert "[7 tests in 3 processes at once]" in log and "five fails" in log
    assert "AssertionError: not at once" not in log
    assert [line.split(":")[0] for line in row["tail"][-3:]] == [
        "process 0 (3 tests, exit 0)", "process 1 (2 tests, exit 0)", "process 2 (2 tests, exit 1)"]
    assert "1 failed, 1 passed" in row["tail"][-1]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["tests.log"]  # the processes' logs merged


@pytest.mark.slow  # ~15 s on 2 cores: the sharded runner's other paths stay in the default suite
def test_sharded_tests_stop_at_the_time_limit(tmp_path, monkeypatch):
    row, log = _sharded(monkeypatch, tmp_path, "slowgpu", 15)
    assert row["exit"] == "timeout" and row["seconds"] < 60
    started = [int(p.name.split(".")[1]) for p in tmp_path.glob("started.*")]
    assert len(started) == 2 and "[stopped after 15 s" in log
    for pid in started:  # stopped, not left running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_readme_names_only_stages_that_exist():
    """Every `--stages a,b` the README tells a device session to run names stages of the checklist (a stage renamed
    or dropped in one place and not the other would be refused on the GPU, minutes into the session)."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        named = re.findall(r"--stages ([a-z0-9][a-z0-9,-]*[a-z0-9])", f.read())
    assert "new-correct,chunk-2048,head-dim-64" in named and "decode-paired" in named  # the queue is read
    unknown = {s for group in named for s in group.split(",") if s not in gpu_checklist.STAGE_NAMES}
    assert not unknown, unknown
