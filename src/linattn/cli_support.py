"""What every command-line entry point shares: an argparse parser that raises `UsageError` instead
of printing a usage block and exiting, the one-line error report, and command-line flags generated
from config dataclasses (`add_dataclass_arguments`). A leaf module (it imports
only linattn.errors): `cli.py`, `bench/`, `experiments/`, `demo` and `training/` import from here,
never from `cli.py`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import typing
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from .errors import UsageError

PROG = "linattn"


class ArgParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing the usage block and exiting."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):  # argparse API
        raise UsageError(message, prog=self.prog)


def report_error(message: str, prog: Optional[str] = None) -> int:
    """Print `prog: error: message` on one line of stderr; return the exit code 2."""
    first = str(message).strip().splitlines()[0] if str(message).strip() else "error"
    print(f"{prog or PROG}: error: {first}", file=sys.stderr)
    return 2


# ----------------------------------------------------------------------------------------------
# Flags generated from dataclasses
# ----------------------------------------------------------------------------------------------
#
# `add_dataclass_arguments(parser, SomeConfig)` adds one `--field-name` flag per field, parsed by
# the field's type annotation and documented by `field(metadata={"help": ..., "choices": ...})`
# ("shown_default" replaces the default printed in the help):
#
#     int, float              --steps 100, --lr 3e-4
#     bool                    --tie-embeddings true|false (also yes/no, on/off, 1/0)
#     Optional[X]             X, or the word none (also null)
#     str with "choices"      --ffn moe (checked against the choices)
#     List[X]                 comma list: --mixer gated-deltanet,softmax
#     Union[str, List[str]]   one name stays a string, a comma list becomes a list
#     Union[int, str]         an int, else a string (checked against "choices": --history-window auto)
#     Dict[...]               JSON: --mixer-kwargs '{"efla": {"beta": "adaptive"}}'
#
# A flag that is not given is absent from the namespace (default=SUPPRESS): `given_values(args,
# names)` returns only what the user set, so "not given" and "given as none" stay different.

NONE_WORDS = ("none", "null")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def flag_name(field_name: str) -> str:
    """`max_seq_len` -> `--max-seq-len`."""
    return "--" + field_name.replace("_", "-")


def parse_bool(text: str) -> bool:
    v = text.strip().lower()
    if v in TRUE_WORDS:
        return True
    if v in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _named(fn: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    fn.__name__ = name  # argparse names the type in its "invalid <name> value" messages
    return fn


def int_at_least(low: int, note: str = "") -> Callable[[str], int]:
    """An argparse `type` for ints >= `low`: `--threads -1` is reported as `argument --threads: expected
    an int >= 1, got '-1'` (exit code 2). `note` is added to the message (e.g. "0 = off")."""
    def convert(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}{f' ({note})' if note else ''}, "
                                             f"got {text!r}")
        return value
    return _named(convert, "int")


def finite_float(low: Optional[float] = None, high: Optional[float] = None, *, low_open: bool = False,
                 high_open: bool = False) -> Callable[[str], float]:
    """An argparse `type` for finite floats in a range (nan and inf are refused): `finite_float(0, 1,
    low_open=True)` accepts (0, 1]."""
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {high:g}")
    expected = "a finite number" + (" " + " and ".join(parts) if parts else "")

    def convert(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            value = math.nan
        ok = math.isfinite(value)
        if ok and low is not None:
            ok = value > low if low_open else value >= low
        if ok and high is not None:
            ok = value < high if high_open else value <= high
        if not ok:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return _named(convert, "float")


def _scalar(tp: type) -> Callable[[str], Any]:
    def convert(text: str):
        try:
            return tp(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an' if tp is int else 'a'} {tp.__name__}, "
                                             f"got {text!r}") from None
    return _named(convert, tp.__name__)


def _string(choices: Optional[Iterable[str]]) -> Callable[[str], Any]:
    allowed = tuple(c for c in choices if c is not None) if choices else None

    def convert(text: str):
        if allowed is not None and text not in allowed:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(allowed)}, got {text!r}")
        return text
    return _named(convert, "str")


def _json_dict(text: str):
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _comma_list(item: Callable[[str], Any], single_as_item: bool) -> Callable[[str], Any]:
    def convert(text: str):
        parts = [item(t.strip()) for t in text.split(",") if t.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return parts[0] if single_as_item and len(parts) == 1 else parts
    return _named(convert, "list")


def _first_that_parses(converters: List[Callable[[str], Any]]) -> Callable[[str], Any]:
    def convert(text: str):
        errors = []
        for c in converters:
            try:
                return c(text)
            except argparse.ArgumentTypeError as e:
                errors.append(str(e))
        raise argparse.ArgumentTypeError("; ".join(errors))
    return _named(convert, "value")


def _optional(inner: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str):
        return None if text.strip().lower() in NONE_WORDS else inner(text)
    return _named(convert, getattr(inner, "__name__", "value"))


def type_converter(tp: Any, choices: Optional[Iterable[str]] = None) -> Tuple[Callable[[str], Any], str]:
    """(converter, metavar) for a field annotation; converters raise argparse.ArgumentTypeError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        members = [a for a in args if a is not type(None)]
        conv, metavar = _union_converter(members, choices)
        if len(members) < len(args):
            return _optional(conv), metavar + "|none"
        return conv, metavar
    if tp is bool:
        return _named(parse_bool, "bool"), "true|false"
    if tp in (int, float):
        return _scalar(tp), tp.__name__.upper()
    if tp is str:
        return _string(choices), ("{" + ",".join(c for c in choices if c is not None) + "}") if choices else "STR"
    if origin in (list, tuple) or tp in (list, tuple):
        item = args[0] if args else str
        conv, metavar = type_converter(item, choices)
        return _comma_list(conv, single_as_item=False), f"{metavar},..."
    if origin is dict or tp is dict:
        return _named(_json_dict, "JSON object"), "JSON"
    return _string(choices), "VALUE"


