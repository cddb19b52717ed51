"""What text that fits a terminal of a given width looks like: the checks the width tests share."""

from __future__ import annotations

import re

from gpipe_cli.console import UNITS

_ALONE = re.compile(r"^\W*(?:" + "|".join(re.escape(u) for u in UNITS) + r")\W*$")
_RANGE = re.compile(r"(?<![\w.-])(\d+)-(\1)(?![\w.-])")


def problems(text: str, width: int, words: str = "") -> list[str]:
    """Why `text` does not read well at `width` columns: lines too long, cut entries ('…'), a unit alone on
    a line, a range such as 4-4, or a word of `words` (the whole text as written) broken across two lines."""
    found = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        bare = line.strip(" │╭╮╰╯─")
        if len(line.rstrip()) > width:
            found.append(f"longer than {width}: {line!r}")
        if "…" in line:
            found.append(f"cut: {line!r}")
        if _ALONE.match(bare):
            found.append(f"a unit alone: {line!r} (after {lines[i - 1] if i else ''!r})")
        if _RANGE.search(line):
            found.append(f"a range of one as N-N: {line!r}")
    if words:
        whole = set(re.findall(r"[\w/.%-]+", words))
        for above, below in zip(lines, lines[1:]):
            left = re.search(r"([\w/.%-]+)\s*│?\s*$", above)
            right = re.match(r"[\s│]*([\w/.%-]+)", below)
            if left and right and left.group(1) + right.group(1) in whole and left.group(1) not in whole:
                found.append(f"a word broken: {left.group(1)!r} + {right.group(1)!r}")
    return found
