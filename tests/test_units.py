import pytest

from gpipe_cli.errors import UserError
from gpipe_cli.units import parse_size


@pytest.mark.parametrize("text,expected", [("8GiB", 8 << 30), ("500MiB", 500 << 20), ("16GB", 16 * 10**9),
                                           ("1024", 1024), (" 1.5 KiB ", 1536)])
def test_sizes_in_the_units_users_type(text, expected):
    assert parse_size(text, "--budget") == expected


@pytest.mark.parametrize("text,fragment", [
    ("1" + "0" * 400 + "GiB", "at most 1 YiB"),  # infinity as a float: no traceback
    ("1" + "0" * 30, "at most 1 YiB"),
    ("1e3", "expects a size such as 8GiB"),
    ("eight", "expects a size such as 8GiB"),
])
def test_sizes_that_are_no_size_are_one_line_naming_the_flag(text, fragment):
    with pytest.raises(UserError, match=fragment) as caught:
        parse_size(text, "--device-memory")
    message = str(caught.value)
    assert message.startswith("--device-memory") and "\n" not in message and len(message) < 300
