"""A griffe extension for the API reference: read ``Example:`` as a Google "Examples" section.

fddp's docstrings head their doctest blocks ``Example:`` (singular). Griffe's Google parser knows
only ``Examples:`` and would render the singular as an admonition of plain text, turning ``>>>``
into nested quotes; this renames the heading before the docstring is parsed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _HEADING.sub(r"\1Examples:", obj.docstring.value)
