"""Structured outputs' JSON schema (vLLM's `structured_outputs.json`, the server's `guided_json` and
`response_format: {"type": "json_schema"}`) as a pattern for `mnemojax.scheduling.regex`.

`schema_pattern(schema)` writes a regex whose every whole match is a JSON text that the schema accepts; the engine
then guides tokens by it as by `structured_outputs.regex`. A schema needs unbounded nesting only through a
recursive `$ref`, which is refused: everything else is a regular language. The regex may leave valid JSON out, never
let invalid JSON in:
- an object's properties come in the order of `properties`, each once; those in `required` always, the others
  optionally (as xgrammar and outlines generate); a `required` name missing from `properties` is refused. Other
  properties come only from an `additionalProperties` schema (after the listed ones, any number, each named none
  of the listed names, as any string or as `propertyNames` says) or from `patternProperties` (one pattern and no
  `properties`: names the pattern matches); `additionalProperties` absent or true generates none (xgrammar's
  strict mode). A name may be written twice among the other properties (JSON parsers keep the last value, which
  is valid too), so `minProperties` above 1 is refused there;
- numbers and strings are written one way: integers without a fraction or exponent, no `-0`; a string's characters
  are themselves or JSON's short escapes (`\\n`, `\\"`, ...), never `\\u` escapes, so the controls without a short
  escape (U+0000-U+001F but tab, newline, ...) cannot appear;
- a string with a `pattern` is made of printable ASCII without escapes, where Python's `re`, ECMA-262 and
  `mnemojax.scheduling.regex` read the pattern alike (JSON Schema's `pattern` matches anywhere unless anchored); a
  pattern that ECMA-262 reads otherwise (`\\a`, `{,n}`, `]` first in a class, `(?P<`) is refused;
- numbers with bounds have no exponent; the bounds are compared as exact decimals, a float bound as its shortest
  repr (0.1 is 0.1; an integral one past 2**53 the tighter of its repr and its value). So that a validator that
  reads a fraction as a float (an integer as an exact int: jsonschema, pydantic) agrees, a bounded number of 10**15
  or more has no fraction, a fraction that must not be 0 starts with at most 306 zeros, and bounds below the
  smallest normal float are refused. Such a validator can still disagree with an exclusive bound on a number of
  more than 16 significant digits (`0.10000000000000000001` reads as 0.1).

Whitespace: between tokens the default is any run of JSON whitespace `[ \\n\\t]*` (xgrammar's default);
`disable_any_whitespace` writes `, ` and `: ` and nothing else (xgrammar's); `whitespace_pattern` (outlines') puts
that pattern, which may only match JSON whitespace, in place of the default.

Supported keywords: `type` (a name or a list), `enum`, `const`, `anyOf`, `oneOf` (when its branches are disjoint: of
different types, different `const` / `enum` values, or objects that require one property with different `const` /
`enum` values), `allOf` with one schema, `$ref` within the document (`#`, `#/$defs/...`, `#/definitions/...`, with
JSON Pointer's and a URI's escapes; not recursive, and not through an `$id` below the root, which would change what
the references inside mean), `properties`, `required`, `additionalProperties`, `propertyNames` and
`patternProperties` (as above), `minProperties` / `maxProperties` (for objects of other properties only, or where
every object of the listed ones meets them), `items`, `prefixItems` (no items past them unless `items` gives their
schema), `minItems`, `maxItems`, `uniqueItems` (for items of a `const` / `enum`: each value at most once, in the
enum's order), `minLength`, `maxLength`, `pattern`, `format` (`date`, `time`, `date-time`, `duration`, `uuid`,
`ipv4`, `ipv6`, `hostname`, `email`, `uri`: each a subset of its RFC's texts, see `_FORMATS`; `minLength` /
`maxLength` beside one only where all its texts meet them), `minimum`, `maximum`, `exclusiveMinimum`,
`exclusiveMaximum`, and the annotations (`title`, `description`, `default`, `examples`, ...). Any other keyword is a
`SchemaError` naming its path: refused, never ignored. A schema without `type` takes it from its keywords
(`properties` makes an object); one with none (any JSON value) is refused. So is a schema whose regex would pass
MAX_PATTERN_CHARS (checked as it is written: `$ref`s used twice a level double it each level).
"""
from __future__ import annotations

import itertools
import json
import math
import re
import sys
import urllib.parse
from decimal import Decimal

from mnemojax.scheduling.regex import MAX_REPEAT, RegexError, _Parser

ANY_WHITESPACE = r"[ \n\t]*"
"""The whitespace allowed between tokens by default (xgrammar's)."""
MAX_PATTERN_CHARS = 500_000
"""The longest regex a schema may be written as (far past what MAX_NFA_STATES lets compile)."""
JSON_OBJECT_DEPTH = 4
"""How deep `json_object`'s objects and arrays nest at most (any nesting is not a regular language; the regex of a
depth grows about 4x a level: 4 is ~20,000 NFA states, 5 would pass MAX_NFA_STATES)."""

_JSON_WHITESPACE = ((0x09, 0x0A), (0x0D, 0x0D), (0x20, 0x20))
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                "readOnly", "writeOnly", "$defs", "definitions"}
_TYPED = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "object": {"properties", "required", "additionalProperties", "propertyNames", "patternProperties",
               "minProperties", "maxProperties"},
    "array": {"items", "prefixItems", "minItems", "maxItems"},
    "boolean": set(), "null": set(),
}
_KNOWN = set().union(*_TYPED.values()) | _ANNOTATIONS | {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
                                                        "uniqueItems"}
_WHOLE_SCHEMA = ("$ref", "enum", "const", "anyOf", "oneOf", "allOf")
"""The keywords that give a schema's values by themselves (`type` may stand beside `enum` / `const`)."""
_INFERRED = ("object", "array", "string", "number")  # the type a schema without `type` takes from its keywords

