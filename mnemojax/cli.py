"""Command-line flags derived from config dataclasses: one definition of each name.

Each field of a frozen config dataclass becomes an absl flag of the same name, its default the field's default
and its help the field's docstring (the string literal written under it). Flags are defined when a command runs
(`define_flags` in its `run()`), never at import, so any set of commands can be imported into one process.

    @dataclasses.dataclass(frozen=True)
    class ServeConfig:
        port: int = 8000
        \"\"\"Port to listen on.\"\"\"

    define_flags(ServeConfig)          # --port, with its help text
    config = from_flags(ServeConfig)   # after absl parsed the command line

A field typed `Literal[...]` (or with `choices` in its metadata) becomes an enum flag. Nested config dataclasses
are flattened: their fields become flags too, and must not share a name with another field.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import os
import sys
import textwrap
import types
import typing

from absl import app, flags, logging

VLLM_NAMES = {"tensor_parallel_size": "tp", "pipeline_parallel_size": "spp", "block_size": "page_size",
              "scheduling_policy": "scheduler_policy"}
"""vLLM's engine-argument names of settings that mean the same here: `--tensor-parallel-size 2`,
`--pipeline-parallel-size 2`, `--block-size 16` (tokens per KV page), `--scheduling-policy priority` (vLLM's two
values, fcfs and priority, are two of ours), and `LLM(tensor_parallel_size=2)`
(`mnemojax.engine.llm_engine.with_our_names`). A vLLM pipeline stage holds a slice of the layers, as an spp stage
does; mnemojax's stages also pipeline the chunks of one request."""


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """{field name: the docstring written under it} of a dataclass (and of its bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _base_type(tp):
    """(the type without None, whether None is allowed)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True
    return tp, False


