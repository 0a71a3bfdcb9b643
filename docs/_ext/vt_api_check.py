"""Sphinx extension: every entry of the API reference has a description.

autodoc lists a module's public names (its ``__all__``), and the fields of dataclasses and
enums, whether or not they have a docstring -- and a name without one becomes a bare
signature that tells the reader nothing.  After an HTML build this extension reads every
page under ``api/`` and warns, naming the object, for each entry whose description is
empty; the docs build runs with ``-W``, so an undocumented public name fails the build
instead of slipping into the reference.

Describe a dataclass field or an enum member with a ``#:`` comment (autodoc reads it as the
attribute's docstring); a function, class, method or property with a docstring.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

from sphinx.util import logging

logger = logging.getLogger(__name__)

# One autodoc entry: the signature line (<dt ... id="name">) and its description (<dd>).
# Descriptions nest (a class's <dd> holds its members' <dl>s), so only the text *before* the
# first nested entry counts as this entry's own description.
_ENTRY = re.compile(r'<dt class="sig sig-object py" id="(?P<name>[^"]+)">.*?</dt>\s*<dd>(?P<body>.*?)(?:<dl |</dd>)',
                    re.S)
_TAG = re.compile(r"<[^>]+>")


def undocumented_entries(page: str) -> list[str]:
    """The ids of the entries on one HTML page whose own description is empty."""
    return [m["name"] for m in _ENTRY.finditer(page) if not html.unescape(_TAG.sub("", m["body"])).strip()]


def _check_built_pages(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    for page in sorted(Path(app.outdir, "api").glob("*.html")):
        for name in undocumented_entries(page.read_text(encoding="utf-8")):
            logger.warning("API reference (%s): %s has no description (add a docstring, or a #: comment "
                           "for a field)", page.name, name, type="vt_api_check", subtype="undocumented")


def setup(app):
    app.connect("build-finished", _check_built_pages)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
