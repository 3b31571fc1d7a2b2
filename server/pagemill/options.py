"""Command-line options generated from their one declaration: a dataclass
field declared with `option(...)` (ShardConfig), or a row of the router's
option table (RouterConfig in router/src/config.rs, through `_router.options()`).
Nothing here names an option; cli.py and launcher.py use these helpers to
offer options, build configs and forward options to child processes."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, Callable

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """'2GiB', '512M', '1000000' -> bytes."""
    s = text.strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if not num or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GiB, 512MiB)")
    try:
        return int(float(num) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GiB, 512MiB)") from None


# ---- dataclass fields as options ---------------------------------------------------------------

_MISSING = dataclasses.MISSING


def option(default: Any = _MISSING, *, help: str, choices: tuple | None = None,
           parse: Callable[[str], Any] | None = None, flag: str | None = None, env: str | None = None,
           per_process: bool = False) -> Any:  # fmt: skip
    """A dataclass field that is also a command-line option `--flag` (default: the field name in
    kebab case). parse: str -> value (default: from the annotation). env: environment variable
    that supplies the default where `env_defaults` is asked for (`pagemill shard` under a
    torchrun-style launcher). per_process: set per process by `pagemill launch` itself, so
    offered by `pagemill shard` only."""
    meta = {"help": help, "choices": choices, "parse": parse, "flag": flag, "env": env, "per_process": per_process}
    return dataclasses.field(default=default, metadata=meta)


def _options(cls: type) -> list[tuple[dataclasses.Field, type]]:
    """(field, value type) of each option field of `cls`; Optional[X] gives X."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        t = hints[f.name]
        if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
            t = next(a for a in typing.get_args(t) if a is not type(None))
        out.append((f, t))
    return out


def _flag(f: dataclasses.Field) -> str:
    return "--" + (f.metadata["flag"] or f.name.replace("_", "-"))


def add_dataclass_options(p: argparse.ArgumentParser, cls: type, *, per_process: bool, env_defaults: bool) -> None:
    """Adds an argument per option field of `cls` (dest: the field name). per_process: include
    the per-process fields too. env_defaults: defaults come from `env` where it is set."""
    for f, t in _options(cls):
        m = f.metadata
        if m["per_process"] and not per_process:
            continue
        default = None if f.default is _MISSING else f.default
        if env_defaults and m["env"] and m["env"] in os.environ:
            default = (m["parse"] or t)(os.environ[m["env"]])
        kw: dict[str, Any] = dict(dest=f.name, default=default, help=_with_default(m["help"], default))
        if f.default is _MISSING and default is None:
            kw["required"] = True
        if t is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw.update(type=m["parse"] or t, choices=m["choices"])
            if not m["choices"]:
                kw["metavar"] = _flag(f)[2:].upper().replace("-", "_")
        p.add_argument(_flag(f), **kw)


def _with_default(help: str, default: Any) -> str:
    text = help if default is None else f"{help} (default: {default})"
    return text.replace("%", "%%")  # argparse %-formats help


def dataclass_from_namespace(cls: type, a: argparse.Namespace, **explicit: Any) -> Any:
    """`cls` from the option fields found in `a` (the others keep their defaults) and `explicit`."""
    values = {f.name: getattr(a, f.name) for f, _ in _options(cls) if hasattr(a, f.name)}
    return cls(**{**values, **explicit})


def dataclass_argv(obj: Any) -> list[str]:
    """`obj`'s option fields as flags that add_dataclass_options parses back into the same values
    (None: omitted, so the receiver's default, which is None too, applies)."""
    argv: list[str] = []
    for f, t in _options(type(obj)):
        value = getattr(obj, f.name)
        if t is bool:
            argv.append(_flag(f) if value else "--no-" + _flag(f)[2:])
        elif value is not None:
            argv += flag_value(_flag(f), value)
    return argv


def flag_value(flag: str, value: Any) -> list[str]:
    """`--flag value` as argv, which is how people and `ps` greps read it; `--flag=value` where
    the value starts with '-' and would otherwise read as an option."""
    text = str(value)
    return [f"{flag}={text}"] if text.startswith("-") else [flag, text]


# ---- router options (declared in Rust) ---------------------------------------------------------

ROUTER_OPTIONS = "router_options"  # namespace attribute: [(table row, value or None)], as given


class _RouterOption(argparse.Action):
    """Records the option as given; the router (clap) parses and checks the value, so that
    Python holds no type, default or rule of a router option."""

    def __init__(self, option_strings, dest, row: dict, **kw):
        super().__init__(option_strings, dest=argparse.SUPPRESS, **kw)
        self.row = row

    def __call__(self, parser, namespace, values, option_string=None):
        given = list(getattr(namespace, ROUTER_OPTIONS, []))
        given.append((self.row, None if self.nargs == 0 else values))
        setattr(namespace, ROUTER_OPTIONS, given)


def add_router_options(p: argparse.ArgumentParser, table: list[dict], *, launcher_sets: bool) -> None:
    """Adds the router options of `table` (`_router.options()`). launcher_sets: include those that
    `pagemill launch` sets itself (sockets, model directory)."""
    p.set_defaults(**{ROUTER_OPTIONS: []})
    group = p.add_argument_group("router options (parsed by the router)")
    for row in table:
        if row["launcher_sets"] and not launcher_sets:
            continue
        help = row["help"]
        if row["env"]:
            help += f" (default: ${row['env']} if set)"
        elif row["default"] not in (None, ""):
            help += f" (default: {row['default']})"
        kw: dict[str, Any] = dict(row=row, help=help.replace("%", "%%"))
        if row["kind"] == "flag":
            kw["nargs"] = 0
        elif row["kind"] == "many":
            kw.update(nargs="+", metavar=row["value_name"])
        else:
            kw.update(metavar=row["value_name"], choices=row["choices"] or None)
        group.add_argument("--" + row["flag"], action=_RouterOption, **kw)


def router_argv(given: list[tuple[dict, str | None]]) -> list[str]:
    """The given router options as flags for the router."""
    argv: list[str] = []
    for row, value in given:
        if value is None:
            argv.append(f"--{row['flag']}")
        elif isinstance(value, list):  # kind "many": one flag before each value, as the router reads it too
            for v in value:
                argv += flag_value(f"--{row['flag']}", v)
        else:
            argv += flag_value(f"--{row['flag']}", value)
    return argv


def router_env(given: list[tuple[dict, str | None]]) -> tuple[list[str], dict[str, str]]:
    """Splits the given router options into flags and environment variables: an option the
    router also reads from the environment goes there, not into argv, where any local user
    could read it with `ps` (the API key)."""
    argv = router_argv([(r, v) for r, v in given if not r["env"]])
    env = {r["env"]: v for r, v in given if r["env"] and v is not None}
    return argv, env