_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])'
"""One character of a JSON string as written: any but `"`, `\\` and the controls, or a short escape (no `\\u`: every
character counts once towards `minLength` / `maxLength`, and the pattern stays small)."""
_SHORT_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "\b": "b", "\f": "f", "\n": "n", "\r": "r", "\t": "t"}
"""The characters a JSON string may write as a short escape (`_CHAR`'s), each with its letter."""
_SAFE = ((0x20, 0x21), (0x23, 0x5B), (0x5D, 0x7E))
"""The characters of a string with a `pattern`: printable ASCII but `"` and `\\`."""
_DIGITS = "[0-9]"
_INTEGER = "-?(?:0|[1-9][0-9]*)"
_NUMBER = _INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_SCALAR = f'(?:"{_CHAR}*"|{_NUMBER}|true|false|null)'
_MAX_BOUND = 10 ** 1000
_WHOLE = 10 ** 15
"""A bounded number this large or larger is written without a fraction: past 2**53 not every integer is a float, and
a validator that reads a fraction as a float (an integer as an exact int) could round it past a bound."""
_LEADING_ZEROS = 306
"""The most zeros a fraction that must not be 0 starts with (0.000...1 with more would read as a float as 0, or as a
subnormal, which rounds past the bound: pydantic's PositiveFloat is `exclusiveMinimum: 0`)."""
_ANY_FRACTION = r"(?:\.[0-9]+)?"
_YEAR = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
_TIME = r"(?:(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9]))"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_IPV4 = rf"{_OCTET}(?:\.{_OCTET}){{3}}"
_HEX4 = "[0-9a-fA-F]{1,4}"


def _ipv6() -> str:
    """RFC 4291's text forms: eight groups, or fewer around one `::` (which stands for one or more zero groups),
    the last two groups possibly an IPv4 address (no zone index)."""
    out = [f"(?:{_HEX4}:){{7}}{_HEX4}", f"(?:{_HEX4}:){{6}}{_IPV4}"]
    for groups, tail in ((8, _HEX4), (7, _IPV4)):  # `tail` the last group (an IPv4 address counts as two)
        for left in range(groups):  # groups before the `::`; right: those after it, the tail among them
            head = "" if left == 0 else f"(?:{_HEX4}:){{{left - 1}}}{_HEX4}"
            right = groups - 1 - left  # at most: `::` stands for one group or more
            if right == 0:
                if tail == _HEX4:
                    out.append(f"{head}::")
                continue
            out.append(f"{head}::(?:(?:{_HEX4}:){{0,{right - 1}}}{tail})" + ("?" if tail == _HEX4 else ""))
    return "(?:" + "|".join(dict.fromkeys(out)) + ")"


_IPV6 = _ipv6()
_LABEL = "[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,60}[a-zA-Z0-9])?"  # (up to 62 characters)
_TOP_LABEL = "[a-zA-Z](?:[a-zA-Z0-9-]{0,60}[a-zA-Z0-9])?"
_HOSTNAME = rf"(?:{_LABEL}\.){{0,3}}{_TOP_LABEL}"
"""Up to 4 labels of up to 62 characters (so at most 251, under RFC 1123's 253), the last starting with a letter."""
_ATEXT = "[a-zA-Z0-9!#$%&'*+/=?^_`{|}~-]"
_EMAIL = rf"{_ATEXT}{{1,32}}(?:\.{_ATEXT}{{1,31}})?@(?:{_LABEL}\.){{1,3}}{_TOP_LABEL}"
"""RFC 5321's dot-atom (up to two atoms, 64 characters) at a host name of two labels or more."""
_PORT = "(?:[1-5]?[0-9]{1,4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"  # (0 to 65535)
_PCHAR = "(?:[a-zA-Z0-9._~!$&'()*+,;=:@-]|%[0-9a-fA-F]{2})"
_URI = (rf"[a-zA-Z][a-zA-Z0-9+.-]*://(?:{_HOSTNAME}|{_IPV4}|\[{_IPV6}\])(?::{_PORT})?"
        rf"(?:/{_PCHAR}*)*(?:\?(?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?")
"""RFC 3986's URIs with an authority (`scheme://host[:port]`, no user info, a port up to 65535 as URL parsers
want), then a path, a query, a fragment."""
_DIGITS6 = "[0-9]{1,6}"  # (a number of up to 6 digits: 999999 years still fit Python's timedelta)
_DURATION_TIME = rf"T(?:{_DIGITS6}H(?:{_DIGITS6}M(?:{_DIGITS6}S)?)?|{_DIGITS6}M(?:{_DIGITS6}S)?|{_DIGITS6}S)"
_DURATION = (rf"P(?:(?:{_DIGITS6}D|{_DIGITS6}M(?:{_DIGITS6}D)?|{_DIGITS6}Y(?:{_DIGITS6}M(?:{_DIGITS6}D)?)?)"
             rf"(?:{_DURATION_TIME})?|{_DURATION_TIME}|{_DIGITS6}W)")
"""RFC 3339's duration (Appendix A), numbers of up to 6 digits."""
_FORMATS = {"date": _DATE, "time": _TIME, "date-time": f"{_DATE}T{_TIME}", "duration": _DURATION,
            "ipv4": _IPV4, "ipv6": _IPV6, "hostname": _HOSTNAME, "email": _EMAIL, "uri": _URI,
            "uuid": "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"}
_FORMAT_LENGTHS = {"date": (10, 10), "time": (9, None), "date-time": (20, None), "duration": (3, 44), "ipv4": (7, 15),
                   "ipv6": (2, 45), "hostname": (1, 251), "email": (5, 316), "uri": (5, None), "uuid": (36, 36)}
"""The fewest and most characters of each format's texts as written here (None: no most)."""


class SchemaError(ValueError):
    """A schema this module cannot take: the message names the path of the keyword (`/properties/age/minimum`)."""


def literal(text: str) -> str:
    """`text` as a regex matching exactly it."""
    return "".join(c if c.isalnum() or not c.isascii() else "\\" + c for c in text)


def _group(alternatives: list[str]) -> str:
    return alternatives[0] if len(alternatives) == 1 else "(?:" + "|".join(alternatives) + ")"


def _same_length(a: str, b: str) -> list[str]:
    """The alternatives matching the decimal strings from a to b, both of the same length, a <= b."""
    if a == b:
        return [a]
    i = next(k for k in range(len(a)) if a[k] != b[k])
    prefix, a, b, n = a[:i], a[i:], b[i:], len(a) - i - 1
    tail = f"{_DIGITS}{{{n}}}" if n else ""
    low_full, high_full = a[1:] == "0" * n, b[1:] == "9" * n
    out = [] if low_full else [prefix + a[0] + x for x in _same_length(a[1:], "9" * n)]
    first, last = int(a[0]) + (not low_full), int(b[0]) - (not high_full)
    if first <= last:
        out.append(prefix + (str(first) if first == last else f"[{first}-{last}]") + tail)
    if not high_full:
        out += [prefix + b[0] + x for x in _same_length("0" * n, b[1:])]
    return out


