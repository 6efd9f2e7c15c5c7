"""Griffe extension for the docs build: show reST roles in docstrings as code.

hvdlite's docstrings use Sphinx roles (``:func:`allreduce_async```, ``:mod:`.launch```) and reST's
``text::`` before a literal block. mkdocstrings renders docstrings as Markdown, where those would
show as literal ``:func:`` text, so this extension rewrites them to plain code spans and a plain
colon when griffe loads the source. Nothing else in a docstring changes; the library is untouched.
Loaded by mkdocs.yml (plugins -> mkdocstrings -> python -> options -> extensions).
"""
from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const):`~?\.?([^`]+)`")
_LITERAL_INTRO = re.compile(r"(?<=\S)::[ \t]*$", re.M)


def rewrite(text: str) -> str:
    """``:func:`x``` -> ```x```, and a reST ``intro::`` line -> ``intro:``."""
    return _LITERAL_INTRO.sub(":", _ROLE.sub(r"`\1`", text))


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring griffe loads (see :func:`rewrite`)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
