"""Structured outputs' JSON schema written as a regex: every string the regex takes is JSON that an independent
validator (`jsonschema`, pydantic, `datetime`) accepts under the schema; valid instances written the way the regex
writes them are taken; the integer and number bounds against exact arithmetic; what cannot be honoured is refused
with its path."""
import collections
import datetime
import functools
import ipaddress
import itertools
import json
import random
import re
import string
import uuid
from decimal import Decimal
from fractions import Fraction

import fqdn
import jsonschema
import numpy as np
import pydantic  # (fastapi's dependency)
import pytest

from mnemojax.scheduling.json_schema import (_FORMAT_LENGTHS, _FORMATS, JSON_OBJECT_DEPTH, SchemaError, integer_range,
                                              number_range, object_pattern, schema_pattern)
from mnemojax.scheduling.regex import Regex
from mnemojax.scheduling.sampling_params import ParamError, SamplingParams, StructuredOutputsParams

ALPHABET = "".join(map(chr, range(0x20, 0x7F))) + "\n\t\r\x01\x7f" + "é€😀\u00a0"
"""The characters the random walks try: printable ASCII, JSON's whitespace, controls and some past ASCII."""

NAMED = {"$defs": {"Color": {"enum": ["red", "green", "blue"], "type": "string", "title": "Color"},
                   "Point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                             "required": ["x", "y"]}}}
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                      "ok": {"type": "boolean"}}, "required": ["name", "age"]},
    {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 3}, "maxItems": 3},
    {"type": ["string", "null"], "maxLength": 4},
    {"type": "number", "minimum": -3, "exclusiveMaximum": 2},
    {"type": "number", "exclusiveMinimum": 0},
    {"type": "integer", "exclusiveMinimum": -5.5, "maximum": 1e3},
    {"anyOf": [{"type": "integer", "minimum": 10}, {"type": "integer", "maximum": 0}, {"const": "x"}]},
    {"oneOf": [{"type": "string", "maxLength": 2}, {"type": "integer"}, {"type": "null"}]},
    {"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "v": {"type": "integer"}},
                "required": ["kind", "v"]},
               {"type": "object", "properties": {"kind": {"enum": ["b", "c"]}, "w": {"type": "boolean"}},
                "required": ["kind"]}]},
    {**NAMED, "type": "object", "properties": {"c": {"$ref": "#/$defs/Color"},
                                               "p": {"allOf": [{"$ref": "#/$defs/Point"}]},
                                               "ps": {"type": "array", "items": {"$ref": "#/$defs/Point"},
                                                      "maxItems": 2}}, "required": ["c"]},
    {"type": "object", "properties": {"a": {"type": "null"}, "b": {"type": "boolean"}, "c": {"enum": [1, 2.5]}}},
    {"type": "object", "properties": {}, "additionalProperties": False},
    {"enum": ["a\"b", "c\\d", "é", None, True, [1, {"k": "v"}], {"x": []}]},
    {"type": "string", "pattern": "^[a-c]+-[0-9]{2}$"},
    {"type": "string", "pattern": "x[yz]"},
    {"type": "string", "pattern": r"^\w\S\.\D$"},
    {"type": "string", "format": "uuid"},
    {"type": "string", "format": "date"},
    {"properties": {"n": {"type": "integer", "maximum": -7}}, "required": ["n"]},
    {"oneOf": [{"const": "a"}, {"enum": ["b", 2, 2.5]}]},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 2}], "items": False},
    {"type": "array", "prefixItems": [{"type": "boolean"}], "items": {"type": "null"}, "minItems": 2, "maxItems": 4},
    {"type": "number", "minimum": -0.5, "exclusiveMaximum": 1.25},
    {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}, "maxProperties": 3},
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": 2}, "x/y": {"type": "boolean"}},
     "required": ["x/y"], "additionalProperties": {"type": "null"}},
    {"type": "object", "propertyNames": {"pattern": "^[a-c]+$"}, "additionalProperties": {"type": "boolean"},
     "minProperties": 1},
    {"type": "object", "patternProperties": {"^[a-z]{2}$": {"type": "number", "exclusiveMinimum": 0.05}}},
    {"type": "array", "items": {"enum": ["x", 1, 1.0, {"k": [1]}, None, True]}, "uniqueItems": True},
    {**NAMED, "type": "array", "items": {"$ref": "#/$defs/Color"}, "uniqueItems": True, "minItems": 1},
]
ALPHABETS = {15: 'xyz a!"', 25: 'axy/\\"{},:nultrfse ', 27: 'abzq"{},:.0159 '}
"""Smaller alphabets where a walk over ALPHABET would rarely reach a match."""
DISTINCT = {12: 1}
"""How many different values the walks find at least, where it is not 3 (the empty object has one)."""
STYLES = [{}, {"disable_any_whitespace": True}, {"whitespace_pattern": r"[ ]?"}, {"whitespace_pattern": r"\n?"}]


def _walks(rx: Regex, seed: int, count: int, limit: int = 120, alphabet: str = ALPHABET) -> list[str]:
    """Up to `count` whole matches of `rx` found by random walks over `alphabet` (each step a character that keeps a
    match possible; a walk may stop where the text matches)."""
    rng, out = random.Random(seed), []
    for _ in range(count * 4):
        state, text = rx.start, ""
        while len(text) < limit:
            if rx.accepts(state) and rng.random() < 0.25:
                out.append(text)
                break
            nexts = [(c, s) for c in alphabet if (s := rx.step(state, c))]
            if not nexts:
                assert rx.accepts(state), text  # a live state either continues or matches
                out.append(text)
                break
            c, state = rng.choice(nexts)
            text += c
        if len(out) == count:
            break
    return out