def natural_range(lo: int, hi: int | None) -> str:
    """A regex matching the decimal numbers (no leading zeros) from lo to hi (None: no end), 0 <= lo <= hi."""
    top = len(str(lo)) if hi is None else len(str(hi))
    out = []
    for d in range(len(str(lo)), top + 1):
        a = lo if d == len(str(lo)) else 10 ** (d - 1)
        b = hi if hi is not None and d == top else 10 ** d - 1
        out += _same_length(str(a), str(b))
    if hi is None:
        out.append(f"[1-9]{_DIGITS}{{{top},}}")
    return _group(out)


def integer_range(lo: int | None, hi: int | None) -> str:
    """A regex matching the integers from lo to hi (None: no end) as JSON writes them (no `-0`), lo <= hi."""
    out = []
    if lo is None or lo < 0:  # negative ones: '-' then the magnitude
        out.append("-" + natural_range(1 if hi is None or hi >= 0 else -hi, None if lo is None else -lo))
    if hi is None or hi >= 0:
        out.append(natural_range(max(lo or 0, 0), hi))
    return _group(out)


def _digits(a: str | None, a_in: bool, b: str | None, b_in: bool) -> tuple[list[str], bool] | None:
    """The digit strings t (maybe empty) whose value 0.t is from 0.a to 0.b (a None: from 0 included; b None: below
    1; `*_in`: whether each end is included): (the regexes of the non-empty ones, whether the empty one is in).
    None when there are none."""
    a = None if a is None or (a.rstrip("0") == "" and a_in) else a.rstrip("0")
    b = None if b is None else b.rstrip("0")
    if a is not None and b is not None:
        width = max(len(a), len(b))
        if a.ljust(width, "0") > b.ljust(width, "0") or (a == b and not (a_in and b_in)):
            return None
    if not a and not b:  # each end is None or 0 (a == "": 0 left out)
        if b is None:
            return ([f"{_DIGITS}+"], True) if a is None else ([f"0{{0,{_LEADING_ZEROS}}}[1-9]{_DIGITS}*"], False)
        return (["0+"], True) if a is None and b_in else None
    first, last = int(a[0]) if a else 0, int(b[0]) if b is not None else 9
    tails = []
    for d in range(first, last + 1):
        rest = _digits(a[1:] if a is not None and d == first else None, a_in if d == first else True,
                       b[1:] if b is not None and d == last else None, b_in if d == last else True)
        if rest is not None:
            tails.append((d, _optional(*rest)))
    runs = [list(g) for _, g in itertools.groupby(tails, key=lambda x: x[1])]
    alts = [(str(r[0][0]) if len(r) == 1 else f"[{r[0][0]}-{r[-1][0]}]") + r[0][1] for r in runs]
    return (alts, a is None) if alts or a is None else None


def _optional(alts: list[str], empty: bool) -> str:
    """A regex matching any of `alts`, or nothing too when `empty`."""
    if not alts:
        return ""
    body = _group(alts)
    return f"(?:{body})?" if empty else body


def _fraction(a: str | None, a_in: bool, b: str | None, b_in: bool) -> str | None:
    """A regex for a number's fraction (nothing, or '.' and digits) whose value is from 0.a to 0.b (as
    `_digits`); None when there is none."""
    out = _digits(a, a_in, b, b_in)
    if out is None:
        return None
    alts, empty = out
    return _optional([r"\." + _group(alts)], empty) if alts else ""


def _bound(v: int | float, lower: bool) -> Decimal:
    """A bound as an exact decimal. A float is the decimal it is written as (its shortest repr: 0.1 is 0.1), which
    a float validator reads alike; an integral float past 2**53, whose repr (1e+23) and value (99999999999999991611392)
    differ as integers compare, is the tighter of the two (a validator compares an integer with the float's value)."""
    if not isinstance(v, float):
        return Decimal(v)
    written = Decimal(float.__repr__(v))  # (float.__repr__: a float subclass's repr may be another text)
    return (max if lower else min)(written, Decimal(v)) if v.is_integer() else written


def _parts(v: Decimal) -> tuple[int, str]:
    """A non-negative decimal's integer part and its fraction's digits (no trailing zeros)."""
    whole, _, frac = format(v, "f").partition(".")
    return int(whole), frac.rstrip("0")


def _magnitude(lo: Decimal, lo_in: bool, hi: Decimal | None, hi_in: bool) -> str | None:
    """A regex for the non-negative decimals n[.f] (no exponent) from lo to hi (None: no end), those from _WHOLE on
    integers; `lo_in`, `hi_in`: whether each end is included. None when there are none."""
    if hi is not None and (hi < lo or (hi == lo and not (lo_in and hi_in))):
        return None
    out = []
    if lo < _WHOLE:
        top, top_in = (hi, hi_in) if hi is not None and hi < _WHOLE else (Decimal(_WHOLE), False)
        (li, lf), (hi_int, hf) = _parts(lo), _parts(top)
        if hi_int == li:  # one integer part
            ends = [(li, _fraction(lf, lo_in, hf, top_in))]
        else:
            ends = [(li, _fraction(lf, lo_in, None, True)), (hi_int, _fraction(None, True, hf, top_in))]
            if hi_int - li >= 2:  # integer parts strictly between: any fraction
                out.append(natural_range(li + 1, hi_int - 1) + _ANY_FRACTION)
        out += [str(whole) + f for whole, f in ends if f is not None]
    if hi is None or hi >= _WHOLE:  # integers
        first = max(math.ceil(lo) if lo_in else math.floor(lo) + 1, _WHOLE)
        last = None if hi is None else math.floor(hi) if hi_in else math.ceil(hi) - 1
        if last is None or first <= last:
            out.append(natural_range(first, last))
    return _group(out) if out else None


