"""The built docs site as a reader gets it: code lines that wrap only with a hanging indent, tables
and charts that fit a phone, a navigation whose entries are unique, no blank text cell, no
placeholder text, reference pages split so that a name is found without scrolling through the
whole API.

One ``mkdocs build --strict`` into a temporary directory (module scope), then checks on its HTML
and CSS. What a browser shows was checked by hand with headless Chromium at 1400 and 390 px; the
rules that caused what it showed are what these tests pin down.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")

ROOT = Path(__file__).resolve().parent.parent

# A placeholder left in a page: ALL_CAPS_WITH_UNDERSCORES (EXAMPLE_RESULT) or a marker word, in
# the text a reader sees (code is left out: environment variables are written in code spans).
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]*[A-Z0-9]\b|\b(?:TODO|TBD|FIXME|XXX)\b|(?i:lorem ipsum)")
KNOWN_NAMES = {"CAP_NET_ADMIN"}  # a Linux capability, named in prose on the multi-node page
WRAPPING = re.compile(
    r"white-space\s*:\s*(?:pre-wrap|pre-line|normal|break-spaces)|overflow-wrap\s*:\s*anywhere|word-break\s*:\s*break-all"
)
MAX_OBJECTS_PER_REFERENCE_PAGE = 30  # the API reference was one page of 103 (84,700 px tall at 1400 px)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _pages(site: Path) -> list[tuple[str, str]]:
    """Every page's article (the content, without the theme's navigation), by its path in the site."""
    out = []
    for path in sorted(site.rglob("index.html")):
        m = re.search(r'<article class="md-content__inner md-typeset">(.*?)</article>', path.read_text(), re.DOTALL)
        if m:
            relative = path.parent.relative_to(site)
            out.append(("home" if relative == Path(".") else str(relative), m.group(1)))
    return out


def _rules(css: str) -> list[tuple[str, str]]:
    """``(selector, declarations)`` of every rule in ``css``, at-rules' bodies included."""
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.DOTALL)
    css = re.sub(r"@media[^{]*\{", "", css)  # flatten media queries: their rules count the same
    return [(sel.strip(), body) for sel, body in re.findall(r"([^{}]+)\{([^{}]*)\}", css)]


def _is_code_block(selector: str) -> bool:
    return any(re.search(r"(^|[\s>+~,.:(])(pre|highlight|highlighttable)\b", part.strip()) for part in selector.split(","))


LINE_SPAN = re.compile(r"span\.code-line\b")


def _hanging(selector: str, body: str) -> bool:
    """A rule on the per-line spans of code blocks whose wrapped lines continue right of the line's
    own indentation (docs/hooks.py's --i), never at column 0."""
    indent = re.search(r"text-indent\s*:([^;]*)", body)
    pad = re.search(r"padding-left\s*:([^;]*)", body)
    return bool(
        LINE_SPAN.search(selector) and indent and pad and "var(--i" in indent.group(1) and "-" in indent.group(1)
        and "var(--i" in pad.group(1)
    )  # fmt: skip