def _validator(schema):
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_every_string_the_regex_takes_is_json_the_schema_accepts(i):
    """Random whole matches (in every whitespace style): `json.loads` parses them and jsonschema validates them; the
    walks find several different values."""
    schema = SCHEMAS[i]
    validator = _validator(schema)
    for k, style in enumerate(STYLES):
        rx = Regex(schema_pattern(schema, **style))
        texts = _walks(rx, seed=100 * i + k, count=40, alphabet=ALPHABETS.get(i, ALPHABET))
        values = set()
        for text in texts:
            value = json.loads(text)
            validator.validate(value)
            values.add(json.dumps(value, sort_keys=True))
            if style.get("disable_any_whitespace"):  # outside strings, only the spaces of ", " and ": "
                bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
                assert not re.search(r"[\n\t\r]|(?<![,:]) ", bare), text
        assert len(texts) >= 20 and len(values) >= DISTINCT.get(i, 3), (schema, style, texts)


def _written(value, item_sep=", ", key_sep=": ") -> str:
    return json.dumps(value, ensure_ascii=False, separators=(item_sep, key_sep))


VALID = [  # (schema index, instances written the regex's way, instances it must not take)
    (0, [{"name": "", "age": 0}, {"name": "bob", "age": 130, "ok": False}, {"name": "a\nb\"é😀", "age": 7}],
     [{"name": "bob"}, {"name": "x", "age": 131}, {"name": "123456789", "age": 1},
      {"name": "x", "age": -1}, {"name": "x", "age": 1.5}]),
    (1, [[0], [-1.5, 2e10, 0.25, 7]], [[], [1, 2, 3, 4, 5], ["1"]]),
    (3, ["abcd", None, ""], ["abcde", 1]),
    (4, [-3, -2.999, 0, 1.999, 1, -0.5], [2, 2.0, -3.0001, -4, 5]),
    (5, [0.001, 1, 12345.5], [0, -0.5]),
    (6, [-5, 0, 1000], [-6, 1001, 2.5]),
    (7, [10, 99, 0, -4, "x"], [5, 1, "y"]),
    (9, [{"kind": "a", "v": 3}, {"kind": "c"}, {"kind": "b", "w": True}], [{"kind": "a"}, {"kind": "d"}]),
    (10, [{"c": "red"}, {"c": "blue", "p": {"x": 1, "y": -2}, "ps": [{"x": 0, "y": 0}]}],
     [{"c": "pink"}, {"c": "red", "p": {"x": 1}}]),
    (11, [{}, {"a": None, "c": 2.5}, {"b": True}, {"a": None, "b": False, "c": 1}], [{"c": 3}, {"b": 1}]),
    (12, [{}], [{"a": 1}]),
    (14, ["abc-12", "a-00"], ["abd-12", "a-123", "-12"]),
    (15, ["xy", "axzb", " x z xy!"], ["x", "yz"]),
    (17, [str(uuid.UUID(int=0x1234567890abcdef1234567890abcdef))], ["1234"]),
    (18, ["2024-02-29", "0001-01-01", "9999-12-31"], ["2023-02-29", "2024-13-01", "0000-01-01", "2024-4-01"]),
    (21, [[], [1], [1, "ab"]], [["ab"], [1, "abc"], [1, "a", 2]]),
    (22, [[True, None], [False, None, None, None]], [[True], [None, None], [True, None, None, None, None]]),
    (23, [-0.5, -0.49, 0, 1.2499, 1, 0.05], [-0.51, 1.25, 1.3, -1, 2]),
    (24, [{}, {"k": 0, "": 5, "é\n\"/": 12}], [{"k": -1}, {"a": 1, "b": 2, "c": 3, "d": 4}, {"k": "1"}]),
    (25, [{"x/y": True}, {"a": "xy", "x/y": False, "b": None, "a/": None}, {"x/y": True, "é": None}],
     [{"a": "x"}, {"x/y": True, "a": None}, {"x/y": None}, {"x/y": True, "c": 1}]),
    (26, [{"a": True}, {"abc": False, "b": True}], [{}, {"d": True}, {"a": 1}, {"ad": True}]),
    (27, [{}, {"ab": 0.06, "zz": 12}], [{"ab": 0.05}, {"ab": -1}, {"ab": "x"}]),
    (28, [[], ["x", 1, None, True], [1, None]], [["x", "x"], [1, 1.0], [None, None], [2]]),
    (29, [["red"], ["green", "blue"], ["red", "green", "blue"]], [[], ["red", "red"], ["pink"]]),
]


@pytest.mark.parametrize("i, good, bad", VALID)
def test_instances_are_taken_or_refused_as_the_schema_says(i, good, bad):
    """Valid instances written compactly, with `, ` / `: ` and with pretty-printing whitespace are taken (in the
    style that allows that whitespace); invalid ones never."""
    schema = SCHEMAS[i]
    validator = _validator(schema)
    default, tight = Regex(schema_pattern(schema)), Regex(schema_pattern(schema, disable_any_whitespace=True))
    for value in good:
        assert validator.is_valid(value), value  # (the test's own cases are right)
        assert tight.fullmatch(_written(value)), value
        assert default.fullmatch(_written(value, ",", ":")) and default.fullmatch(" " + _written(value))
        assert default.fullmatch(json.dumps(value, ensure_ascii=False, indent=2)), value
    for value in bad:
        assert not validator.is_valid(value), value
        for text in (_written(value), _written(value, ",", ":")):
            assert not default.fullmatch(text) and not tight.fullmatch(text), value


def test_optional_properties_in_every_combination_and_only_in_order():
    schema = {"type": "object", "properties": {k: {"type": "integer", "maximum": 9} for k in "abc"},
              "required": ["b"]}
    rx = Regex(schema_pattern(schema, disable_any_whitespace=True))
    for keys in itertools.chain.from_iterable(itertools.permutations("abc", n) for n in range(4)):
        text = _written({k: 1 for k in keys})
        assert rx.fullmatch(text) == ("b" in keys and list(keys) == sorted(keys)), text


