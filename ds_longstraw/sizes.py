"""Sizes as people type them: bytes (memory, files) and token counts, one parser each.

Bytes, `parse_bytes`: a number and a unit, case ignored. Decimal units are powers of 1000 (B, KB, MB, GB, TB, and
K, M, G, T alike: how transformers, huggingface_hub and memory and disk vendors count), binary ones powers of 1024
(KiB, MiB, GiB, TiB). What a number without a unit means is the caller's to say: bytes for a file size
(`longstraw export --max-shard-size 1000`), GiB for memory (`longstraw plan --gpu-memory 80`).

Tokens, `parse_tokens`: a count, or one with K, M or G, which are powers of 1024 here (2**10, 2**20, 2**30 tokens):
context lengths are powers of two, so 2M is 2,097,152 tokens and 128K is 131,072.

A fraction is allowed (1.5GB, 4.5M) and the result is rounded down to a whole byte or token. A bad value raises
SizeError, a ValueError that names the value (and the option, where the caller gives it).
"""

import argparse
import re
from collections.abc import Mapping
from fractions import Fraction

KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12
KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40

BYTE_UNITS = {"b": 1, "k": KB, "kb": KB, "m": MB, "mb": MB, "g": GB, "gb": GB, "t": TB, "tb": TB,
              "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}
TOKEN_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30}
_BARE_NAMES = {1: "bytes", GiB: "GiB"}  # what a bare number counts, in an error message

_NUMBER_UNIT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


class SizeError(ValueError, argparse.ArgumentTypeError):
    """A value that is not a size. Also an ArgumentTypeError, so that argparse (type=parse_tokens) prints this
    message after the option's name instead of its own "invalid value" line."""


def _split(text: object) -> tuple[Fraction, str] | None:
    """(number, lower-case unit) of a string such as '1.5 GiB'; None when it is not a number and a word."""
    match = _NUMBER_UNIT.fullmatch(str(text))
    return (Fraction(match.group(1)), match.group(2).lower()) if match else None


def parse_bytes(value: int | str, bare: int = 1, option: str | None = None) -> int:
    """Bytes of '96GB', '80GiB', '500MB', '2TB', '64KB' (units as in the module docstring); a number without a
    unit counts `bare` bytes each (1: bytes; GiB: '80' is 80 GiB). An int is a byte count already and is returned
    as it is. `option` (say '--max-shard-size') goes into the error's message."""
    return _parse(value, BYTE_UNITS, bare, option, "a size in bytes",
                  "examples: 96GB, 80GiB, 500MB, 2TB; B, KB, MB, GB, TB count powers of 1000, KiB, MiB, GiB, TiB "
                  f"powers of 1024; a bare number counts {_BARE_NAMES.get(bare, f'{bare:,} bytes')}")


def parse_tokens(value: int | str, option: str | None = None) -> int:
    """Tokens of '2097152', '2M' (2 * 2**20), '128K', '4.5M'; an int is returned as it is."""
    return _parse(value, TOKEN_UNITS, 1, option, "a token count",
                  "examples: 2097152, 2M, 128K; K, M, G = 2**10, 2**20, 2**30 tokens")


def _parse(value: int | str, units: Mapping[str, int], bare: int, option: str | None, what: str,
           help_text: str) -> int:
    """A number with one of `units` (or none: `bare` each), rounded down; an int as it is (not negative)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise SizeError(f"{_named(option)}{value!r}: {what} cannot be negative")
        return value
    parts = _split(value)
    if parts is None or (parts[1] and parts[1] not in units):
        raise SizeError(f"{_named(option)}{value!r} is not {what} ({help_text})")
    number, unit = parts
    return int(number * (units[unit] if unit else bare))


def _named(option: str | None) -> str:
    return f"{option} " if option else ""