def test_code_blocks_wrap_only_with_a_hanging_indent(site: Path) -> None:
    """A rule of extra.css once set white-space: pre-wrap on every code block: loops wrapped with
    their continuation lines at column 0 (other indentation, to a reader), commands broke inside a
    flag. Lines that do not fit now wrap only per line, with a hanging indent, at spaces."""
    offending = []
    for css in [site / "stylesheets" / "extra.css"]:
        for selector, body in _rules(css.read_text()):
            if _is_code_block(selector) and WRAPPING.search(body) and not _hanging(selector, body):
                offending.append(f"{css.name}: {selector} {{{body.strip()}}}")
            if LINE_SPAN.search(selector) and re.search(r"word-break\s*:\s*break-all|overflow-wrap\s*:\s*anywhere", body):
                offending.append(f"{css.name}: {selector} breaks inside words")
    assert not offending, "code blocks must never wrap to column 0:\n" + "\n".join(offending)
    # The copy button copies innerText while the code carries data-md-copying: lines as blocks would
    # come out each followed by an empty line.
    copying = [body for selector, body in _rules((site / "stylesheets" / "extra.css").read_text()) if "data-md-copying" in selector]
    assert any(re.search(r"display\s*:\s*inline\s*;", body) for body in copying), "the lines must copy as they are"
    for page, article in _pages(site):
        styled = re.findall(r'<(?:pre|code)\b[^>]*style="[^"]*white-space[^"]*"', article)
        assert not styled, f"{page}: a code block with its own white-space: {styled[0]}"
    # Every line of every code block carries its indentation, which the hanging indent starts from.
    pages = dict(_pages(site))
    lines = re.findall(r'<span class="code-line"( style="--i:(\d+)")?>(.*?)\n</span>', pages["home"])
    assert len(lines) > 40 and all(style for style, _, _ in lines), "line spans without --i"
    for _, indent, body in lines:
        text = html.unescape(re.sub(r"<[^>]+>", "", body))
        assert int(indent) == len(text) - len(text.lstrip(" ")), (indent, text)
    assert any(int(i) == 8 for _, i, _ in lines), "the loop's body is indented twice"


def test_the_check_catches_the_rule_that_wrapped_every_block() -> None:
    # The rule this project shipped: it would fail the test above.
    old = '.md-typeset div.highlight:not([class*="language-"]) pre > code {\n  white-space: pre-wrap;\n}'
    ((selector, body),) = _rules(old)
    assert _is_code_block(selector) and WRAPPING.search(body) and not _hanging(selector, body)
    # Per-line wrapping without the indentation, or with a fixed one, is caught too.
    fixed = ".md-typeset pre > code > span.code-line { white-space: pre-wrap; padding-left: 4ch; text-indent: -4ch; }"
    ((selector, body),) = _rules(fixed)
    assert _is_code_block(selector) and WRAPPING.search(body) and not _hanging(selector, body)
    # Inline code in tables is not a code block (it may wrap at the <wbr> that docs/hooks.py adds).
    ((selector, body),) = _rules(".md-typeset table:not([class]) code { word-break: normal; }")
    assert not _is_code_block(selector)


def test_tables_and_charts_fit_a_phone(site: Path) -> None:
    """At 390 px the benchmark tables and charts were cut at the right edge: each cell now carries its
    column's heading (a phone shows a row as a card of "heading: value" lines), and no rule gives a
    chart a width of its own beyond the screen's."""
    unlabelled = []
    for page, article in _pages(site):
        for table in re.findall(r"<table>(.*?)</table>", article, re.DOTALL):
            if "<th" in table:
                unlabelled += [f"{page}: {td[:60]}" for td in re.findall(r"<td\b(?![^>]*data-label=)[^>]*>", table)]
                # The heading and the content are the two items of the cell's grid: one wrapper.
                unlabelled += [f"{page}: {td[:60]} unwrapped" for td in re.findall(r"<td\b[^>]*>(?!<div class=\"cell\">)", table)]
    assert not unlabelled, "cells without their column's heading:\n" + "\n".join(unlabelled[:10])
    css = (site / "stylesheets" / "extra.css").read_text()
    rules = _rules(css)
    for selector, body in rules:
        if "full-size" in selector and "img" in selector:
            assert not re.search(r"max-width\s*:\s*none|(?<![-\w])width\s*:\s*\d", body), f"{selector} {{{body.strip()}}}"
    phone = css[css.index("@media screen and (max-width: 44.9375em)") :]
    assert re.search(r"td::before\s*\{[^}]*attr\(data-label\)", phone), "the phone layout shows each cell's heading"


def test_no_page_shows_a_placeholder(site: Path) -> None:
    found = []
    for page, article in _pages(site):
        visible = re.sub(r"<(pre|code|script|style)\b.*?</\1>", " ", article, flags=re.DOTALL)
        text = html.unescape(re.sub(r"<[^>]+>", " ", visible))
        found += [f"{page}: {m}" for m in PLACEHOLDER.findall(text) if m not in KNOWN_NAMES]
    assert not found, "placeholder text in the built site:\n" + "\n".join(found)