@pytest.mark.parametrize("lo, hi", [(None, None), (0, None), (None, 0), (-1, None), (None, -1), (7, 7), (-7, -7),
                                    (0, 0), (-15, 123), (10, 99), (3, 1000), (-999, -10), (19, 200), (1, 9),
                                    (None, 45), (-100, None), (101, None), (99, 100)])
def test_integer_ranges_against_python_ints(lo, hi):
    rx = Regex(integer_range(lo, hi))
    for n in range(-1300, 1300):
        assert rx.fullmatch(str(n)) == ((lo is None or n >= lo) and (hi is None or n <= hi)), n
    for n in (10 ** 7, -10 ** 7, 123456789):
        assert rx.fullmatch(str(n)) == ((lo is None or n >= lo) and (hi is None or n <= hi)), n
    for text in ("-0", "007", "+1", "1.0", "", "-"):
        assert not rx.fullmatch(text)


NUMBERS = [f"{sign}{n}{frac}" for sign in ("", "-") for n in range(0, 14)
           for frac in ("", ".0", ".00", ".5", ".05", ".999", ".10")]


@pytest.mark.parametrize("lo, lo_in, hi, hi_in", [
    (None, True, None, True), (0, True, 1, True), (0, False, 1, False), (-3, True, 2, False), (-3, False, -1, True),
    (5, True, None, True), (5, False, None, True), (None, True, -2, True), (None, True, -2, False), (2, True, 2, True),
    (-12, False, 12, False), (0, True, None, True), (None, True, 0, False), (1, True, 12, True)])
def test_number_ranges_against_exact_arithmetic(lo, lo_in, hi, hi_in):
    """Decimals with and without fractions: taken exactly when within the bounds, never as `-0` (0 has no sign)."""
    rx = Regex(number_range(lo, lo_in, hi, hi_in))
    for text in NUMBERS:
        v = Fraction(text)
        within = (lo is None or v > lo or (lo_in and v == lo)) and (hi is None or v < hi or (hi_in and v == hi))
        assert rx.fullmatch(text) == (within and not (text.startswith("-") and v == 0)), text
    for text in ("01", "1.", ".5", "+1", "1e3", "--1"):
        assert not rx.fullmatch(text)


DECIMAL_BOUNDS = [None, "0", "0.5", "-0.5", "0.05", "1.25", "-1.25", "0.999", "2", "0.001", "1.0501", "10.1"]
DECIMALS = [f"{sign}{n}{frac}" for sign in ("", "-") for n in (0, 1, 2, 9, 10, 11)
            for frac in ("", ".0", ".00", ".5", ".05", ".049", ".051", ".0500001", ".999", ".9991", ".25", ".2499",
                         ".2501", ".001", ".0009", ".1", ".0501", ".05009")]


@pytest.mark.parametrize("lo", DECIMAL_BOUNDS)
def test_decimal_number_ranges_against_exact_arithmetic(lo):
    """Bounds with fractions (each against every other, included or not): a number is taken exactly when its
    decimal value is within them (`Fraction`), never as `-0`; where none is, there is no regex."""
    for hi, lo_in, hi_in in itertools.product(DECIMAL_BOUNDS, (True, False), (True, False)):
        low, high = (None if v is None else Fraction(v) for v in (lo, hi))
        wanted = [text for text in DECIMALS if (low is None or (v := Fraction(text)) > low or (lo_in and v == low))
                  and (high is None or (v := Fraction(text)) < high or (hi_in and v == high))
                  and not (text.startswith("-") and Fraction(text) == 0)]
        pattern = number_range(None if lo is None else Decimal(lo), lo_in, None if hi is None else Decimal(hi), hi_in)
        if pattern is None:  # (then no number is within: none of the texts, nor the bounds themselves)
            assert not wanted and (low is None or high is None or low > high or (low == high and not (lo_in and hi_in)))
            continue
        rx = Regex(pattern)
        assert [text for text in DECIMALS if rx.fullmatch(text)] == wanted, (lo, lo_in, hi, hi_in)


def test_a_float_bound_is_the_decimal_it_is_written_as():
    """0.1 as a bound is 0.1 (its shortest repr), not the binary float's 0.1000000000000000055...: a text equal to
    the bound is taken where the bound is included."""
    rx = Regex(schema_pattern({"type": "number", "minimum": 0.1, "maximum": 0.3}))
    assert rx.fullmatch("0.1") and rx.fullmatch("0.3") and rx.fullmatch("0.2")
    assert not rx.fullmatch("0.09999") and not rx.fullmatch("0.30001")
    rx = Regex(schema_pattern({"type": "number", "exclusiveMinimum": 1e-3, "maximum": 1e2}))
    assert rx.fullmatch("0.0011") and rx.fullmatch("100") and not rx.fullmatch("0.001") and not rx.fullmatch("100.01")


