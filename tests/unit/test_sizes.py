"""ds_longstraw.sizes: the one parser of byte sizes and the one of token counts.

Both callers' inputs are here: `longstraw export --max-shard-size` (a bare number counts bytes) and `longstraw plan`'s
memory options (a bare number counts GiB), and the planner's token counts (K, M, G powers of 1024).
"""

import argparse

import pytest

from ds_longstraw.sizes import GB, KB, MB, TB, GiB, KiB, MiB, SizeError, TiB, parse_bytes, parse_tokens


@pytest.mark.parametrize("text, expected", [
    ("96GB", 96 * GB), ("96 gb", 96 * GB), ("96G", 96 * GB), ("2TB", 2 * TB), ("2t", 2 * TB), ("500MB", 500 * MB),
    ("512M", 512 * MB), ("64KB", 64 * KB), ("64k", 64 * KB), ("7B", 7), ("80GiB", 80 * GiB), ("2TiB", 2 * TiB),
    ("3MiB", 3 * MiB), ("1kib", KiB), ("1.5GB", 1_500_000_000), ("1.5GiB", 3 * GiB // 2), (".5KB", 500),
    ("2.", 2), ("  12  ", 12), ("0", 0), ("1.9", 1),
], ids=lambda v: repr(v) if isinstance(v, str) else None)
def test_bytes_with_units(text, expected):
    assert parse_bytes(text) == expected


def test_a_bare_number_counts_what_the_caller_says():
    assert parse_bytes("12") == 12 and parse_bytes("12", bare=GiB) == 12 * GiB
    assert parse_bytes("1.5", bare=GiB) == 3 * GiB // 2
    assert parse_bytes("12GB", bare=GiB) == 12 * GB  # a unit wins over `bare`


def test_ints_are_bytes_already():
    assert parse_bytes(1000) == 1000 and parse_bytes(1000, bare=GiB) == 1000
    assert parse_bytes(2**53 + 1) == 2**53 + 1
    assert parse_bytes("9007199254740993") == 2**53 + 1  # exact: not through a float


@pytest.mark.parametrize("text, expected", [
    ("2M", 2 * 2**20), ("128K", 128 * 2**10), ("128k", 131_072), ("4096", 4096), ("4.5M", 9 * 2**19), ("1G", 2**30),
    (2048, 2048),
], ids=str)
def test_tokens(text, expected):
    assert parse_tokens(text) == expected


@pytest.mark.parametrize("parse, bad, words", [
    (parse_bytes, "lots", "'lots' is not a size in bytes"),
    (parse_bytes, "5 gigs", "'5 gigs' is not a size in bytes"),
    (parse_bytes, "-1GB", "'-1GB' is not a size in bytes"),
    (parse_bytes, "1e9", "'1e9' is not a size in bytes"),
    (parse_bytes, "", "'' is not a size in bytes"),
    (parse_bytes, -5, "-5: a size in bytes cannot be negative"),
    (parse_tokens, "2MB", "'2MB' is not a token count"),
    (parse_tokens, "many", "'many' is not a token count"),
    (parse_tokens, -1, "-1: a token count cannot be negative"),
], ids=lambda v: repr(v) if isinstance(v, str) else None)
def test_bad_values_are_named(parse, bad, words):
    with pytest.raises(ValueError, match=words):
        parse(bad)


def test_the_option_goes_into_the_message():
    with pytest.raises(ValueError, match="--max-shard-size '5 gigs' is not a size in bytes .* a bare number counts "
                                         "bytes"):
        parse_bytes("5 gigs", option="--max-shard-size")
    with pytest.raises(ValueError, match="a bare number counts GiB"):
        parse_bytes("lots", bare=GiB)
    with pytest.raises(ValueError, match="--context '2MB' is not a token count"):
        parse_tokens("2MB", option="--context")


def test_argparse_prints_the_message():
    """SizeError is an ArgumentTypeError as well: argparse shows its words, not 'invalid parse_tokens value'."""
    assert issubclass(SizeError, ValueError) and issubclass(SizeError, argparse.ArgumentTypeError)
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--context", type=parse_tokens)
    with pytest.raises(argparse.ArgumentError, match="argument --context: 'lots' is not a token count"):
        parser.parse_args(["--context", "lots"])