def number_range(lo, lo_in: bool, hi, hi_in: bool) -> str | None:
    """A regex for JSON numbers without exponent between the bounds lo and hi (ints or Decimals, exact; None: none;
    `*_in`: included), no `-0` (0 is written without a sign). None when there are none."""
    lo, hi = (None if v is None else Decimal(v) for v in (lo, hi))
    out = []
    if lo is None or lo < 0:  # negative: '-' then a magnitude u > 0 with -hi <= u <= -lo
        low, low_in = (Decimal(0), False) if hi is None or hi >= 0 else (-hi, hi_in)
        m = _magnitude(low, low_in, None if lo is None else -lo, lo_in)
        if m is not None:
            out.append("-" + m)
    if hi is None or hi >= 0:
        m = _magnitude(*((Decimal(0), True) if lo is None or lo < 0 else (lo, lo_in)), hi, hi_in)
        if m is not None:
            out.append(m)
    return _group(out) if out else None


def _class(ranges) -> str:
    if not ranges:
        return "[^\\x00-" + chr(0x10FFFF) + "]"  # matches nothing
    return "[" + "".join(_code(a) if a == b else f"{_code(a)}-{_code(b)}" for a, b in ranges) + "]"


def _code(c: int) -> str:
    return f"\\u{c:04x}" if c <= 0xFFFF else chr(c)  # (a character past the BMP is never special)


def _char_except(chars: set[str]) -> str:
    """`_CHAR` but the characters `chars` (as read: both of `/`'s ways, `/` and `\\/`, are left out)."""
    taken, lo = [], 0x20
    for c in sorted({ord(c) for c in chars} | {0x22, 0x5C}):
        if c >= lo:
            if c > lo:
                taken.append((lo, c - 1))
            lo = c + 1
    if lo <= 0x10FFFF:
        taken.append((lo, 0x10FFFF))
    letters = [letter for c, letter in _SHORT_ESCAPES.items() if c not in chars]
    return "(?:" + _class(taken) + ("|\\\\" + _class([(ord(x), ord(x)) for x in letters]) if letters else "") + ")"


def _ways(c: str) -> list[str]:
    """The regexes `_CHAR` writes the character `c` with (none for a control without a short escape)."""
    out = [] if c in '"\\' or ord(c) < 0x20 else [literal(c)]
    return out + ([literal("\\" + _SHORT_ESCAPES[c])] if c in _SHORT_ESCAPES else [])


def _string_except(names) -> str:
    """A JSON string, quotes included and its characters as `_CHAR` writes them, whose value is none of `names`."""
    trie: dict = {}
    for name in names:
        node = trie
        for c in name:
            node = node.setdefault(c, {})
        node[None] = {}  # a name ends here

    def rest(node: dict) -> str:
        chars = {c for c in node if c is not None}
        alts = [_group(_ways(c)) + rest(node[c]) for c in sorted(chars) if _ways(c)]
        alts.append(_char_except(chars) + _CHAR + "*")  # a character no name has here: any string on
        return "(?:" + "|".join(alts) + (")" if None in node else ")?")  # ending here is another name

    return '"' + rest(trie) + '"'


def _intersect(ranges, allowed) -> tuple:
    out = []
    for a, b in ranges:
        for c, d in allowed:
            if max(a, c) <= min(b, d):
                out.append((max(a, c), min(b, d)))
    return tuple(out)


def _unparse(node, allowed) -> str:
    """A regex parsed by `regex._Parser` written back, its character sets cut down to `allowed`."""
    kind = node[0]
    if kind == "set":
        return _class(_intersect(node[1], allowed))
    if kind == "cat":
        return "".join(_unparse(n, allowed) for n in node[1])
    if kind == "alt":
        return "(?:" + "|".join(_unparse(n, allowed) for n in node[1]) + ")"
    _, inner, lo, hi = node
    return f"(?:{_unparse(inner, allowed)}){{{lo},{'' if hi is None else hi}}}"


def _scan(pattern: str) -> tuple[str | None, bool]:
    """(What in `pattern` ECMA-262 reads otherwise than Python's `re`, among what `regex._Parser` takes, or None;
    whether it has a `|` outside groups). ECMA reads `\\a` as the letter a, `{,n}` as literal text, `[]` as an empty
    class, and has no `(?P<...>`."""
    depth, i, in_class, bar = 0, 0, False, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            if pattern[i + 1:i + 2] == "a":
                return "'\\a'", bar
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            if pattern[i + 1:i + 2] == "]" or pattern[i + 1:i + 3] == "^]":
                return "']' first in a class", bar
            in_class = True
        elif c == "{" and re.match(r"\{,[0-9]+\}", pattern[i:]):
            return "'{,n}'", bar
        elif pattern.startswith("(?P", i):
            return "'(?P'", bar
        elif c in "()":
            depth += 1 if c == "(" else -1
        elif c == "|" and depth == 0:
            bar = True
        i += 1
    return None, bar


def whitespace_regex(pattern: str) -> str:
    """`whitespace_pattern` checked: a regex (mnemojax's subset) whose characters are all JSON whitespace."""
    if not isinstance(pattern, str):
        raise SchemaError(f"whitespace_pattern must be a string, got {pattern!r}")
    try:
        node = _Parser(pattern).parse()
    except (RegexError, RecursionError) as e:
        raise SchemaError(f"whitespace_pattern: {e or 'nested too deeply'}") from None
    todo = [node]
    while todo:
        n = todo.pop()
        if n[0] == "set":
            if _intersect(n[1], _JSON_WHITESPACE) != n[1]:
                raise SchemaError(f"whitespace_pattern {pattern!r} matches characters that are not JSON whitespace "
                                  f"(space, tab, newline, carriage return)")
        elif n[0] == "rep":
            todo.append(n[1])
        else:
            todo.extend(n[1])
    return f"(?:{_unparse(node, _JSON_WHITESPACE)})"


def _finite(v) -> bool:
    return isinstance(v, int) or math.isfinite(v)  # (math.isfinite overflows on an int past a float's range)


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _canonical(value) -> str:
    """`value` as JSON with its keys sorted and integral floats written as integers: equal JSON values (by JSON
    Schema's equality, where 1.0 == 1 and true != 1) give equal strings."""
    def norm(v):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v
    try:
        return json.dumps(norm(value), sort_keys=True)
    except (TypeError, ValueError):
        return repr(value)