def test_bounded_numbers_are_valid_read_as_floats_too():
    """A validator that reads a fraction as a float and an integer as an exact int (jsonschema, pydantic) agrees
    with every bounded number generated (found by a review): an integral float bound past 2**53 is the tighter of
    its repr and its value; a number of 10**15 or more has no fraction (it would round); a fraction that must not
    be 0 starts with at most 306 zeros (more would read as 0 or a subnormal); bounds below the smallest normal
    float are refused. Each case is checked against jsonschema too."""
    zeros = "0" * 306
    cases = [  # (schema, texts taken, texts refused)
        ({"type": "number", "maximum": 1e23}, ["99999999999999991611392", "5"], ["100000000000000000000000"]),
        ({"type": "number", "minimum": 1e23}, ["100000000000000000000000", "100000000000000000000001"],
         ["99999999999999991611392", "100000000000000000000000.0"]),
        ({"type": "integer", "minimum": 1e23}, ["100000000000000000000000"], ["99999999999999991611392"]),
        ({"type": "number", "minimum": 10 ** 23}, ["100000000000000000000000"], ["100000000000000000000000.0"]),
        ({"type": "number", "minimum": 0}, ["999999999999999.5", "1000000000000000", "12345678901234567890"],
         ["1000000000000000.5", "9007199254740993.0"]),
        ({"type": "number", "exclusiveMinimum": 0}, [f"0.{zeros}1", "0.5"], [f"0.{zeros}01", "0", "0.0"]),
        ({"type": "number", "exclusiveMaximum": 0}, [f"-0.{zeros}1", "-3"], [f"-0.{zeros}01", "0", "-0"]),
        ({"type": "number", "exclusiveMinimum": 1e-5, "maximum": 1}, ["0.0000100001", "1"], ["0.00001", "0"]),
    ]
    for schema, good, bad in cases:
        rx, validator = Regex(schema_pattern(schema)), _validator(schema)
        for text in good:
            assert rx.fullmatch(text) and validator.is_valid(json.loads(text)), (schema, text)
        for text in bad:
            assert not rx.fullmatch(text), (schema, text)
    for schema, message in [({"type": "number", "exclusiveMinimum": 5e-324}, "below the smallest normal float"),
                            ({"type": "number", "maximum": -1e-310}, "below the smallest normal float"),
                            ({"type": "number", "maximum": 10 ** 1001}, "more than 1000 digits"),
                            ({"type": "integer", "minimum": -10 ** 1001}, "more than 1000 digits"),
                            ('{"type": "integer", "minimum": 1' + "0" * 5000 + "}", "not a JSON schema"),
                            ({"type": "number", "minimum": None}, "minimum must be a finite number, got None"),
                            ({"type": "string", "maxLength": None}, "maxLength must be a non-negative integer"),
                            ({"type": "array", "items": {"const": 1}, "minItems": None}, "minItems must be"),
                            ({"type": "object", "additionalProperties": {"type": "null"}, "minProperties": None},
                             "minProperties must be"),
                            ({"type": "object", "properties": {"a": {"type": "null"}, "b": {"type": "null"}},
                              "required": ["a", "a"], "minProperties": 2}, "minProperties beside properties")]:
        with pytest.raises(SchemaError, match=re.escape(message)):
            schema_pattern(schema)


def test_odd_names_and_bound_types():
    """A listed name holding U+10FFFF (the last code point) is left out of the other properties' names; a numpy
    float bound (its repr is `np.float64(...)`) is read as its value."""
    schema = {"type": "object", "properties": {"\U0010ffff": {"type": "null"}}, "additionalProperties": {"const": 1}}
    rx = Regex(schema_pattern(schema))
    assert rx.fullmatch('{"\U0010ffff":null,"\U0010fffe":1}') and not rx.fullmatch('{"\U0010ffff":1}')
    assert Regex(schema_pattern({"type": "number", "minimum": np.float64(0.5)})).fullmatch("0.5")


def test_other_properties_never_take_a_listed_name_in_any_writing():
    """An additionalProperties pair whose name is a listed property's (written plainly or with escapes) is
    refused: a JSON parser keeps the last value, which would have to meet both schemas."""
    schema = SCHEMAS[25]
    rx = Regex(schema_pattern(schema, disable_any_whitespace=True))
    assert rx.fullmatch('{"x/y": true, "b": null}') and rx.fullmatch('{"x/y": true, "x\\/yz": null}')
    for name in ('"a"', '"x/y"', '"x\\/y"', '"\\u0061"'):
        assert not rx.fullmatch('{"x/y": true, ' + name + ': null}'), name


def test_dates_are_exactly_the_calendars():
    """Every day number 00..32 of every month 00..13 of common and leap years (and the edges of the years): taken
    exactly when Python's `date.fromisoformat` takes it."""
    rx = Regex(schema_pattern({"type": "string", "format": "date"}))
    for year in ("0000", "0001", "0004", "1900", "2000", "2023", "2024", "2100", "2400", "9999", "0400"):
        for month, day in itertools.product(range(14), range(33)):
            text = f"{year}-{month:02d}-{day:02d}"
            try:
                datetime.date.fromisoformat(text)
                ok = True
            except ValueError:
                ok = False
            assert rx.fullmatch(json.dumps(text)) == ok, text


def test_times_date_times_and_uuids():
    times = Regex(schema_pattern({"type": "string", "format": "time"}))
    stamps = Regex(schema_pattern({"type": "string", "format": "date-time"}))
    uuids = Regex(schema_pattern({"type": "string", "format": "uuid"}))
    for text in ("00:00:00Z", "23:59:59.125+05:30", "12:30:00-00:00"):
        assert times.fullmatch(f'"{text}"') and datetime.time.fromisoformat(text.replace("Z", "+00:00"))
    for text in ("24:00:00Z", "12:60:00Z", "12:00:00", "1:00:00Z", "12:00:00+5:00"):
        assert not times.fullmatch(f'"{text}"'), text
    assert stamps.fullmatch('"2024-02-29T23:59:59.5Z"') and not stamps.fullmatch('"2023-02-29T00:00:00Z"')
    for _ in range(20):
        u = str(uuid.uuid4())
        assert uuids.fullmatch(f'"{u}"') and uuids.fullmatch(f'"{u.upper()}"')
    assert not uuids.fullmatch(f'"{uuid.uuid4().hex}"')


def _is_email(text: str) -> bool:
    """RFC 5321's mailbox with a dot-atom local part at a host name of two labels or more (jsonschema's own email
    check only looks for an '@')."""
    local, _, domain = text.rpartition("@")
    atext = set(string.ascii_letters + string.digits + "!#$%&'*+/=?^_`{|}~-")
    return (0 < len(local) <= 64 and all(part and set(part) <= atext for part in local.split("."))
            and fqdn.FQDN(domain, min_labels=2).is_valid)


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
        return True
    except ValueError:
        return False