def test_the_placeholder_check_sees_the_one_that_shipped() -> None:
    assert PLACEHOLDER.findall("stops if it does not fit. EXAMPLE_RESULT") == ["EXAMPLE_RESULT"]


def test_reference_and_benchmarks_are_split_into_pages(site: Path) -> None:
    pages = dict(_pages(site))
    reference = {p: a for p, a in pages.items() if p.startswith("api/")}
    assert len(reference) >= 6, sorted(pages)
    for page, article in reference.items():
        objects = re.findall(r'<h[23] id="(fddp\.[\w.]+)"', article)
        assert len(objects) <= MAX_OBJECTS_PER_REFERENCE_PAGE, f"{page} documents {len(objects)} names: split it"
    # The index lists every page's names, linked.
    assert all(f'href="{p[4:]}/' in pages["api"] for p in reference), "api/ does not link every reference page"
    assert {p for p in pages if p.startswith("benchmarks/")} >= {"benchmarks/step", "benchmarks/zero", "benchmarks/cluster"}
    # Model-by-model tables are tabs, not one long scroll.
    assert pages["benchmarks/step"].count('class="tabbed-set') >= 1


def _nav_titles(entries: list, docs: Path) -> list[str]:
    """Every title the navigation shows, sections and pages, depth first (a bare page: its first heading)."""
    titles = []
    for entry in entries:
        if isinstance(entry, str):
            titles.append(re.search(r"^# (.*)$", (docs / entry).read_text(), re.MULTILINE).group(1))
            continue
        ((title, value),) = entry.items()
        titles.append(title)
        if isinstance(value, list):
            titles += _nav_titles(value, docs)
    return titles


def test_every_navigation_entry_is_unique() -> None:
    """The navigation once listed "Sharding (ZeRO)" three times (the guide, its reference, its
    benchmarks) and three other titles twice: a reader could not tell the entries apart."""
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"))
    titles = _nav_titles(config["nav"], Path(config["docs_dir"]))
    assert len(titles) > 20, titles
    repeated = sorted({t for t in titles if titles.count(t) > 1})
    assert not repeated, f"navigation titles shown more than once: {repeated}"


def _tables(article: str) -> list[tuple[list[str], list[str], list[list[str]]]]:
    """Every table of a page: its header cells' text, each column's alignment, and its rows' cells (HTML)."""
    out = []
    for table in re.findall(r"<table>(.*?)</table>", article, re.DOTALL):
        heads = re.findall(r"<th\b([^>]*)>(.*?)</th>", table, re.DOTALL)
        header = [html.unescape(re.sub(r"<[^>]+>", "", h)).strip() for _, h in heads]
        align = ["right" if "right" in attrs else "left" for attrs, _ in heads]
        body = table.split("</thead>", 1)[-1]
        rows = [re.findall(r"<td\b[^>]*>(.*?)</td>", tr, re.DOTALL) for tr in re.findall(r"<tr>(.*?)</tr>", body, re.DOTALL)]
        out.append((header, align, rows))
    return out


def test_no_table_has_a_blank_cell(site: Path) -> None:
    """A blank cell reads as data the page lost: the step benchmark's page showed two modes with
    nothing under "what runs", and 131 number cells on the across-hosts, ZeRO and low-communication
    pages were blank where a measurement did not apply or was not made. Such a cell says so ("—",
    with the table saying what it means)."""
    blank = []
    for page, article in _pages(site):
        for header, _, rows in _tables(article):
            for row in rows:
                for k, cell in enumerate(row):
                    if not re.sub(r"<[^>]+>|&nbsp;|\s", "", cell):
                        column = header[k] if k < len(header) else k
                        blank.append(f"{page}: column {column!r} of the row {re.sub(r'<[^>]+>', '', row[0]).strip()!r}")
    assert not blank, f"{len(blank)} blank cells:\n" + "\n".join(blank[:20])


