"""The documentation site builds in strict mode, and the README's links lead somewhere.

``mkdocs build --strict`` (see mkdocs.yml) fails on any warning: a link to a missing page, an
anchor that does not exist, a docstring griffe cannot parse. The build reads the source
statically, so it needs neither MPI nor a framework. The docs tools come with the ``docs`` extra,
which ``scripts/bootstrap.sh`` installs; without mkdocs the build tests are skipped, saying so.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BUILD_TIMEOUT = 300
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _page_html(site: Path, md_path: str) -> Path:
    """The built HTML of ``docs/<md_path>`` under mkdocs' directory URLs."""
    stem = md_path[:-len(".md")]
    if stem == "index" or stem.endswith("/index"):
        return site / stem[:-len("index")] / "index.html"
    return site / stem / "index.html"


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """Build the site once into a temporary directory with ``--strict``."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed in this environment: pip install -e '.[docs]' "
                    "(scripts/bootstrap.sh installs it)")
    out = tmp_path_factory.mktemp("docs") / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")   # the Material theme's notice, not ours
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    return proc, out


@pytest.fixture
def site(build) -> Path:
    """The built site, for the tests that read it (the build's own failure is reported once, by
    test_docs_build_strict)."""
    proc, out = build
    if proc.returncode != 0:
        pytest.skip("the site did not build: see test_docs_build_strict")
    return out


def test_docs_build_strict(build):
    proc, out = build
    assert proc.returncode == 0, (f"mkdocs build --strict failed (exit {proc.returncode}):\n"
                                  f"{proc.stdout[-6000:]}\n{proc.stderr[-10000:]}")
    assert (out / "index.html").is_file()
    assert (out / "reference" / "torch" / "index.html").is_file()


def _reference_identifiers() -> list[tuple[str, str]]:
    """``(page, identifier)`` for every ``::: identifier`` on the API reference pages."""
    found = []
    for page in sorted((DOCS / "reference").glob("*.md")):
        for line in page.read_text(encoding="utf-8").splitlines():
            if line.startswith("::: "):
                found.append((f"reference/{page.name}", line[4:].strip()))
    return found


# The modules whose names the reference may show: the modules behind them (hvdlite.common.*,
# hvdlite.torch.mpi_ops, ...) are internal and will move.
PUBLIC_MODULES = ("hvdlite", "hvdlite.torch", "hvdlite.tensorflow", "hvdlite.tensorflow.keras",
                  "hvdlite.tensorflow.keras.callbacks", "hvdlite.keras", "hvdlite.runner",
                  "hvdlite.torch.elastic", "hvdlite.tensorflow.elastic",
                  "hvdlite.tensorflow.keras.elastic", "hvdlite.keras.elastic", "hvdlite.ray",
                  "hvdlite.spark", "hvdlite.spark.torch", "hvdlite.spark.keras", "hvdlite.jax",
                  "hvdlite.jax.elastic")


def test_reference_names_are_public():
    """Every object on the reference pages is named by a public module's path."""
    listed = _reference_identifiers()
    assert len(listed) > 100, listed
    internal = [f"{page}: {ident}" for page, ident in listed
                if ident not in PUBLIC_MODULES and ident.rpartition(".")[0] not in PUBLIC_MODULES]
    assert not internal, "reference pages name internal paths:\n" + "\n".join(internal)


def _readme_links() -> list[tuple[str, str]]:
    """``(path, anchor)`` of every relative link in README.md."""
    links = []
    for target in _LINK.findall((ROOT / "README.md").read_text(encoding="utf-8")):
        if not re.match(r"[a-z]+:", target):   # skip https:, mailto:
            path, _, anchor = target.partition("#")
            links.append((path, anchor))
    return links


def test_readme_links_name_existing_files():
    """The README is not part of the site, so mkdocs does not check it; on GitHub its relative
    links must name files that exist."""
    links = _readme_links()
    assert any(path.startswith("docs/") for path, _ in links), links
    broken = [path for path, _ in links if path and not (ROOT / path).exists()]
    assert not broken, f"README links to missing files: {broken}"


def test_readme_anchors_exist(site):
    """Anchors the README links to in docs/ pages exist (in the built pages: mkdocs' heading
    ids, which match GitHub's for the headings linked to)."""
    broken = []
    for path, anchor in _readme_links():
        if anchor and path.startswith("docs/") and path.endswith(".md"):
            html = _page_html(site, path[len("docs/"):]).read_text(encoding="utf-8")
            if f'id="{anchor}"' not in html:
                broken.append(f"{path}#{anchor}")
    assert not broken, f"README links to missing anchors: {broken}"


# --- the generated knob reference (scripts/mkdocs_knobs.py) -----------------------------------
def _knob_hook():
    """scripts/mkdocs_knobs.py and the knob table it loads (as the docs build does)."""
    spec = importlib.util.spec_from_file_location("mkdocs_knobs_under_test",
                                                  ROOT / "scripts" / "mkdocs_knobs.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook, hook.load_config()


def test_knob_pages_hold_their_table_markers():
    hook, _ = _knob_hook()
    for page, marker in hook.REQUIRED.items():
        assert (DOCS / page).read_text(encoding="utf-8").count(marker) == 1, page


def test_generated_knob_table_lists_every_knob_and_flag():
    hook, config = _knob_hook()
    table = hook.knob_table(config)
    rows = table.splitlines()[2:]
    assert len(rows) == len(config.KNOBS)
    for knob, row in zip(config.KNOBS, rows):
        assert row.startswith(f"| `{knob.variable}` |"), row
        assert knob.help in row and knob.agree in row and row.count(" | ") == 6, row
        for flag in knob.flags:
            assert all(f"`{s}" in row for s in flag.spellings), row
    flags = hook.flag_table(config)
    for knob in config.KNOBS:
        for flag in knob.flags:
            assert all(f"`{s}" in flags for s in flag.spellings), flag


def test_hook_stops_the_build_when_a_marker_is_gone():
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed in this environment")
    from types import SimpleNamespace

    from mkdocs.exceptions import PluginError
    hook, _ = _knob_hook()
    page = SimpleNamespace(file=SimpleNamespace(src_uri="knobs.md"))
    with pytest.raises(PluginError, match="marker"):
        hook.on_page_markdown("# Environment knobs\n\nno table\n", page)
    other = SimpleNamespace(file=SimpleNamespace(src_uri="index.md"))
    assert hook.on_page_markdown("plain\n", other) == "plain\n"


def test_built_knob_pages_show_every_knob(site):
    _, config = _knob_hook()
    knobs = _page_html(site, "knobs.md").read_text(encoding="utf-8")
    launcher = _page_html(site, "launcher.md").read_text(encoding="utf-8")
    assert "<!-- knob" not in knobs and "<!-- knob" not in launcher
    for knob in config.KNOBS:
        assert f"<code>{knob.variable}</code>" in knobs, knob.variable
        for flag in knob.flags:
            assert f"<code>{flag.spellings[0]}" in knobs
            assert f"<code>{flag.spellings[0]}" in launcher


def test_package_map_matches_the_tree():
    """docs/how-it-works.md's package map is what scripts/package_map.py generates from the
    tree: a module added, moved, removed or re-described without regenerating it fails here."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "package_map.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