FORMAT_CASES = {  # format: (the walks' alphabet, an independent check, texts taken, texts refused)
    "ipv4": ("0123456789.", lambda t: str(ipaddress.IPv4Address(t)) == t,
             ["0.0.0.0", "255.255.255.255", "10.1.20.199"], ["256.1.1.1", "01.2.3.4", "1.2.3", "1.2.3.4.5", ""]),
    "ipv6": ("0123456789abcdefABCDEF:.", _is_ipv6,
             ["::", "::1", "1::", "fe80::1:2", "1:2:3:4:5:6:7:8", "1:2:3:4:5:6:7::", "::ffff:1.2.3.4",
              "1:2:3:4:5:6:1.2.3.4", "1::2:3:4:5:6:7"],
             [":::", "1:2:3:4:5:6:7:8:9", "1::2::3", "12345::", "1:2:3:4:5:6:7:1.2.3.4", "fe80::1%eth0", "g::"]),
    "hostname": ("abcAZ019-.", lambda t: fqdn.FQDN(t, min_labels=1).is_valid,
                 ["a", "example.com", "a-b.c-d.e1.x", "x" * 62, "1a.b"], ["-a", "a-", "a..b", "a.1", "a_b", "a." ,
                                                                           "x" * 64]),
    "email": ("ab19.@-+_%/", _is_email, ["a@b.c", "first.last+tag@mail.example.org", "x/y=z@a1.b2"],
              ["a@b", ".a@b.c", "a.@b.c", "a..b@c.d", "a@-b.c", "@b.c", "a b@c.d"]),
    "duration": ("PYMWDTHS0129", lambda t: pydantic.TypeAdapter(datetime.timedelta).validate_python(t) is not None,
                 ["P1D", "P1W", "PT1S", "P1Y2M3DT4H5M6S", "PT36H", "P0D", "P1M1D", "PT1M1S"],
                 ["P", "PT", "P1DT", "P1H", "PT1D", "P1Y1W", "P1.5D", "PT1H1S", "P1234567D", "P-1D"]),
    "uri": ("ahtps:/.19?#%[]:@AF-_~!=", lambda t: pydantic.AnyUrl(t) is not None,
            ["https://example.com", "http://a.b:8080/p/a%20t/h?q=1&r=/x#frag", "ftp://[::1]/x", "s+v.x-y://1.2.3.4"],
            ["https://", "http://a b", "1http://x", "http://x/%zz", "mailto:a@b.c", "http://a\\b", "//x"]),
}


@pytest.mark.parametrize("fmt", sorted(FORMAT_CASES))
def test_formats_against_independent_checks(fmt):
    """Random whole matches pass jsonschema's format check (jsonschema[format-nongpl]: ipaddress, fqdn, isoduration,
    rfc3987-syntax) and the format's own independent check (ipaddress, fqdn, pydantic's timedelta and AnyUrl, an
    RFC 5321 mailbox); written examples are taken or refused as they should be."""
    alphabet, check, good, bad = FORMAT_CASES[fmt]
    schema = {"type": "string", "format": fmt}
    validator, rx = _validator(schema), Regex(schema_pattern(schema))
    texts = _walks(rx, seed=len(fmt), count=150, limit=400, alphabet='"' + alphabet)
    assert len(set(texts)) >= 100
    for text in texts:
        value = json.loads(text)
        validator.validate(value)
        assert check(value), value
    for value in good:
        assert validator.is_valid(value) and check(value), value  # (the test's own cases are right)
        assert rx.fullmatch(json.dumps(value)), value
    for value in bad:
        assert not rx.fullmatch(json.dumps(value)), value


def test_ipv6_texts_are_exactly_pythons():
    """Every text of up to 17 pieces '1', ':' and one IPv4 address at most (a seeded sample of 40,000) is taken
    exactly when `ipaddress.IPv6Address` takes it: where `::` may stand, how many groups, the IPv4 tail."""
    rx, rng = Regex(schema_pattern({"type": "string", "format": "ipv6"})), random.Random(6)
    for _ in range(40_000):
        pieces = [rng.choice("1:") for _ in range(rng.randrange(1, 17))]
        if rng.random() < 0.3:
            pieces.insert(rng.randrange(len(pieces) + 1), "1.2.3.4")
        text = "".join(pieces)
        assert bool(rx.fullmatch(json.dumps(text))) == _is_ipv6(text), text


def _match_lengths(rx: Regex) -> tuple[int, int | None]:
    """The fewest and most characters of a whole match of `rx` over printable ASCII (None: no most), from its whole
    automaton: the shortest path to a match, and the longest (None when a loop lies on one)."""
    graph, todo = {}, [rx.start]
    while todo:
        state = todo.pop()
        if state not in graph:
            graph[state] = [n for c in map(chr, range(0x20, 0x7F)) if (n := rx.step(state, c))]
            todo += graph[state]
    dist, queue = {rx.start: 0}, collections.deque([rx.start])
    while queue:
        state = queue.popleft()
        for n in graph[state]:
            if n not in dist:
                dist[n] = dist[state] + 1
                queue.append(n)
    longest, active = {}, set()

    def most(state) -> int:  # -1: no match from here
        if state in active:
            raise OverflowError
        if state not in longest:
            active.add(state)
            longest[state] = max([most(n) + 1 for n in graph[state] if most(n) >= 0] + [0 if rx.accepts(state) else -1])
            active.discard(state)
        return longest[state]

    try:
        top = most(rx.start)
    except OverflowError:
        top = None
    return min(d for state, d in dist.items() if rx.accepts(state)), top


