"""English text that every Python installation carries: the documentation topics of `pydoc_data`."""

from __future__ import annotations

import re

from gpipe_cli.errors import DataError

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


def pydoc_documents() -> list[str]:
    """The paragraphs of every pydoc topic, in a fixed order (topics sorted by name), line breaks kept."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions split the documentation off the interpreter
        raise DataError("data.source 'pydoc' needs the standard library's pydoc_data module, which this "
                        "Python lacks; install the Python documentation package or use data.source: text") from None
    return [p.strip("\n") for name in sorted(topics) for p in _PARAGRAPH_BREAK.split(topics[name]) if p.strip()]