def _union_converter(members: List[Any], choices) -> Tuple[Callable[[str], Any], str]:
    if len(members) == 1:
        return type_converter(members[0], choices)
    lists = [m for m in members if typing.get_origin(m) in (list, tuple)]
    if str in members and lists:  # a name or a comma list of names
        item_conv, metavar = type_converter(typing.get_args(lists[0])[0] if typing.get_args(lists[0]) else str,
                                            choices)
        return _comma_list(item_conv, single_as_item=True), f"{metavar}[,...]"
    order = {bool: 0, int: 1, float: 2, str: 9}
    ranked = sorted(members, key=lambda m: order.get(m, 5))
    parts = [type_converter(m, choices) for m in ranked]
    return _first_that_parses([c for c, _ in parts]), "|".join(m for _, m in parts)


def _shown_default(f: dataclasses.Field) -> Optional[str]:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return None
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def field_help(f: dataclasses.Field) -> str:
    """The field's `metadata["help"]` plus its default (or `metadata["shown_default"]`), escaped for
    argparse."""
    text = str(f.metadata.get("help", "")).strip()
    shown = f.metadata.get("shown_default", _shown_default(f))
    if shown is not None:
        text = f"{text} (default: {shown})" if text else f"default: {shown}"
    return text.replace("%", "%%")


def add_dataclass_arguments(parser, cls: type, *, skip: Iterable[str] = ()) -> List[str]:
    """Add a `--field-name` flag for every field of the dataclass `cls` not in `skip` to `parser`
    (an ArgumentParser or an argument group). The value lands in `args.<field name>` only when the
    flag is given. Returns the names of the fields that got a flag."""
    hints = typing.get_type_hints(cls)
    skip = set(skip)
    added = []
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        choices = f.metadata.get("choices")
        conv, metavar = type_converter(hints.get(f.name, str), choices)
        parser.add_argument(flag_name(f.name), dest=f.name, type=conv, metavar=metavar,
                            default=argparse.SUPPRESS, help=field_help(f))
        added.append(f.name)
    return added


def given_values(args: argparse.Namespace, names: Iterable[str]) -> Dict[str, Any]:
    """{name: value} of the flags among `names` that were given on the command line."""
    ns = vars(args)
    return {n: ns[n] for n in names if n in ns}


def command_line(prog: str, description: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                 main: Callable[[argparse.Namespace], int], argv: Optional[Iterable[str]] = None) -> int:
    """A `python -m linattn.<package> ...` entry point: parse `argv` with the options `add_arguments` sets up,
    run `main`, and report a `UsageError` as one line on stderr (exit code 2); returns the exit code."""
    parser = ArgParser(prog=prog, description=description)
    add_arguments(parser)
    try:
        return main(parser.parse_args(list(argv or [])))
    except UsageError as e:
        return report_error(" ".join(str(e).split()), e.prog or prog)


__all__ = ["PROG", "ArgParser", "UsageError", "report_error", "flag_name", "parse_bool", "int_at_least",
           "finite_float", "type_converter", "field_help", "add_dataclass_arguments", "given_values", "command_line"]