def test_format_lengths_are_the_written_texts_and_length_bounds_beside_formats():
    """minLength / maxLength beside a format are taken where every text the format is written as meets them
    (pydantic's AnyUrl says minLength 1): the table of each format's fewest and most characters is its automaton's.
    HttpUrl's maxLength 2083 is refused (a uri's path has no bound here)."""
    for fmt, (shortest, longest) in _FORMAT_LENGTHS.items():
        assert _match_lengths(Regex(_FORMATS[fmt])) == (shortest, longest), fmt
        rx = Regex(schema_pattern({"type": "string", "format": fmt, "minLength": shortest,
                                   **({} if longest is None else {"maxLength": longest})}))
        example = {"date": "2024-01-01", "time": "00:00:00Z", "date-time": "2024-01-01T00:00:00Z",
                   "uuid": str(uuid.UUID(int=5))}.get(fmt) or FORMAT_CASES[fmt][2][0]
        assert rx.fullmatch(json.dumps(example)), fmt

    class Links(pydantic.BaseModel):
        home: pydantic.AnyUrl
        when: datetime.timedelta
        ip: ipaddress.IPv4Address
        ip6: ipaddress.IPv6Address

    rx = Regex(schema_pattern(Links.model_json_schema()))
    texts = _walks(rx, seed=3, count=20, limit=400, alphabet='"{}:, ahtps/.19PDTHMSomewni6')
    assert len(texts) >= 10
    for text in texts:
        Links.model_validate_json(text)

    class Site(pydantic.BaseModel):
        url: pydantic.HttpUrl

    with pytest.raises(SchemaError, match="at /properties/url/format: minLength or maxLength beside format"):
        schema_pattern(Site.model_json_schema())


def test_an_unanchored_pattern_matches_anywhere_and_only_printable_ascii_is_generated():
    """JSON Schema's `pattern` is a search unless anchored: Python's `re.search` agrees with every walk, and the
    walks' strings are printable ASCII without escapes."""
    for pattern in ("x[yz]", "^ab", r"\d$", r"^(a|b)c$", r"[^a]\W"):
        rx = Regex(schema_pattern({"type": "string", "pattern": pattern}))
        for text in _walks(rx, seed=len(pattern), count=30, alphabet='xyzabc9 .-"\\\n'):
            s = json.loads(text)
            assert re.search(pattern, s) and text.strip() == f'"{s}"' and all(" " <= c <= "~" for c in s), (pattern, s)


def test_pydantic_models_schemas_give_json_the_model_validates():
    from enum import Enum
    from typing import Literal, Optional

    class Size(str, Enum):
        small = "small"
        large = "large"

    Code = pydantic.constr(pattern="^[a-z]{2}$")

    class Item(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=6)
        size: Size
        count: int = pydantic.Field(ge=1, le=50)

    class Order(pydantic.BaseModel):
        kind: Literal["order"]
        items: list[Item] = pydantic.Field(max_length=2)
        note: Optional[str] = pydantic.Field(default=None, max_length=5)
        paid: bool
        pair: tuple[int, str] = pydantic.Field(default=(0, ""))
        price: float = pydantic.Field(gt=0.5, le=99.95)
        stock: dict[str, int] = pydantic.Field(default_factory=dict, max_length=2)
        flags: dict[Literal["a", "b"], bool] = {}
        codes: dict[Code, float] = {}
        sizes: set[Size] = pydantic.Field(default_factory=set, min_length=1)

    rx = Regex(schema_pattern(Order.model_json_schema()))
    texts = _walks(rx, seed=7, count=25, limit=400)
    assert len(texts) >= 15
    for text in texts:
        Order.model_validate_json(text)
    tight = Regex(schema_pattern(Order.model_json_schema(), disable_any_whitespace=True))
    order = Order(kind="order", items=[], paid=True, price=99.95, stock={"x": 1, "y": 2}, flags={"b": False},
                  codes={"ab": 0.5}, sizes={Size.large})  # (one: a set's order varies)
    assert tight.fullmatch(order.model_dump_json().replace(",", ", ").replace(":", ": "))
    for bad in (order.model_copy(update={"price": 0.5}), order.model_copy(update={"stock": {"x": 1, "y": 2, "z": 3}}),
                order.model_copy(update={"codes": {"abc": 0.5}})):
        assert not tight.fullmatch(bad.model_dump_json().replace(",", ", ").replace(":", ": "))


