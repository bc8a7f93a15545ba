"""Flags derived from config dataclasses: names, defaults, help from field docstrings, enums, nesting; and the
commands' answer to a bad command line (a message naming the flag, exit status 1, no traceback)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Literal

import pytest
from absl import flags

from mnemojax.cli import dashed_names, define_flags, field_docs, from_flags
from tests.server_utils import ROOT, serve_env


@dataclasses.dataclass(frozen=True)
class Inner:
    chunk_size: int = 256
    """Largest prefill chunk."""
    policy: Literal["fcfs", "ilrs"] = "fcfs"
    """Prefill order."""
    target_ms: float | None = None
    """Adaptive chunking target."""


@dataclasses.dataclass(frozen=True)
class Outer:
    model: str = "tiny"
    """A preset or a checkpoint directory."""
    verbose: bool = False
    """Say more."""
    inner: Inner = dataclasses.field(default_factory=Inner)


@dataclasses.dataclass(frozen=True)
class Clash:
    chunk_size: int = 1
    inner: Inner = dataclasses.field(default_factory=Inner)


def _parse(argv, cls=Outer, **kw):
    fv = flags.FlagValues()
    names = define_flags(cls, fv, **kw)
    fv(["prog", *argv])
    return fv, names


def test_one_flag_per_field_with_its_docstring_as_help():
    fv, names = _parse([])
    assert names == ["model", "verbose", "chunk_size", "policy", "target_ms"]
    assert fv["chunk_size"].help == "Largest prefill chunk." and fv["model"].help == "A preset or a checkpoint directory."
    assert field_docs(Inner) == {"chunk_size": "Largest prefill chunk.", "policy": "Prefill order.",
                                 "target_ms": "Adaptive chunking target."}
    assert from_flags(Outer, fv) == Outer()


def test_values_types_enums_and_nesting():
    fv, _ = _parse(["--model=/ckpt", "--verbose", "--chunk_size=64", "--policy=ilrs", "--target_ms=12.5"])
    assert from_flags(Outer, fv) == Outer("/ckpt", True, Inner(64, "ilrs", 12.5))
    with pytest.raises(flags.IllegalFlagValueError):
        _parse(["--policy=nope"])
    with pytest.raises(flags.IllegalFlagValueError):
        _parse(["--chunk_size=x"])


def test_command_defaults_skips_and_overrides():
    fv, names = _parse([], defaults={"chunk_size": 4096}, skip=("verbose",))
    assert "verbose" not in names and fv["chunk_size"].value == 4096
    assert from_flags(Outer, fv, model="m") == Outer("m", False, Inner(4096))


def test_optional_numbers_take_none():
    """A command may default an optional field to a number; "none" still gives the field None."""
    fv, _ = _parse([], defaults={"target_ms": 50.0})
    assert fv["target_ms"].value == 50.0
    fv, _ = _parse(["--target_ms=none"], defaults={"target_ms": 50.0})
    assert from_flags(Outer, fv) == Outer()
    with pytest.raises(flags.IllegalFlagValueError):
        _parse(["--target_ms=x"])


def test_vllms_dashed_names_are_taken():
    """vLLM's spellings: dashes for underscores, `--no-` for a boolean's `--no`; a flag's value, anything after
    `--` and a name that is no flag stay as typed."""
    fv = flags.FlagValues()
    define_flags(Outer, fv)
    argv = dashed_names(["prog", "--chunk-size", "64", "--no-verbose", "--target-ms=12.5", "--model", "--odd-name"],
                        fv)
    assert argv == ["prog", "--chunk_size", "64", "--noverbose", "--target_ms=12.5", "--model", "--odd-name"]
    fv(argv)
    assert from_flags(Outer, fv) == Outer("--odd-name", False, Inner(64, "fcfs", 12.5))
    assert dashed_names(["prog", "--verbose", "--policy=ilrs"], fv) == ["prog", "--verbose", "--policy=ilrs"]
    rest = ["prog", "--not-a-flag", "--", "--chunk-size"]
    assert dashed_names(rest, fv) == rest
    mesh = flags.FlagValues()  # vLLM's names of our settings, where the command has them
    for name in ("tp", "spp", "page_size"):
        flags.DEFINE_integer(name, 1, "", flag_values=mesh)
    flags.DEFINE_string("scheduler_policy", "fcfs", "", flag_values=mesh)
    assert dashed_names(["prog", "--tensor-parallel-size", "2", "--pipeline_parallel_size=2", "--block-size=8",
                         "--scheduling-policy", "priority"], mesh) == [
        "prog", "--tp", "2", "--spp=2", "--page_size=8", "--scheduler_policy", "priority"]
    assert dashed_names(["prog", "--block-size=8"], fv) == ["prog", "--block-size=8"]  # no page_size flag: as typed


def test_a_name_in_two_configs_is_refused():
    with pytest.raises(ValueError, match="chunk_size"):
        _parse([], cls=Clash)


@pytest.mark.parametrize("argv, message", [
    (["mnemojax.serve", "/path/to/model"], "unexpected arguments: ['/path/to/model']"),  # vLLM's `serve MODEL`
    (["mnemojax.serve", "--port=70000"], "port must be in 0..65535, got 70000"),
    (["mnemojax.serve", "--page-size=0"], "page_size must be a positive integer, got 0"),  # vLLM's dashes
    (["mnemojax.serve", "--tensor-parallel-size", "0"], "tp must be a positive integer, got 0"),  # vLLM's name
    (["mnemojax.serve", "--shutdown_grace_s=nan"], "shutdown_grace_s must be >= 0, got nan"),
    (["mnemojax.serve", "--model=/nonexistent"], "'/nonexistent' is neither a preset"),  # found while loading
    (["mnemojax.serve", "--chat_template=no/such/file"], "chat_template: 'no/such/file' is neither a file nor"),
    (["mnemojax.serve", "--chat_template={{ messages }}"],  # before the model loads
     "chat_template: model 'tiny' has no Hugging Face tokenizer"),
    (["mnemojax.serve", "--response_role="], "response_role must not be empty"),
    (["mnemojax.engine", "--max_num_seqs=0"], "max_num_seqs"),
    (["mnemojax.engine", "--noprecompile", "--max_tokens=9000"], "max_tokens (9000) = 9017 exceeds max_model_len"),
    (["mnemojax.engine", "--predictor_profile=/nonexistent.json"], "predictor_profile is set, but no runtime predictor"),
    (["mnemojax.serve", "--predictor_profile=/nonexistent.json"],  # refused before the precompile
     "predictor_profile '/nonexistent.json': [Errno 2] No such file"),
    (["mnemojax.serve", "--coordinator_address=localhost", "--num_processes=2", "--process_id=1"],
     "coordinator_address must be host:port with a port in 1..65535, got 'localhost'"),
    (["mnemojax.serve", "--coordinator_address=localhost:99999", "--num_processes=2", "--process_id=1"],
     "got 'localhost:99999'"),
    (["mnemojax.sim", "stray"], "unexpected arguments: ['stray']"),
    (["mnemojax.sim", "--num-pages", "1"], "num_pages must be at least 2"),
    pytest.param(["mnemojax.sim", "--num-pagez=1"], "Unknown command line flag 'num-pagez'",  # as typed
                 marks=pytest.mark.slow),  # a process start; `dashed_names` is tested above
    (["mnemojax.sim", "--trace=/nonexistent.jsonl"], "No such file or directory: '/nonexistent.jsonl'"),
    (["mnemojax.sim", "--duration_s=inf"], "duration_s must be a finite number > 0, got inf"),
    (["mnemojax.sim", "--output_json=/nonexistent/dir/x.json"], "output_json: '/nonexistent/dir' is not a writable"),
    (["mnemojax.plan", "--output_dir=/proc/plan"], "output_dir: cannot create '/proc/plan'"),
    (["mnemojax.plan", "--model=nosuch"], "model 'nosuch' is neither a preset"),
])
def test_a_bad_command_line_is_a_usage_error_naming_the_flag(argv, message):
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=serve_env(1), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_a_usage_error_logs_its_traceback_at_debug_level():
    # An error that is a bug rather than a bad setting still has a trace to follow: `-v 1` prints it.
    proc = subprocess.run([sys.executable, "-m", "mnemojax.sim", "--num_pages=1", "-v", "1"], cwd=ROOT,
                          env=serve_env(1), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" in proc.stderr and "kv_manager.py" in proc.stderr, proc.stderr[-2000:]
