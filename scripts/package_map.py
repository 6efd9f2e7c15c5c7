"""The package map in docs/how-it-works.md, generated from the tree: one row per package and
module, from the first sentence of its docstring, so the map cannot drift from the code.

    python scripts/package_map.py           # print the map
    python scripts/package_map.py --write   # rewrite the block in docs/how-it-works.md
    python scripts/package_map.py --check   # exit 1 if the block is out of date (tests do this)

Reads docstrings with :mod:`ast` (nothing is imported, so no framework needs to be installed).
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "hvdlite"
DOC = REPO / "docs" / "how-it-works.md"
START, END = "<!-- package-map:start -->", "<!-- package-map:end -->"


def summary(path: Path) -> str:
    """The first sentence of the module's docstring, reST markup dropped (empty if it has
    none)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    paragraph = re.sub(r":\w+:`~?([^`]+)`", r"\1", paragraph).replace("``", "`")
    sentence = re.split(r"(?<=\.)\s(?=[A-Z`(])", paragraph, maxsplit=1)[0]
    return sentence.rstrip(":.").replace("|", "\\|")


def package_rows(directory: Path) -> list[str]:
    """Table rows for the package ``directory`` (described by its ``__init__.py``), its
    modules, then its sub-packages, each in name order."""
    where = directory.relative_to(REPO).as_posix()
    rows = [f"| **`{where}/`** | **{summary(directory / '__init__.py')}** |"]
    for module in sorted(p for p in directory.glob("*.py") if p.name != "__init__.py"):
        rows.append(f"| `{where}/{module.name}` | {summary(module)} |")
    for sub in sorted(p for p in directory.iterdir()
                      if p.is_dir() and (p / "__init__.py").exists()):
        rows.extend(package_rows(sub))
    return rows


def render() -> str:
    return "\n".join([START, "", "| package / module | what it is |", "|---|---|",
                      *package_rows(PACKAGE), "", END])


def current_block(text: str) -> str:
    start, end = text.index(START), text.index(END) + len(END)
    return text[start:end]


def main(argv: list[str]) -> int:
    block = render()
    if not argv:
        print(block)
        return 0
    text = DOC.read_text(encoding="utf-8")
    if argv == ["--check"]:
        if current_block(text) == block:
            return 0
        print(f"{DOC.relative_to(REPO)}: the package map is out of date; run "
              f"`python scripts/package_map.py --write`", file=sys.stderr)
        return 1
    if argv == ["--write"]:
        DOC.write_text(text.replace(current_block(text), block), encoding="utf-8")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