@pytest.mark.parametrize("schema, message", [
    ({}, "at /: a schema that takes any JSON value"),
    ({"type": "array"}, "items may be any JSON values"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 2}, "items may be any JSON values"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False, "minItems": 2}, "no array is valid"),
    ({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 2}}},
     "at /properties/a/multipleOf: the keyword 'multipleOf' is not supported"),
    ({"type": "string", "format": "iri"}, "format 'iri' is not supported"),
    ({"type": "string", "format": "uri", "maxLength": 2083}, "supported only where every uri written here meets it"),
    ({"type": "string", "format": "date", "maxLength": 9}, "(from 10 to 10 characters)"),
    ({"type": "string", "format": "ipv4", "minLength": 8}, "minLength or maxLength beside format"),
    ({"type": "object", "required": ["a"]}, "required property 'a' is not in properties"),
    ({"$defs": {"N": {"type": "object", "properties": {"n": {"$ref": "#/$defs/N"}}}}, "$ref": "#/$defs/N"},
     "is recursive"),
    ({"$ref": "https://example.com/s.json"}, "only references within the schema"),
    ({"$ref": "#/$defs/missing"}, "points at nothing"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf's branches 0 and 1 may both match"),
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"enum": [2, 1]}}, "required": ["k"]}]}, "may both match"),
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"enum": [1.0]}}, "required": ["k"]}]}, "may both match"),
    ({"oneOf": [{"const": 1}, {"enum": [2, 1.0]}]}, "may both match"),  # (JSON Schema: 1.0 == 1)
    ({"$ref": "#"}, "is recursive"),
    ({"allOf": [{"type": "integer"}, {"minimum": 1}]}, "allOf is supported with one schema only"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer is within"),
    ({"type": "number", "minimum": 0.5, "exclusiveMaximum": 0.5}, "no number is within"),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
     "a name may be written twice"),
    ({"type": "object", "minProperties": 1}, "no property is generated"),
    ({"type": "object", "properties": {"a": {"type": "null"}}, "minProperties": 1},
     "at /minProperties: minProperties beside properties"),
    ({"type": "object", "properties": {"a": {"type": "null"}}, "required": ["a"], "maxProperties": 1,
      "additionalProperties": {"type": "null"}}, "at /maxProperties: maxProperties beside properties"),
    ({"type": "object", "properties": {"a": {"type": "null"}}, "propertyNames": {"maxLength": 1}},
     "propertyNames beside properties"),
    ({"type": "object", "propertyNames": {"type": "integer"}, "additionalProperties": {"type": "null"}},
     "propertyNames must take strings only"),
    ({"type": "object", "additionalProperties": 3}, "additionalProperties must be a schema"),
    ({"type": "object", "patternProperties": {"^a": {"type": "null"}, "^b": {"type": "null"}}},
     "patternProperties is supported with one pattern"),
    ({"type": "object", "patternProperties": {"^a": {"type": "null"}}, "additionalProperties": {"type": "null"}},
     "no additionalProperties schema"),
    ({"type": "object", "patternProperties": {"(?P<x>a)": {"type": "null"}}},
     "at /patternProperties: pattern '(?P<x>a)'"),
    ({"type": "string", "maxLength": 2, "minLength": 3}, "maxLength 2 is below minLength 3"),
    ({"type": "string", "maxLength": 5000}, "maxLength above 1000"),
    ({"type": "string", "pattern": "^a|b$"}, "anchored pattern with a '|'"),
    ({"type": "string", "pattern": "(?=a)"}, "look-arounds"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     "at /uniqueItems: uniqueItems is supported only for items of a const / enum"),
    ({"type": "array", "prefixItems": [{"const": 1}], "items": {"const": 2}, "uniqueItems": True},
     "without prefixItems"),
    ({"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True, "maxItems": 2},
     "at /maxItems: maxItems beside uniqueItems is supported only when every subset of the 3 values"),
    ({"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True, "minItems": 2}, "at /minItems"),
    ({"enum": [[1, 1]], "uniqueItems": True}, "uniqueItems is supported only beside an array's items"),
    ({"type": "string", "uniqueItems": True}, "uniqueItems is supported only beside an array's items"),
    ({"type": "array", "items": {"enum": [1]}, "uniqueItems": 1}, "uniqueItems must be a boolean"),
    ({"type": "array", "items": {"$ref": "#/$defs/nothing"}, "uniqueItems": True}, "points at nothing"),
    ({"type": "date"}, "type must be one of"),
    ({"enum": [1, 2], "type": "string"}, "no value of enum has the schema's type"),
    ({"enum": [], "type": "string"}, "enum must be a non-empty list"),
    ({"enum": [float("nan")]}, "is not a JSON value"),
    ({"anyOf": [{"type": "integer"}], "minimum": 3}, "'minimum' beside 'anyOf'"),
    ({"type": "array", "items": [{"type": "integer"}]}, "items as a list"),
    ("{not json", "not a JSON schema"), ([], "must be an object"),
    # (found by a review: each let invalid JSON in, or raised something other than SchemaError)
    ({"oneOf": [{"minLength": 1}, {"type": "integer"}]}, "may both match"),  # no type: every type
    ({"$defs": {"A": {"$id": "http://x.example/a", "$defs": {"B": {"type": "string"}}, "type": "object",
                      "properties": {"p": {"$ref": "#/$defs/B"}}, "required": ["p"]}, "B": {"type": "integer"}},
      "$ref": "#/$defs/A"}, "goes through an $id"),
    ({"type": "object", "properties": {"a": {"$id": "x", "type": "string"}}}, "$id below the root"),
    ({"type": "string", "pattern": "^a**$"}, "multiple repeat"),
    ({"type": "string", "pattern": "^[^\\a]$"}, "'\\a', which ECMA-262"), ({"type": "string", "pattern": "a{,2}"}, "'{,n}'"),
    ({"type": "string", "pattern": "^[]a]$"}, "']' first in a class"), ({"type": "string", "pattern": "[^]a]"}, "first"),
    ({"type": "string", "pattern": "(?P<x>a)"}, "'(?P'"),
    ({"type": {}}, "type must be one of"), ({"type": ["string", []]}, "type must be one of"),
    ({"type": "string", "format": ["date"]}, "format ['date'] is not supported"),
    ({"type": "string", "maxLength": float("inf")}, "must be a non-negative integer, got inf"),
    ({"type": "string", "minLength": float("nan")}, "got nan"),
    ({"type": "integer", "minimum": 10 ** 401, "maximum": 10 ** 400}, "no integer is within"),
    ({"$defs": {"L": [{"type": "integer"}]}, "$ref": "#/$defs/L/\u00b2"}, "points at nothing"),
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}, "regex is too large"),
    ({"$defs": {"A0": {"type": "integer"}, **{f"A{n}": {"type": "object", "properties": {
        "x": {"$ref": f"#/$defs/A{n - 1}"}, "y": {"$ref": f"#/$defs/A{n - 1}"}}, "required": ["x", "y"]}
        for n in range(1, 40)}}, "$ref": "#/$defs/A39"}, "regex is too large"),
    (functools.reduce(lambda s, _: {"type": "array", "items": s}, range(3000), {"type": "integer"}),
     "nested too deeply"),
])
def test_what_cannot_be_honoured_is_refused_with_its_path(schema, message):
    with pytest.raises(SchemaError, match=re.escape(message)):
        schema_pattern(schema)


