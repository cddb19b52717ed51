"""Sizes as users type them (--budget, --device-memory): the spellings taken, and one line for the rest."""

import pytest

from gpipe_cli.errors import UserError
from gpipe_cli.units import parse_size


@pytest.mark.parametrize("text,expected", [("8GiB", 8 << 30), ("500MiB", 500 << 20), ("16GB", 16 * 10**9),
                                           ("1024", 1024), (" 1.5 KiB ", 1536), ("8 gib", 8 << 30), (".5KiB", 512),
                                           ("2PiB", 2 << 50), ("1EB", 10**18), ("3b", 3)])
def test_sizes_in_the_units_users_type(text, expected):
    assert parse_size(text, "--budget") == expected


@pytest.mark.parametrize("text,fragment", [
    ("1" + "0" * 400 + "GiB", "at most 1 YiB"),  # infinity as a float: no traceback
    ("1" + "0" * 30, "at most 1 YiB"),
    ("1e3", "expects a size such as 8GiB"),
    ("9" * 5000, "at most 1 YiB"),  # more digits than Python converts to an int
    ("eight", "expects a size such as 8GiB"),
    ("8GiB,16GiB", "expects a size such as 8GiB"),  # one size, whole: nothing after it is dropped
    ("8G", "a one-letter unit is ambiguous"),  # GB or GiB? One letter is not taken
    ("8Gbit", "expects a size such as 8GiB"),
    ("-1GiB", "expects a size such as 8GiB"),
    ("", "expects a size such as 8GiB"),
])
def test_sizes_that_are_no_size_are_one_line_naming_the_flag(text, fragment):
    with pytest.raises(UserError, match=fragment) as caught:
        parse_size(text, "--device-memory")
    message = str(caught.value)
    assert message.startswith("--device-memory") and "\n" not in message and len(message) < 300


@pytest.mark.parametrize("text,line", [
    ("8G", "--budget 8G: say 8GB (10^9 bytes) or 8GiB (2^30 bytes); a one-letter unit is ambiguous"),
    ("1.5 t", "--budget 1.5 t: say 1.5TB (10^12 bytes) or 1.5TiB (2^40 bytes); a one-letter unit is ambiguous"),
    ("500M", "--budget 500M: say 500MB (10^6 bytes) or 500MiB (2^20 bytes); a one-letter unit is ambiguous"),
])
def test_a_one_letter_unit_is_asked_back_as_the_two_sizes_it_could_be(text, line):
    # It was the generic `--budget expects a size such as 8GiB, 16GB or 500MiB`, not saying why 8G was refused.
    with pytest.raises(UserError) as caught:
        parse_size(text, "--budget")
    assert str(caught.value) == line


def test_a_range_of_one_is_one_number():
    from gpipe_cli.units import number_range

    assert number_range(4, 4) == "4" and number_range(4, 7) == "4-7"


def test_counts_past_a_billion_are_read_in_trillions():
    from gpipe_cli.units import human_count

    assert [human_count(n) for n in (8.7988e12, 2.5e9, 4.2e6, 999)] == ["8.80T", "2.50B", "4.20M", "999"]


def test_sizes_are_said_in_the_largest_unit_under_1024_up_to_the_largest_a_flag_takes():
    from gpipe_cli.units import human_bytes, parse_size

    # --budget 99999EiB was said as '104856551424.0 TiB'.
    assert human_bytes(parse_size("99999EiB", "--budget")) == "97.7 ZiB"
    assert human_bytes(parse_size("1024EiB", "--budget")) == "1.0 ZiB" and human_bytes(2**80) == "1.0 YiB"
    assert human_bytes(2**90) == "1024.0 YiB"  # beyond any flag: the largest unit, not a larger
    assert [human_bytes(n) for n in (0, 1023, 1024, 9 * 2**20, 5 * 2**40, 3 * 2**50, None)] == [
        "0 B", "1023 B", "1.0 KiB", "9.0 MiB", "5.0 TiB", "3.0 PiB", "-"]


def test_a_size_a_budget_is_named_from_is_rounded_up_and_typed_as_a_flag_takes_it():
    from gpipe_cli.units import human_bytes, parse_size, size_flag

    # plan said 'needs 901.8MiB per device' where every other size reads '901.8 MiB'.
    need = 901.71 * 2**20
    assert human_bytes(need) == "901.7 MiB" and human_bytes(need, up=True) == "901.8 MiB"
    assert size_flag(need) == "901.8MiB" and parse_size(size_flag(need), "--device-memory") >= need
    assert human_bytes(9 * 2**20, up=True) == "9.0 MiB" and human_bytes(1.2, up=True) == "2 B"


def test_a_count_of_one_is_said_in_the_singular():
    from gpipe_cli.models import families
    from gpipe_cli.units import counted

    assert (counted(1, "device"), counted(8, "device"), counted(0, "device")) == ("1 device", "8 devices", "0 devices")
    assert counted(1, "micro-batch", "micro-batches") == "1 micro-batch"
    assert counted(4, "batch", "batches") == "4 batches"
    # A recipe of model.layers 1 was announced as "Transformer encoder-decoder with 1 layers".
    title = families.of("transformer").title({"arch": "encoder-decoder", "layers": 1, "d_model": 32}, False)
    assert title == "Transformer encoder-decoder with 1 layer, d_model 32"


def test_a_count_of_exactly_a_thousand_is_said_in_the_larger_unit():
    from gpipe_cli.units import human_count

    # At exactly 1000 (or a million, ...) the count was said as the number itself, or in the smaller unit.
    assert [human_count(n) for n in (1e3, 1e6, 1e9, 1e12)] == ["1.00K", "1.00M", "1.00B", "1.00T"]


def test_a_share_between_a_tenth_and_one_percent_keeps_one_decimal():
    from gpipe_cli.units import share

    # Shares from 0.1% to 1% were said with two significant digits ("0.12%") where every other share has one decimal.
    assert [share(f) for f in (0.00123, 0.0056, 0.5)] == ["0.1%", "0.6%", "50.0%"]
    assert share(0.000123) == "0.012%"  # under 0.1%: two significant digits


def test_a_bound_is_inclusive_at_both_ends():
    from gpipe_cli.limits import outside

    # The largest value a range names (`<= 65536`) was itself refused.
    assert outside("--threads", 1024, 1, 1024) is None and outside("--threads", 1, 1, 1024) is None
    assert outside("--threads", 1025, 1, 1024) == "--threads: must be >= 1 and <= 1024 (got 1025)"