class _Writer:
    def __init__(self, root, ws: str, item_sep: str, key_sep: str):
        self.root, self.ws, self.item_sep, self.key_sep = root, ws, item_sep, key_sep
        self.expanding: list[str] = []  # the $refs being written (one met again is recursion)

    def fail(self, path: str, what: str) -> SchemaError:
        return SchemaError(f"at {path or '/'}: {what}")

    def resolve(self, ref, path: str):
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise self.fail(path, f"$ref {ref!r}: only references within the schema ('#/...') are supported")
        if ref in self.expanding:
            raise self.fail(path, f"$ref {ref!r} is recursive (unbounded nesting is not a regular language)")
        node = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")  # (a URI fragment's escapes)
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and re.fullmatch("0|[1-9][0-9]*", part) and int(part) < len(node):
                node = node[int(part)]
            else:
                raise self.fail(path, f"$ref {ref!r} points at nothing")
            if isinstance(node, dict) and "$id" in node:
                raise self.fail(path, f"$ref {ref!r} goes through an $id, which would change what references "
                                      f"inside mean (only the root's $id is supported)")
        return node

    def types(self, schema: dict, path: str) -> list[str]:
        t = schema.get("type")
        if t is None:
            inferred = [name for name in _INFERRED if _TYPED[name] & set(schema)]
            if not inferred:
                raise self.fail(path, "a schema without a type (any JSON value) is not supported")
            return inferred[:1]
        names = t if isinstance(t, list) else [t]
        if not names or not all(isinstance(n, str) and n in _TYPED for n in names) or len(set(names)) != len(names):
            raise self.fail(path + "/type", f"type must be one of {sorted(_TYPED)} or a list of them, got {t!r}")
        return names

    def kinds(self, schema, path: str) -> set[str]:
        """The JSON types a schema's values can have (integer counted as number), for oneOf's disjointness."""
        if not isinstance(schema, dict):
            return set(_TYPED)
        if "$ref" in schema:
            ref = schema["$ref"]
            if ref in self.expanding:
                return set(_TYPED)
            target = self.resolve(ref, path)
            self.expanding.append(ref)
            try:
                return self.kinds(target, path)
            finally:
                self.expanding.pop()
        if "enum" in schema or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            return {_json_type(v).replace("integer", "number") for v in values} if isinstance(values, list) \
                else set(_TYPED)
        for key in ("anyOf", "oneOf", "allOf"):
            if key in schema and isinstance(schema[key], list):
                return set().union(*(self.kinds(s, path) for s in schema[key]))
        t = schema.get("type")  # (without one, a schema takes every type: what value() infers is what it generates)
        names = (t if isinstance(t, list) else [t]) if t is not None else list(_TYPED)
        return {str(n).replace("integer", "number") for n in names}

    def deref(self, schema):
        """`schema` with its `$ref`s followed (None where they loop or point at nothing: value() says why)."""
        seen = set()
        while isinstance(schema, dict) and "$ref" in schema:
            if schema["$ref"] in seen:
                return None
            seen.add(schema["$ref"])
            try:
                schema = self.resolve(schema["$ref"], "")
            except SchemaError:
                return None
        return schema

    def literals(self, schema) -> set[str] | None:
        """The values a `const` / `enum` schema allows, each as canonical JSON (1.0 is 1, as JSON Schema compares
        numbers by value); None for any other schema."""
        schema = self.deref(schema)
        if isinstance(schema, dict) and ("const" in schema or isinstance(schema.get("enum"), list)):
            return {_canonical(v) for v in (schema["enum"] if "enum" in schema else [schema["const"]])}
        return None

    def tags(self, schema) -> dict[str, set[str]]:
        """An object schema's required properties whose values are `const` / `enum` literals: name -> values."""
        schema = self.deref(schema)
        if not isinstance(schema, dict) or not isinstance(schema.get("properties"), dict) \
                or not isinstance(schema.get("required"), list):
            return {}
        out = {}
        for name in schema["required"]:
            values = self.literals(schema["properties"].get(name)) if isinstance(name, str) else None
            if values is not None:
                out[name] = values
        return out

    def disjoint(self, a, b, path: str) -> bool:
        """Whether no value can match both schemas (as far as this can tell: False when unsure)."""
        la, lb = self.literals(a), self.literals(b)
        if la is not None and lb is not None:
            return not (la & lb)
        shared = self.kinds(a, path) & self.kinds(b, path)
        if not shared:
            return True
        if shared != {"object"}:
            return False
        ta, tb = self.tags(a), self.tags(b)
        return any(not (ta[name] & tb[name]) for name in ta.keys() & tb.keys())

    def value(self, schema, path: str) -> str:
        return self.sized(self.written(schema, path), path)

    def sized(self, pattern: str, path: str) -> str:
        """`pattern`, or a SchemaError if it is past MAX_PATTERN_CHARS (checked as it is built: a schema whose $refs
        are used twice a level doubles each level, and would take minutes and gigabytes before the NFA's cap)."""
        if len(pattern) > MAX_PATTERN_CHARS:
            raise self.fail(path, f"the schema's regex is too large (more than {MAX_PATTERN_CHARS} characters)")
        return pattern

    def written(self, schema, path: str) -> str:
        if schema is True or schema == {}:
            raise self.fail(path, "a schema that takes any JSON value is not supported")
        if not isinstance(schema, dict):
            raise self.fail(path, f"a schema must be an object, got {schema!r}")
        if "$id" in schema and schema is not self.root:
            raise self.fail(f"{path}/$id", "$id below the root is not supported (it changes what references inside "
                                           "mean)")
        unknown = sorted(set(schema) - _KNOWN)
        if unknown:
            raise self.fail(f"{path}/{unknown[0]}", f"the keyword {unknown[0]!r} is not supported")
        unique = schema.get("uniqueItems", False)
        if not isinstance(unique, bool):
            raise self.fail(f"{path}/uniqueItems", f"uniqueItems must be a boolean, got {unique!r}")
        if unique and (set(_WHOLE_SCHEMA) & set(schema)
                       or "array" not in self.types(schema, path)):
            raise self.fail(f"{path}/uniqueItems", "uniqueItems is supported only beside an array's items")
        for key in _WHOLE_SCHEMA:
            if key not in schema:
                continue
            others = sorted(set(schema) - _ANNOTATIONS - {key, "uniqueItems"} - ({"type"} if key in ("enum", "const")
                                                                                  else set()))
            if others:
                raise self.fail(f"{path}/{others[0]}", f"{others[0]!r} beside {key!r} is not supported")
            return getattr(self, {"$ref": "ref", "enum": "enum", "const": "enum", "anyOf": "any_of",
                                  "oneOf": "any_of", "allOf": "all_of"}[key])(schema, key, f"{path}/{key}")
        return _group([getattr(self, t.replace("integer", "number"))(schema, f"{path}", t)
                       for t in self.types(schema, path)])

    def ref(self, schema, key, path):
        ref = schema["$ref"]
        target = self.resolve(ref, path)
        self.expanding.append(ref)
        try:
            return self.value(target, ref[1:])  # errors inside name the path of the definition
        finally:
            self.expanding.pop()

    def enum(self, schema, key, path):
        return _group(list(self.enum_values(schema, key, path).values()))

    def enum_values(self, schema, key, path) -> dict[str, str]:
        """The values of a `const` / `enum` schema of its type, in order, without repeats: canonical JSON (1.0 is 1)
        -> the regex of the value as written."""
        values = schema["enum"] if key == "enum" else [schema["const"]]
        if not isinstance(values, list) or not values:
            raise self.fail(path, f"enum must be a non-empty list, got {values!r}")
        types = self.types(schema, path.removesuffix("/" + key)) if "type" in schema else list(_TYPED)
        out = {}
        for v in values:
            t = _json_type(v)
            if t in types or (t == "integer" and "number" in types):
                try:
                    text = json.dumps(v, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
                except ValueError:
                    raise self.fail(path, f"{v!r} is not a JSON value") from None
                out.setdefault(_canonical(v), literal(text))
        if not out:
            raise self.fail(path, f"no value of {key} has the schema's type {schema.get('type')!r}")
        return out

    def any_of(self, schema, key, path):
        branches = schema[key]
        if not isinstance(branches, list) or not branches:
            raise self.fail(path, f"{key} must be a non-empty list of schemas")
        if key == "oneOf":
            for i in range(len(branches)):
                for j in range(i):
                    if not self.disjoint(branches[j], branches[i], path):
                        raise self.fail(f"{path}/{i}", f"oneOf's branches {j} and {i} may both match a value "
                                                       f"(only disjoint ones are supported: anyOf takes any)")
        return _group([self.value(s, f"{path}/{i}") for i, s in enumerate(branches)])

    def all_of(self, schema, key, path):
        if not isinstance(schema[key], list) or len(schema[key]) != 1:
            raise self.fail(path, "allOf is supported with one schema only")
        return self.value(schema[key][0], f"{path}/0")

    def count(self, schema, name: str, path: str, default: int | None, capped: bool = True) -> int | None:
        """A count keyword's value; `capped`: refused above MAX_REPEAT (the counts a regex repeats)."""
        v = schema.get(name, default)
        if name in schema and v is None:
            raise self.fail(f"{path}/{name}", f"{name} must be a non-negative integer, got None")
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v)
                              or v != int(v) or v < 0):
            raise self.fail(f"{path}/{name}", f"{name} must be a non-negative integer, got {v!r}")
        if capped and v is not None and v > MAX_REPEAT:
            raise self.fail(f"{path}/{name}", f"{name} above {MAX_REPEAT} is not supported")
        return None if v is None else int(v)

    def string(self, schema, path, t):
        fmt, pattern = schema.get("format"), schema.get("pattern")
        capped = fmt is None  # (beside a format, the lengths are compared, not repeated)
        lo, hi = self.count(schema, "minLength", path, 0, capped), self.count(schema, "maxLength", path, None, capped)
        if hi is not None and hi < lo:
            raise self.fail(f"{path}/maxLength", f"maxLength {hi} is below minLength {lo}")
        if fmt is not None and pattern is not None:
            raise self.fail(f"{path}/pattern", "pattern beside format is not supported")
        if fmt is not None:
            if not isinstance(fmt, str) or fmt not in _FORMATS:
                raise self.fail(f"{path}/format", f"format {fmt!r} is not supported (only {sorted(_FORMATS)})")
            shortest, longest = _FORMAT_LENGTHS[fmt]
            if lo > shortest or (hi is not None and (longest is None or hi < longest)):
                raise self.fail(f"{path}/format", f"minLength or maxLength beside format is supported only where every "
                                                  f"{fmt} written here meets it (from {shortest} to "
                                                  f"{longest or 'any number of'} characters)")
            return f'"{_FORMATS[fmt]}"'
        if pattern is not None:
            if "minLength" in schema or "maxLength" in schema:
                raise self.fail(f"{path}/pattern", "minLength or maxLength beside pattern is not supported")
            return f'"{self.pattern(pattern, f"{path}/pattern")}"'
        return f'"{_CHAR}{{{lo},{"" if hi is None else hi}}}"'

    def pattern(self, pattern, path) -> str:
        if not isinstance(pattern, str):
            raise self.fail(path, f"pattern must be a string, got {pattern!r}")
        try:
            node = _Parser(pattern).parse()
            re.compile(pattern)
        except (RegexError, re.error) as e:
            raise self.fail(path, str(e)) from None
        differs, bar = _scan(pattern)
        if differs:
            raise self.fail(path, f"pattern {pattern!r}: {differs}, which ECMA-262 (JSON Schema's regex) reads "
                                  f"differently from Python's re")
        start = pattern.startswith("^")
        escapes = len(pattern[:-1]) - len(pattern[:-1].rstrip("\\"))  # backslashes before the last character
        end = pattern.endswith("$") and escapes % 2 == 0
        if (start or end) and bar:
            raise self.fail(path, "an anchored pattern with a '|' outside groups is not supported (group it)")
        anywhere = _class(_SAFE) + "*"
        return ("" if start else anywhere) + _unparse(node, _SAFE) + ("" if end else anywhere)

    def number(self, schema, path, t):
        bounds, exact = {}, {}
        for name in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if name not in schema:
                continue
            v = schema[name]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v):
                raise self.fail(f"{path}/{name}", f"{name} must be a finite number, got {v!r}")
            if isinstance(v, int) and abs(v) > _MAX_BOUND:
                raise self.fail(f"{path}/{name}", f"a {name} of more than 1000 digits is not supported")
            if isinstance(v, float) and v != 0 and abs(v) < sys.float_info.min:
                raise self.fail(f"{path}/{name}", f"{name} {v!r} is below the smallest normal float (a validator "
                                                  f"reading numbers as floats rounds there)")
            bounds[name], exact[name] = v, _bound(v, lower=name.endswith("inimum"))
        if t == "integer":
            los = [math.ceil(exact["minimum"])] if "minimum" in bounds else []
            los += [math.floor(exact["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in bounds else []
            his = [math.floor(exact["maximum"])] if "maximum" in bounds else []
            his += [math.ceil(exact["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in bounds else []
            lo, hi = max(los, default=None), min(his, default=None)
            if lo is not None and hi is not None and lo > hi:
                raise self.fail(path, f"no integer is within the bounds {bounds}")
            return integer_range(lo, hi) if bounds else _INTEGER
        if not bounds:
            return _NUMBER
        lo = hi = None
        lo_in = hi_in = True
        for name, v in exact.items():
            inclusive = not name.startswith("exclusive")
            if name.endswith("inimum") and (lo is None or v > lo or (v == lo and not inclusive)):
                lo, lo_in = v, inclusive
            if name.endswith("aximum") and (hi is None or v < hi or (v == hi and not inclusive)):
                hi, hi_in = v, inclusive
        out = number_range(lo, lo_in, hi, hi_in)
        if out is None:
            raise self.fail(path, f"no number is within the bounds {bounds}")
        return out

    def boolean(self, schema, path, t):
        return "(?:true|false)"

    def null(self, schema, path, t):
        return "null"

    def object(self, schema, path, t):
        props = schema.get("properties", {})
        required = schema.get("required", [])
        if not isinstance(props, dict):
            raise self.fail(f"{path}/properties", "properties must be an object")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise self.fail(f"{path}/required", "required must be a list of names")
        missing = [r for r in required if r not in props]
        if missing:
            raise self.fail(f"{path}/required", f"required property {missing[0]!r} is not in properties (other "
                                                f"properties are never generated)")
        items = [(self.key(name) + self.key_sep + self.value(s, f"{path}/properties/{name}"), name in required)
                 for name, s in props.items()]
        pair = self.other_pair(schema, props, path)  # one more property, or None when none is generated
        lo, hi = self.count(schema, "minProperties", path, 0), self.count(schema, "maxProperties", path, None)
        if hi is not None and hi < lo:
            raise self.fail(f"{path}/maxProperties", f"maxProperties {hi} is below minProperties {lo}")
        if not props:
            return r"\{" + self.ws + self.pairs(pair, lo, hi, path) + self.ws + r"\}"
        if lo > len(set(required)) or (hi is not None and (pair is not None or hi < len(props))):
            name = "minProperties" if lo > len(set(required)) else "maxProperties"
            raise self.fail(f"{path}/{name}", f"{name} beside properties is supported only when every object of "
                                              f"the properties meets it")

        ends = ("", "") if pair is None else (f"(?:{self.item_sep}{pair})*", self.pairs(pair, 0, None, path))
        return r"\{" + self.ws + self.run(items, *ends, path) + self.ws + r"\}"

    def run(self, items: list[tuple[str, bool]], after_last: str, first_last: str | None, path: str) -> str:
        """Items (an object's properties, a set's values) in order, each (its regex, whether it is required), a
        separator between each two written; what may follow them, `after_last` when one was written before and
        `first_last` when none was (None: one must be). From the last item back: after, the items from the i-th on
        when one was written before them (each needs a separator); first, when none was (the first one written has
        none)."""
        after, first = after_last, first_last
        for kv, required in reversed(items):
            sep_kv = self.item_sep + kv
            after, first = (
                self.sized(sep_kv + after if required else f"(?:{sep_kv})?" + after, path),
                self.sized(kv + after if required or first is None else f"(?:{kv}{after}|{first})", path))
        return first

    def other_pair(self, schema, props: dict, path: str) -> str | None:
        """A property past `properties` (`"key": value`), or None when none is generated. From an
        `additionalProperties` schema: its name is none of `properties`' (a name written twice is read as the last
        value) and meets `propertyNames`. From `patternProperties` (one pattern, no `properties`): a name its
        pattern matches (printable ASCII, as a string's `pattern`), its schema's value. `additionalProperties`
        false, absent or true generates none (as xgrammar's strict mode)."""
        extra, names = schema.get("additionalProperties"), schema.get("propertyNames", True)
        patterns = schema.get("patternProperties", {})
        if extra is not None and not isinstance(extra, (bool, dict)):
            raise self.fail(f"{path}/additionalProperties", f"additionalProperties must be a schema, got {extra!r}")
        if not isinstance(patterns, dict):
            raise self.fail(f"{path}/patternProperties", "patternProperties must be an object")
        if names is not True and names != {} and (props or patterns):
            raise self.fail(f"{path}/propertyNames", "propertyNames beside properties or patternProperties is not "
                                                     "supported")
        if patterns:
            if props or len(patterns) > 1 or (isinstance(extra, dict) and extra):
                raise self.fail(f"{path}/patternProperties", "patternProperties is supported with one pattern, no "
                                                              "properties and no additionalProperties schema")
            (pattern, value), = patterns.items()
            key = '"' + self.pattern(pattern, f"{path}/patternProperties") + '"'
            return key + self.key_sep + self.value(value, f"{path}/patternProperties/{pattern}")
        if not isinstance(extra, dict) or not extra or names is False:
            return None
        if names is True or names == {}:
            key = _string_except(props)
        else:
            if not isinstance(names, dict):
                raise self.fail(f"{path}/propertyNames", f"propertyNames must be a schema, got {names!r}")
            if "type" not in names and not set(_WHOLE_SCHEMA) & set(names):
                names = {**names, "type": "string"}  # (a name is a string: what it says of others does not apply)
            if self.kinds(names, f"{path}/propertyNames") != {"string"}:
                raise self.fail(f"{path}/propertyNames", "propertyNames must take strings only")
            key = self.value(names, f"{path}/propertyNames")
        return key + self.key_sep + self.value(extra, f"{path}/additionalProperties")

    def pairs(self, pair: str | None, lo: int, hi: int | None, path: str) -> str:
        """From lo to hi (None: no end) other properties, an object's only ones (a separator between each two)."""
        if pair is None or hi == 0:
            if lo:
                raise self.fail(f"{path}/minProperties", f"minProperties {lo}, but no property is generated (there "
                                                         f"are no properties and no additionalProperties schema)")
            return ""
        if lo > 1:
            raise self.fail(f"{path}/minProperties", "minProperties above 1 is not supported for other properties "
                                                     "than the listed ones: a name may be written twice")
        more = "*" if hi is None else f"{{0,{hi - 1}}}"
        out = self.sized(f"{pair}(?:{self.item_sep}{pair}){more}", path)
        return out if lo else f"(?:{out})?"

    def any_value(self, depth: int) -> str:
        """Any JSON value whose objects and arrays nest at most `depth` deep."""
        if depth == 0:
            return _SCALAR
        inner = self.any_value(depth - 1)
        return f"(?:{_SCALAR}|{self.any_object(inner)}|{self.any_array(inner)})"

    def any_object(self, inner: str) -> str:
        kv = f'"{_CHAR}*"{self.key_sep}{inner}'
        return r"\{" + self.ws + f"(?:{kv}(?:{self.item_sep}{kv})*)?" + self.ws + r"\}"

    def any_array(self, inner: str) -> str:
        return r"\[" + self.ws + f"(?:{inner}(?:{self.item_sep}{inner})*)?" + self.ws + r"\]"

    def key(self, name: str) -> str:
        return literal(json.dumps(name, ensure_ascii=False))

    def array(self, schema, path, t):
        lo, hi = self.count(schema, "minItems", path, 0), self.count(schema, "maxItems", path, None)
        if hi is not None and hi < lo:
            raise self.fail(f"{path}/maxItems", f"maxItems {hi} is below minItems {lo}")
        prefix, items = schema.get("prefixItems", []), schema.get("items")
        if not isinstance(prefix, list):
            raise self.fail(f"{path}/prefixItems", "prefixItems must be a list of schemas")
        if isinstance(items, list):
            raise self.fail(f"{path}/items", "items as a list (draft 7's tuples) is not supported: use prefixItems")
        if hi == 0:
            return r"\[" + self.ws + r"\]"
        if schema.get("uniqueItems", False):
            return self.unique_items(items, prefix, lo, hi, path)
        positions = [self.value(s, f"{path}/prefixItems/{i}") for i, s in enumerate(prefix)]
        rest = None  # the items past the prefix: None when none are generated
        if items is False:
            if lo > len(prefix):
                raise self.fail(f"{path}/minItems", f"minItems {lo} is above the {len(prefix)} prefixItems and "
                                                    f"items is false: no array is valid")
        elif items is None or items is True or items == {}:
            if lo > len(prefix) or not prefix:
                raise self.fail(path, "an array whose items may be any JSON values is not supported")
        else:
            rest = self.value(items, f"{path}/items")

        def tail(i: int) -> str:
            """The items from the i-th on, after the ones before (each with its separator)."""
            if hi is not None and i >= hi:
                return ""
            if i >= len(positions):
                if rest is None:
                    return ""
                return f"(?:{self.item_sep}{rest}){{{max(lo - i, 0)},{'' if hi is None else hi - i}}}"
            piece = self.item_sep + positions[i] + tail(i + 1)
            return piece if i < lo else f"(?:{piece})?"

        head = (positions[0] if positions else rest) + tail(1)
        return r"\[" + self.ws + (head if lo else f"(?:{head})?") + self.ws + r"\]"

    def unique_items(self, items, prefix, lo: int, hi: int | None, path: str) -> str:
        """`uniqueItems`' array, for items of a `const` / `enum` (pydantic's `set[Literal[...]]`, `set[SomeEnum]`):
        each value at most once, in the enum's order (the others are valid and never generated)."""
        if items is not None:
            self.value(items, f"{path}/items")  # (the items' schema checked as any other: it may not be taken)
        target = self.deref(items)
        if prefix or not isinstance(target, dict) or not ({"enum", "const"} & set(target)):
            raise self.fail(f"{path}/uniqueItems", "uniqueItems is supported only for items of a const / enum (a "
                                                   "finite set of values), without prefixItems")
        key = "enum" if "enum" in target else "const"
        values = list(self.enum_values(target, key, f"{path}/items").values())
        if lo > 1 or (hi is not None and hi < len(values)):
            name = "minItems" if lo > 1 else "maxItems"
            raise self.fail(f"{path}/{name}", f"{name} beside uniqueItems is supported only when every subset of "
                                              f"the {len(values)} values meets it")
        body = self.run([(v, False) for v in values], "", "" if lo == 0 else None, path)
        return r"\[" + self.ws + body + self.ws + r"\]"


def _writer(schema, disable_any_whitespace: bool, whitespace_pattern: str | None) -> _Writer:
    if whitespace_pattern is not None:
        if disable_any_whitespace:
            raise SchemaError("whitespace_pattern and disable_any_whitespace contradict each other")
        ws = whitespace_regex(whitespace_pattern)
    elif disable_any_whitespace:
        return _Writer(schema, "", ", ", ": ")
    else:
        ws = ANY_WHITESPACE
    return _Writer(schema, ws, f"{ws},{ws}", f"{ws}:{ws}")


def schema_pattern(schema, *, disable_any_whitespace: bool = False, whitespace_pattern: str | None = None) -> str:
    """A regex (`mnemojax.scheduling.regex`'s subset) whose whole matches are JSON texts valid under `schema` (a
    dict, or its JSON text); whitespace as the module says. Raises SchemaError naming the path of what it cannot
    take."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:  # (a JSONDecodeError, or an integer of more digits than Python converts)
            raise SchemaError(f"not a JSON schema: {e}") from None
    if not isinstance(schema, dict):
        raise SchemaError(f"a JSON schema must be an object, got {schema!r}")
    writer = _writer(schema, disable_any_whitespace, whitespace_pattern)
    try:
        return writer.ws + writer.value(schema, "")
    except RecursionError:
        raise SchemaError("the schema is nested too deeply") from None


def object_pattern(*, disable_any_whitespace: bool = False, whitespace_pattern: str | None = None) -> str:
    """vLLM's `json_object`: a regex whose whole matches are the JSON objects nested at most JSON_OBJECT_DEPTH deep
    (the object itself counts: `{"a": [{}]}` is 3 deep), whitespace as the module says."""
    writer = _writer(None, disable_any_whitespace, whitespace_pattern)
    return writer.ws + writer.any_object(writer.any_value(JSON_OBJECT_DEPTH - 1))
