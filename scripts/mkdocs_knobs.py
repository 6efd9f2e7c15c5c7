"""MkDocs hook: the knob reference, rendered from hvdlite's knob table when the site is built.

hvdlite declares every environment knob once, in ``KNOBS`` (``hvdlite/common/config.py``). A
page holds a marker line where a table generated from it goes: :data:`KNOB_TABLE` (every knob:
``docs/knobs.md``) or :data:`FLAG_TABLE` (the ``hvdlite run`` flags that set knobs:
``docs/launcher.md``). The knobs page must hold its marker, so the table cannot silently go
missing. The table's module is loaded on its own from its file, as the rest of the docs build
reads the source: no hvdlite package, framework or MPI is imported.
Loaded by mkdocs.yml (hooks).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

CONFIG_PY = Path(__file__).resolve().parent.parent / "hvdlite" / "common" / "config.py"
KNOB_TABLE = "<!-- knob table: generated from KNOBS in hvdlite/common/config.py -->"
FLAG_TABLE = "<!-- knob flag table: generated from KNOBS in hvdlite/common/config.py -->"
REQUIRED = {"knobs.md": KNOB_TABLE, "launcher.md": FLAG_TABLE}
_MODULE = "hvdlite_knob_table"


def load_config() -> ModuleType:
    """``hvdlite/common/config.py`` as a standalone module (it imports only the standard
    library and ``hvdlite/common/knob_kinds.py``, loaded here the same way first)."""
    kinds = "hvdlite.common.knob_kinds"
    loaded = []
    try:
        for name, path in ((kinds, CONFIG_PY.with_name("knob_kinds.py")), (_MODULE, CONFIG_PY)):
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            # dataclasses look their module up while the file runs; config's import of the
            # kinds finds them here without importing the hvdlite package
            sys.modules[name] = module
            loaded.append(name)
            spec.loader.exec_module(module)
    finally:
        for name in loaded:
            sys.modules.pop(name, None)
    return module


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(knob) -> str:
    value = knob.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{int(value)}`"
    if isinstance(value, (int, float)):
        shown = f"`{value:g}`" if isinstance(value, float) else f"`{value}`"
        if knob.unit == "bytes" and value >= 2**20:
            shown += f" ({value / 2**20:g} MiB)"
        return shown
    return f"`{value}`"


def _value(knob) -> str:
    return f"{knob.kind.type_name}, {knob.unit}" if knob.unit else knob.kind.type_name


def _meaning(knob) -> str:
    return f"{knob.help}. {knob.details}" if knob.details else knob.help


def _spellings(flag) -> str:
    shown = [f"`{spelling} {flag.metavar}`" if flag.metavar else f"`{spelling}`"
             for spelling in flag.spellings]
    return shown[0] + (f" ({', '.join(shown[1:])})" if shown[1:] else "")


def _flags(knob) -> str:
    """The flags that set ``knob`` and what each exports."""
    parts = []
    for flag in knob.flags:
        if flag.sets is not None:
            parts.append(f"{_spellings(flag)}: `{flag.sets}`")
        elif flag.conversion.text:
            parts.append(f"{_spellings(flag)}: {flag.conversion.text}")
        else:
            parts.append(_spellings(flag))
    return "; ".join(parts)


def knob_table(config: ModuleType) -> str:
    """Every knob of the table, as a Markdown table."""
    lines = ["| variable | value | default | meaning | whose value | in Horovod | "
             "`hvdlite run` flag |", "|---|---|---|---|---|---|---|"]
    for knob in config.KNOBS:
        lines.append("| " + " | ".join(_cell(text) for text in (
            f"`{knob.variable}`", _value(knob), _default(knob), _meaning(knob), knob.agree,
            knob.horovod, _flags(knob))) + " |")
    return "\n".join(lines)


def flag_table(config: ModuleType) -> str:
    """The ``hvdlite run`` flags that set knobs, as a Markdown table."""
    lines = ["| flag | exports |", "|---|---|"]
    for knob in config.KNOBS:
        for flag in knob.flags:
            if flag.sets is not None:
                sets = f"`{knob.variable}={flag.sets}`"
            else:
                how = flag.conversion.text
                sets = f"`{knob.variable}`" + (f" = {how}" if how else "")
            lines.append(f"| {_cell(_spellings(flag))} | {_cell(sets)} |")
    return "\n".join(lines)


def render(markdown: str, config: ModuleType | None = None) -> str:
    """``markdown`` with each marker line replaced by its table."""
    if KNOB_TABLE not in markdown and FLAG_TABLE not in markdown:
        return markdown
    config = config or load_config()
    return (markdown.replace(KNOB_TABLE, knob_table(config))
            .replace(FLAG_TABLE, flag_table(config)))


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    """MkDocs hook: fill in the tables; a page that should hold one and lacks its marker stops
    the build."""
    required = REQUIRED.get(page.file.src_uri)
    if required is not None and required not in markdown:
        from mkdocs.exceptions import PluginError
        raise PluginError(f"docs/{page.file.src_uri} lost its generated-table marker line "
                          f"{required!r} (see scripts/mkdocs_knobs.py)")
    return render(markdown)