def test_references_by_index_and_escapes_and_one_of_references():
    """`$ref`s with JSON Pointer's `~1` and a URI's `%20` escapes, an array index, and `oneOf` branches that are
    references, against jsonschema."""
    schema = {"$defs": {"a b": {"type": "string", "maxLength": 3}, "a%20b": {"type": "integer"},
                        "s/t": {"type": "boolean"}, "U": {"anyOf": [{"type": "null"}, {"type": "string"}]}},
              "type": "object", "properties": {"p": {"$ref": "#/$defs/a%20b"}, "q": {"$ref": "#/$defs/s~1t"},
                                               "r": {"$ref": "#/$defs/U/anyOf/0"},
                                               "o": {"oneOf": [{"$ref": "#/$defs/a%20b"}, {"$ref": "#/$defs/U/anyOf/0"}]}},
              "required": ["p", "q", "r", "o"]}
    rx, validator = Regex(schema_pattern(schema)), _validator(schema)
    assert rx.fullmatch('{"p": "ab", "q": true, "r": null, "o": null}')
    assert not rx.fullmatch('{"p": 1, "q": true, "r": null, "o": null}')
    for text in _walks(rx, seed=3, count=30, limit=200):
        validator.validate(json.loads(text))


def test_whitespace_options():
    """`disable_any_whitespace` writes `, ` and `: ` only; a `whitespace_pattern` is used between tokens and may only
    match JSON whitespace; giving both is refused."""
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
              "required": ["a"]}
    tight = Regex(schema_pattern(schema, disable_any_whitespace=True))
    assert tight.fullmatch('{"a": [1, 2]}') and not tight.fullmatch('{"a":[1,2]}')
    assert not tight.fullmatch('{ "a": [1, 2]}')
    tabs = Regex(schema_pattern(schema, whitespace_pattern="\t*"))
    assert tabs.fullmatch('\t{\t"a"\t:[1\t,\t\t2]}') and not tabs.fullmatch('{"a": [1]}')
    default = Regex(schema_pattern(schema))
    assert default.fullmatch('\n{\n  "a" :\t[ 1,2 ]\n}') and not default.fullmatch('{"a": [1]}\n\r')
    for ws, message in (("x?", "not JSON whitespace"), (r"\s*", "not JSON whitespace"), ("(", "missing")):
        with pytest.raises(SchemaError, match=message):
            schema_pattern(schema, whitespace_pattern=ws)
    with pytest.raises(SchemaError, match="contradict"):
        schema_pattern(schema, whitespace_pattern=" ", disable_any_whitespace=True)


def test_structured_outputs_params_take_json_and_refuse_with_the_field():
    """`StructuredOutputsParams(json=...)`: a dict or its JSON text, the same pattern; bad schemas and options are
    ParamErrors naming structured_outputs, the schema's path in the message; a schema too large for a regex too."""
    schema = SCHEMAS[0]
    a = StructuredOutputsParams(json=schema)
    b = StructuredOutputsParams(json=json.dumps(schema))
    SamplingParams(structured_outputs=a)
    assert a.kind == "json" and a.pattern == b.pattern == schema_pattern(schema)
    assert StructuredOutputsParams(json=schema, disable_any_whitespace=True).pattern == \
        schema_pattern(schema, disable_any_whitespace=True)
    for so, message in (
            (StructuredOutputsParams(json={"type": "string", "format": "ipv9"}), "json: at /format: format 'ipv9'"),
            (StructuredOutputsParams(json=3), "json must be a JSON schema"),
            (StructuredOutputsParams(json=schema, regex="a"), "exactly one of choice, regex, json and json_object"),
            (StructuredOutputsParams(json=schema, disable_any_whitespace=1), "disable_any_whitespace must be true"),
            (StructuredOutputsParams(json=schema, whitespace_pattern=" ", disable_any_whitespace=True),
             "contradict"),
            (StructuredOutputsParams(json={"type": "array", "items": {"type": "string", "maxLength": 1000},
                                           "maxItems": 100}), "json: the schema's regex is too large"),
            (StructuredOutputsParams(json_object="yes"), "json_object must be true or false"),
            (StructuredOutputsParams(json_object=True, json=schema), "exactly one of"),
            (StructuredOutputsParams(grammar="root ::= 'a'"), "grammar is not supported")):
        with pytest.raises(ParamError, match=re.escape(message)) as e:
            SamplingParams(structured_outputs=so)
        assert e.value.param == "structured_outputs"


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def test_json_object_is_any_object_nested_up_to_its_depth():
    """`json_object`: walks give objects (json.loads) nested at most JSON_OBJECT_DEPTH deep, of every whitespace
    style; hand-written objects are taken up to that depth and not past it, and nothing but an object is."""
    assert JSON_OBJECT_DEPTH == 4
    for k, style in enumerate(STYLES):
        rx = Regex(object_pattern(**style))
        texts = _walks(rx, seed=k, count=30, limit=200, alphabet='{}[]",:ab1-.e \n\tnul')
        assert len(texts) >= 20
        for text in texts:
            value = json.loads(text)
            assert isinstance(value, dict) and _depth(value) <= JSON_OBJECT_DEPTH, text
        assert max(_depth(json.loads(t)) for t in texts) >= 2
    rx = Regex(object_pattern())
    four = {"a": [{"b": {"c": 1, "d": [1.5, "x", None, True]}}], "e": "\u00e9\n"}
    for value, depth in ((four, 5), ({"a": [{"b": {"c": 1}}]}, 4), ({"a": [{"b": {"c": []}}]}, 5), ({}, 1),
                         ({"k": [[[]]]}, 4), ({"k": [[[[]]]]}, 5)):
        assert _depth(value) == depth, value  # (the test's own cases are right)
        for text in (json.dumps(value), json.dumps(value, indent=1, ensure_ascii=False)):
            assert rx.fullmatch(text) == (depth <= JSON_OBJECT_DEPTH), text
    for text in ("[]", '"a"', "1", "null", '{"a" 1}', '{"a": 1,}', "{'a': 1}"):
        assert not rx.fullmatch(text), text