def test_the_sidebar_shows_each_entry_once(site: Path) -> None:
    """With toc.integrate a page's headings are listed in the sidebar under its entry: the API index's
    headings (one per reference page) and the benchmarks summary's "Across hosts" showed beside the
    navigation's own entries of the same names."""
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"))
    titles = set(_nav_titles(config["nav"], Path(config["docs_dir"])))
    twice = []
    for page, article in _pages(site):
        for level, text in re.findall(r"<h([23])\b[^>]*>(.*?)</h\1>", article, re.DOTALL):
            heading = html.unescape(re.sub(r"<[^>]+>|¶", "", text)).strip()
            if heading in titles:
                twice.append(f"{page}: h{level} {heading!r}")
    assert not twice, "headings that repeat a navigation entry in the sidebar:\n" + "\n".join(twice)


def test_columns_scroll_and_flags_do_not_break(site: Path) -> None:
    """On a phone the design page's data-flow diagram wrapped out of line, and its Sync block, whose
    comments stand in a right-hand column, wrapped one character a line (3,700 px of blank grey):
    a block laid out in columns scrolls instead. A command's flag broke after its hyphens
    (`--nproc-per-` / `node=2`): hyphenated words of inline code stay whole."""
    css = (site / "stylesheets" / "extra.css").read_text()
    assert any(
        "span.code-line.columns" in sel and re.search(r"white-space\s*:\s*pre\s*;", body) and re.search(r"text-indent\s*:\s*0", body)
        for sel, body in _rules(css)
    ), "no rule keeps a block in columns unwrapped"
    assert any("code .nobr" in sel and "nowrap" in body for sel, body in _rules(css)), "no rule keeps a flag whole"
    design = dict(_pages(site))["design"]
    blocks = re.findall(r"<pre\b.*?</pre>", design, re.DOTALL)
    diagram = next(b for b in blocks if "──►" in b or "&#9472;" in b or "functionalize" in b)
    sync = next(b for b in blocks if "sync.announce" in b)
    for block in (diagram, sync):
        lines = re.findall(r'<span class="([^"]*)" style="--i:', block)
        assert lines and all("columns" in c.split() for c in lines), lines[:3]
    prose = re.sub(r"<pre\b.*?</pre>", "", "".join(a for _, a in _pages(site)), flags=re.DOTALL)
    unprotected = [re.sub(r'<span class="nobr">.*?</span>', "", c) for c in re.findall(r"<code>(.*?)</code>", prose, re.DOTALL)]
    broken = [c for c in unprotected if re.search(r'(?<![\w"-])--\w+-\w', c)]
    assert not broken, f"flags that may break at a hyphen: {broken[:5]}"
    assert "--nproc-per-node" in prose


def test_every_step_benchmark_mode_has_a_chart_label_and_a_description() -> None:
    """benchmarks/step.py's chart labels a mode by its snake_case name, and the docs' table leaves
    its "what runs" blank, unless both say what it runs."""
    import importlib.util

    source = (ROOT / "benchmarks" / "step.py").read_text()
    modes = set(re.findall(r'^\s+modes\["(\w+)"\] =', source, re.MULTILINE))
    assert {"ddp", "grad_and_value", "grad_and_value_noagree", "compiled"} <= modes, modes

    def load(name: str, path: Path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    step = load("step_benchmark", ROOT / "benchmarks" / "step.py")
    hooks = load("docs_hooks", ROOT / "docs" / "hooks.py")
    assert modes <= set(step.PLOT_MODES), sorted(modes - set(step.PLOT_MODES))
    assert modes <= set(hooks.STEP_MODES), sorted(modes - set(hooks.STEP_MODES))
    for mode, (label, _) in step.PLOT_MODES.items():
        assert label.strip() != mode, f"{mode}: the chart's label is the mode's name"