def _leaves(cls) -> list[tuple[tuple[str, ...], dataclasses.Field, object]]:
    """(path of names, field, resolved type) for every non-dataclass field, nested configs flattened."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp, _ = _base_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            out += [((f.name, *path), g, t) for path, g, t in _leaves(tp)]
        else:
            out.append(((f.name,), f, hints[f.name]))
    return out


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def define_flags(cls, flag_values: flags.FlagValues = flags.FLAGS, *, skip: tuple[str, ...] = (),
                 defaults: dict | None = None) -> list[str]:
    """Defines one flag per field of `cls` (nested configs flattened); returns the flag names. `defaults`
    overrides field defaults for this command (the simulator's defaults are H100-sized, say)."""
    defaults = defaults or {}
    names = []
    owners = {}
    for path, f, tp in _leaves(cls):
        name = path[-1]
        if name in skip:
            continue
        if name in owners:
            raise ValueError(f"config field {name!r} appears in both {owners[name]} and {'.'.join(path)}")
        owners[name] = ".".join(path)
        owner = cls
        for part in path[:-1]:
            owner = _base_type(typing.get_type_hints(owner)[part])[0]
        help_text = field_docs(owner).get(name) or name.replace("_", " ")
        default = defaults.get(name, _default(f))
        base, optional = _base_type(tp)
        choices = f.metadata.get("choices")
        if choices is None and typing.get_origin(base) is typing.Literal:
            choices = list(typing.get_args(base))
        if choices is not None:
            flags.DEFINE_enum(name, default, [str(c) for c in choices], help_text, flag_values=flag_values)
        elif base is bool:
            flags.DEFINE_bool(name, default, help_text, flag_values=flag_values)
        elif base in (int, float) and optional:  # "none" gives None back (a command's default may not be None)
            parser = _OrNone(flags.IntegerParser() if base is int else flags.FloatParser())
            flags.DEFINE(parser, name, default, help_text, flag_values=flag_values)
        elif base is int:
            flags.DEFINE_integer(name, default, help_text, flag_values=flag_values)
        elif base is float:
            flags.DEFINE_float(name, default, help_text, flag_values=flag_values)
        elif base is str:
            flags.DEFINE_string(name, default, help_text, flag_values=flag_values)
        else:
            raise TypeError(f"no flag type for config field {'.'.join(path)}: {tp}")
        names.append(name)
    return names


class _OrNone(flags.ArgumentParser):
    """A number flag of an optional field: its parser's values, or None for "none"."""

    def __init__(self, inner: flags.ArgumentParser):
        self.inner = inner
        self.syntactic_help = f'{inner.syntactic_help} or "none"'

    def parse(self, argument):
        if argument is None or (isinstance(argument, str) and argument.strip().lower() == "none"):
            return None
        return self.inner.parse(argument)

    def flag_type(self) -> str:
        return self.inner.flag_type()


def from_flags(cls, flag_values: flags.FlagValues = flags.FLAGS, **overrides):
    """An instance of `cls` from the parsed flags (nested configs built the same way); `overrides` win."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp, _ = _base_type(hints[f.name])
        if f.name in overrides:
            kwargs[f.name] = overrides[f.name]
        elif dataclasses.is_dataclass(tp):
            kwargs[f.name] = from_flags(tp, flag_values, **overrides)
        elif f.name in flag_values:
            kwargs[f.name] = flag_values[f.name].value
    return cls(**kwargs)


def dashed_names(argv: list[str], flag_values: flags.FlagValues = flags.FLAGS) -> list[str]:
    """The command line with vLLM's spellings of this command's flags made absl's: `--max-model-len 4096` is
    `--max_model_len 4096`, a boolean's `--no-enable-prefix-caching` is `--noenable_prefix_caching`, and vLLM's
    names of our settings (`VLLM_NAMES`: `--tensor-parallel-size`, `--pipeline-parallel-size`, `--block-size`,
    `--scheduling-policy`) are ours. Only a name that is one of the command's flags once its dashes are
    underscores changes; a flag's value (the word after a flag that takes one), anything after `--`, and a name
    that is no flag (absl's error names it) stay as given."""
    out, value_next = list(argv[:1]), False
    for i, arg in enumerate(argv[1:], 1):
        if value_next or not arg.startswith("--") or arg == "--":
            if arg == "--" and not value_next:
                return out + argv[i:]
            out.append(arg)
            value_next = False
            continue
        name, eq, value = arg[2:].partition("=")
        under = name.replace("-", "_")
        if under not in flag_values and VLLM_NAMES.get(under) in flag_values:
            under = VLLM_NAMES[under]
        if under.startswith("no_") and under[3:] in flag_values and flag_values[under[3:]].boolean:
            under = "no" + under[3:]
        if under in flag_values or (under.startswith("no") and under[2:] in flag_values):
            name = under
        out.append(f"--{name}{eq}{value}")
        value_next = not eq and name in flag_values and not flag_values[name].boolean
    return out


def run_command(main) -> None:
    """`absl.app.run(main)` on the command line with vLLM's dashed flag names taken (`dashed_names`)."""
    app.run(main, argv=dashed_names(sys.argv))


def no_arguments(argv: list[str]) -> None:
    """A command takes flags only: anything else on its command line (`serve MODEL`, say) is a usage error, not
    silently ignored."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]} (every setting is a flag: see --help)")


@contextlib.contextmanager
def usage_errors():
    """Turns a bad setting found while a command starts (a ValueError naming the field, or a file that cannot be
    read) into absl's usage error: the message and the exit code 1, not a traceback. The traceback is logged at
    debug level (`-v 1` shows it), for an error that is a bug rather than a setting."""
    try:
        yield
    except (ValueError, OSError) as e:
        logging.debug("the usage error's traceback", exc_info=True)
        raise app.UsageError(str(e)) from None


def output_path(field: str, path: str | None, *, directory: bool = False) -> None:
    """Checks, before a long run, that its output can be written: `path` (a file, or with `directory` a directory,
    created here if missing) must lie in a writable directory. Raises ValueError naming the flag."""
    if not path:
        return
    where = path if directory else os.path.dirname(os.path.abspath(path))
    if directory:
        try:
            os.makedirs(where, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{field}: cannot create {path!r} ({e.strerror})") from None
    if not os.path.isdir(where) or not os.access(where, os.W_OK):
        raise ValueError(f"{field}: {where!r} is not a writable directory")
