"""MkDocs hooks: put the benchmark results into the docs, and tidy Sphinx roles in docstrings.

The benchmark page holds a marker that is replaced at build time by tables made from
``benchmarks/results/*.json``; the charts next to them (``*.png``) are served from where the
benchmarks wrote them, so the page always shows the last measured numbers and never a stale copy.
"""

from __future__ import annotations

import html as _html
import json
import re
import statistics
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
# "<!-- benchmark-results -->" is every section; "<!-- benchmark-results: step floor -->" the ones named.
MARKER = re.compile(r"<!-- benchmark-results(?:: ([a-z0-9 ]+))? -->")
VALIDATION_MARKER = "<!-- scaling-validation -->"
PROJECTION_MARKER = "<!-- scaling-projection -->"
API_MARKER = "<!-- api-pages -->"
LINE_CLASS = "code-line"  # each line of a code block (docs/hooks.py's _code_lines; extra.css wraps it)
COLUMNS_CLASS = "columns"  # ... unless its block is laid out in columns: then it scrolls
COLUMNS = re.compile(r"^ {24}|[─│┌┐└┘├┤►▶◄→]")  # a line that continues a right-hand column, or a diagram's strokes

# What each mode of benchmarks/step.py runs (its docstring has the same list).
STEP_MODES = {
    "floor_torch": "module forward/backward + torch.optim, no communication",
    "floor_fddp": "`torch.func.grad` + `fddp.optim.apply_gradients`, no communication",
    "floor_gav": "`fddp.grad_and_value` over a one-rank group + `apply_gradients`: the `grad_and_value` floor",
    "ddp": "torch DDP + `torch.optim.SGD` (the reference)",
    "per_tensor": "`torch.func.grad` + one all-reduce per tensor",
    "ddp_step": "`torch.func.grad` + `fddp.ddp_step`",
    "ddp_step_bf16": "the same, buckets sent in bfloat16",
    "ddp_step_fp16": "the same, buckets sent in float16",
    "ddp_step_psgd1": "the same, PowerSGD rank 1, compressing from step 0",
    "ddp_step_psgd4": "the same, PowerSGD rank 4",
    "grad_and_value": "`fddp.grad_and_value` (all-reduces overlap the backward pass)",
    "grad_and_value_donated": "the same, params and state donated to `apply_gradients` (updated in place)",
    "grad_and_value_optax": "the same, the optax split: `opt.update` + `fddp.optim.apply_updates`",
    "grad_and_value_bf16": "`fddp.grad_and_value`, buckets sent in bfloat16 (cast in the copy into the bucket)",
    "grad_and_value_psgd1": "`fddp.grad_and_value`, PowerSGD rank 1 from step 0 (compressed as each bucket fills)",
    "grad_and_value_auto": "`fddp.grad_and_value`, bucket cap chosen by `fddp.scaling` from the measured link and timeline",
    "grad_and_value_bf16_auto": "the same with bf16 buckets",
    "grad_and_value_psgd1_auto": "the same with PowerSGD rank 1",
    "compiled": "`torch.compile` of `torch.func.grad` + `fddp.ddp_step` + `fddp.optim`",
    "grad_and_value_noagree": "`fddp.grad_and_value`, the per-call agreement off (`fddp.set_checks(agreement=False)`)",
    "ddp_step_noagree": "`fddp.ddp_step`, the per-call agreement off",
    "grad_and_value_lean": "`fddp.grad_and_value` without the error channel and the header's fingerprint",
    "ddp_step_lean": "`fddp.ddp_step` without the error channel and the header's fingerprint",
}


def on_files(files: Files, config: Any) -> Files:
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"results/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if page.file.src_uri == "api.md":
        return markdown.replace(API_MARKER, _api_pages(config)) + _undocumented_names(_api_sources(config))
    if VALIDATION_MARKER in markdown or PROJECTION_MARKER in markdown:
        return markdown.replace(VALIDATION_MARKER, _scaling_validation()).replace(PROJECTION_MARKER, _scaling_projection())
    m = MARKER.search(markdown)
    if m is None:
        return markdown
    names = m.group(1).split() if m.group(1) else list(SECTIONS)
    text = "\n\n".join(SECTIONS[name]() for name in names)
    if "/" in page.file.src_uri:  # a page under benchmarks/: the charts and the other pages are one directory up
        if not re.search(r"^# ", markdown, re.MULTILINE):  # its first section's heading is the page's title
            text = text.replace("## ", "# ", 1)
        text = re.sub(r"\]\((?!https?:|\.\./|#)([^)]+\.(?:md|png)(?:#[^)]*)?)\)", r"](../\1)", text)
    return markdown[: m.start()] + text + markdown[m.end() :]


def _api_sources(config: Any) -> str:
    """The reference pages' Markdown: api.md and every page under api/."""
    docs = Path(config["docs_dir"])
    return "\n".join(p.read_text() for p in [docs / "api.md", *sorted((docs / "api").glob("*.md"))])


def _api_pages(config: Any) -> str:
    """The index of the reference: each page of api/ (in the nav's order), its summary and its names."""
    docs = Path(config["docs_dir"])
    nav = next(item for item in config["nav"] if isinstance(item, dict) and "API reference" in item)["API reference"]
    lines = []
    for entry in nav:
        src = entry if isinstance(entry, str) else next(iter(entry.values()))
        if not src.startswith("api/"):
            continue
        text = (docs / src).read_text()
        title = re.search(r"^# (.*)$", text, re.MULTILINE).group(1)
        summary = text.split("\n\n")[1].strip()
        names = re.findall(r"^::: ([\w.]+)$", text, re.MULTILINE)
        shown = ", ".join(f"[`{n}`]({src}#{n})" for n in names)
        # A bold line, not a heading: with toc.integrate a heading would put every reference page in
        # the sidebar twice, once as this page's contents and once as the nav's own entry.
        lines.append(f"**[{title}]({src})**\n\n{summary}\n\n{shown}\n")
    return "\n".join(lines)


def _undocumented_names(markdown: str) -> str:
    """Return reference entries for the names in ``fddp.__all__`` that the reference pages do not list yet.

    A public name added to the package shows up in the reference even before someone places it
    in its section by hand.
    """
    import fddp

    listed = set(re.findall(r"^::: fddp\.([\w.]+)", markdown, re.MULTILINE))
    missing = [
        name
        for name in fddp.__all__
        if name not in listed and f"{name}.{name}" not in listed and not isinstance(getattr(fddp, name), type(fddp))
    ]
    if not missing:
        return ""
    return "\n\n## More\n\n" + "".join(f"::: fddp.{name}\n\n" for name in missing)


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    # Docstrings use Sphinx roles (:func:`ddp_step`); Markdown renders them as ":func:" + code.
    html = re.sub(r":(?:func|class|meth|mod|attr|exc|data|obj):(?=<code)", "", html)
    html = re.sub(r"<table>.*?</table>", _breakable_code, html, flags=re.DOTALL)
    html = re.sub(r"<table>.*?</table>", _labelled_cells, html, flags=re.DOTALL)
    html = _outside_pre(html, lambda text: re.sub(r"(<code>)((?:[^<]|<wbr>)*)(</code>)", _unbroken_flags, text))
    html = re.sub(r"(<pre\b[^>]*>(?:<span></span>)?<code\b[^>]*>)(.*?)(</code></pre>)", _code_lines, html, flags=re.DOTALL)
    return re.sub(r'<p><img alt="([^"]*)" src="([^"]+\.png)" ?/?></p>', _full_size_link, html)


def _outside_pre(html: str, change: Any) -> str:
    """``change`` applied to the page's HTML outside its ``<pre>`` blocks."""
    parts = re.split(r"(<pre\b.*?</pre>)", html, flags=re.DOTALL)
    return "".join(part if k % 2 else change(part) for k, part in enumerate(parts))


def _unbroken_flags(code: re.Match) -> str:
    """Keep each hyphenated word of inline code on one line: a browser may break after a hyphen, and
    ``--nproc-per-`` / ``node=2`` on two lines reads as two flags. The text is unchanged (a copy
    pastes as typed): the word only sits in a ``nowrap`` span (extra.css)."""
    words = re.sub(r"(?<![^\s])(\S*\w-\w\S*|--?\w\S*)", r'<span class="nobr">\1</span>', code.group(2))
    return code.group(1) + words + code.group(3)


def _code_lines(block: re.Match) -> str:
    """Put each line of a code block in a span of its own that carries its indentation as ``--i``,
    so that extra.css can wrap a line too long for the window with a hanging indent: the
    continuation starts four columns right of the line's own indentation, never at column 0,
    where it would read as another line. Highlighted tokens that run over several lines (a
    docstring) are closed at each line's end and opened again on the next."""
    lines, line, open_tags = [], [], []
    for piece in re.split(r"(<[^>]+>)", block.group(2)):
        if piece.startswith("</"):
            open_tags.pop()
            line.append(piece)
        elif piece.startswith("<"):
            open_tags.append(piece)
            line.append(piece)
        else:
            for k, text in enumerate(piece.split("\n")):
                if k:
                    lines.append("".join(line) + "".join(_closing(t) for t in reversed(open_tags)))
                    line = list(open_tags)
                line.append(text)
    last = "".join(line)
    if re.sub(r"<[^>]+>", "", last):
        lines.append(last)

    texts = [_html.unescape(re.sub(r"<[^>]+>", "", markup)) for markup in lines]
    # A block laid out in columns (a diagram; a column of comments continued on lines of their own)
    # is no longer aligned once wrapped, and the hanging indent of a line indented to its
    # right-hand column leaves a phone one character a line: its lines scroll sideways instead
    # (extra.css). Other blocks wrap, with the hanging indent.
    columns = any(COLUMNS.search(t.rstrip("\n")) for t in texts)
    css_class = f"{LINE_CLASS} {COLUMNS_CLASS}" if columns else LINE_CLASS

    def wrap(markup: str, text: str) -> str:
        return f'<span class="{css_class}" style="--i:{len(text) - len(text.lstrip(" "))}">{markup}\n</span>'

    return block.group(1) + "".join(wrap(markup, text) for markup, text in zip(lines, texts)) + block.group(3)


def _closing(tag: str) -> str:
    """``</span>`` for ``<span class="n">``."""
    return "</" + re.match(r"<(\w+)", tag).group(1) + ">"


def _labelled_cells(table: re.Match) -> str:
    """Give every cell its column's heading as ``data-label``, and its content one wrapper: on a phone
    extra.css lays each row out as a card of "heading: value" lines (a grid of the label and the
    wrapper), where a table of seven columns would be cut at the right edge."""
    heads = [_html.unescape(re.sub(r"<[^>]+>", "", h)).strip() for h in re.findall(r"<th\b[^>]*>(.*?)</th>", table.group(0), re.DOTALL)]

    def row(tr: re.Match) -> str:
        cells = iter(range(len(heads)))

        def cell(td: re.Match) -> str:
            k = next(cells, None)
            if k is None:
                return td.group(0)
            label = _html.escape(heads[k], quote=True)
            return f'<td data-label="{label}"{td.group(1)}><div class="cell">{td.group(2)}</div></td>'

        return re.sub(r"<td\b([^>]*)>(.*?)</td>", cell, tr.group(0), flags=re.DOTALL)

    return re.sub(r"<tr\b[^>]*>.*?</tr>", row, table.group(0), flags=re.DOTALL)


def _breakable_code(table: re.Match) -> str:
    """Let code in table cells wrap after ``.``, ``/``, ``,`` and opening brackets, never inside a word.

    extra.css turns off the theme's ``word-break: break-word`` for code in tables; a ``<wbr>``
    after each separator gives the browser the places where it may break instead. None goes
    after ``_``: ``grad_and_value_donated`` or ``bucket_cap_mb`` broken at an underscore reads as
    two names. The first cell of a row (a mode, an option, a parameter name) gets none at all: it
    stays on one line (extra.css), and Chromium breaks at a ``<wbr>`` even under ``nowrap``.
    """

    def soften(code: re.Match) -> str:
        return code.group(1) + re.sub(r"([./,(\[])(?=[^<]*(?:<|$))", r"\1<wbr>", code.group(2)) + code.group(3)

    def row(tr: re.Match) -> str:
        first = re.match(r"(<tr>\s*<t[dh][^>]*>.*?</t[dh]>)(.*)", tr.group(0), re.DOTALL)
        if first is None:
            return tr.group(0)
        return first.group(1) + re.sub(r"(<code>)([^<]*)(</code>)", soften, first.group(2))

    return re.sub(r"<tr>.*?</tr>", row, table.group(0), flags=re.DOTALL)


def _full_size_link(img: re.Match) -> str:
    """Make a chart a link to its PNG, so that a reader can open it at full size."""
    alt, src = img.group(1), img.group(2)
    return (
        f'<p><a class="full-size" href="{src}" title="Open the full-size image">'
        f'<img alt="{alt}" src="{src}" /></a>'
        f'<span class="full-size-note">Click the chart to open it at full size.</span></p>'
    )


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else None


def _missing(command: str, what: str) -> str:
    return f'!!! note "No results yet"\n    Run `{command}` to measure {what}; this page then shows the table and chart.'


def _step_section() -> str:
    command = "torchrun --standalone --nproc-per-node=2 benchmarks/step.py"
    out = ["## One training step: fddp against torch DDP", f"Command: `{command}`."]
    data = _load("step.json")
    if data is None:
        return "\n\n".join([*out, _missing(command, "a training step in every synchronisation mode")])
    args = data.get("args", {})
    out.append(
        f"{data.get('world_size')} gloo processes on CPU, torch {data.get('torch')}; each cell is the median over "
        f"{args.get('repeats', '?')} repeats of the mean time of {args.get('steps', '?')} steps (the slowest "
        "rank's). **× DDP** is the ratio to torch DDP measured in the same run: below 1 is faster; its range is "
        "the lowest and highest ratio of a mode's repeat to DDP's repeat of the same round."
        + _load_line(data)
    )
    if (RESULTS / "step.png").is_file():
        out.append("![Step time relative to torch DDP](results/step.png)")
    timed = {m for r in data["results"].values() for m in r["modes"]}
    absent = [f"`{m}`" for m in STEP_MODES if m not in timed]
    if absent:  # a run of some modes only (--modes): say so, the summary page quotes the others
        out.append(
            f"This run timed {len(timed)} of the benchmark's {len(STEP_MODES)} modes (its command: `--modes "
            f"{' '.join(args.get('modes') or [])}` beside the references). Not in it: {', '.join(absent)}; the "
            "[numbers in short](benchmarks.md#the-numbers-in-short) quote the run that timed them."
        )
    out.append("Every mode, model by model (one tab each):")
    tabs = []
    for model, r in data["results"].items():
        rows = [
            "| mode | what runs | median ms | × DDP | range | collectives | MB sent |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        ddp = r["modes"]["ddp"]["all_ms"]
        undescribed = [m for m in r["modes"] if m not in STEP_MODES]
        if undescribed:  # a blank "what runs" cell: say what the mode runs in STEP_MODES
            raise ValueError(f"docs/hooks.py: STEP_MODES does not say what {undescribed} run (benchmarks/step.py's docstring does)")
        for mode, d in r["modes"].items():
            paired = [t / ref for t, ref in zip(d["all_ms"], ddp)]
            rows.append(
                f"| `{mode}` | {STEP_MODES[mode]} | {d['median_ms']:.1f} | {d['ratio_to_ddp']:.2f} "
                f"| {min(paired):.2f}–{max(paired):.2f} | {d['collectives']} | {d['bytes'] / 2**20:.2f} |"
            )
        tabs.append(_tab(f"{model}: {r['values'] / 1e6:.2f}M values, {r['tensors']} tensors", "\n".join(rows)))
    out.append("\n\n".join(tabs))
    return "\n\n".join(out)


def _tab(title: str, body: str) -> str:
    """One tab of a pymdownx.tabbed group (consecutive tabs form one group): a title and its Markdown."""
    indented = "\n".join(("    " + line) if line else "" for line in body.splitlines())
    return f'=== "{title}"\n\n{indented}'



def _floor_section() -> str:
    out = ["## Where the no-communication floor goes"]
    floor = _load("floor.json")
    command = "python benchmarks/floor.py --models mlp transformer"
    out.append(f"Command: `{command}`. One process, one thread; each piece of a step timed alone (median ms).")
    if floor is None:
        out.append(_missing(command, "the pieces of the floor"))
    else:
        out.append(_columns_table(floor["results_ms"], "piece", "{}", ".2f") + "\n\n" + _load_line(floor).strip())
    over = _load("overhead.json")
    command = "python benchmarks/overhead.py --leaves 34 100"
    out.append(
        f"fddp's own per-call work, from `{command}`: tensors of 4 values, so that what is timed is bookkeeping "
        "(setup, signature check, hooks, views), not arithmetic; median µs of interleaved calls, one thread."
    )
    if over is None:
        out.append(_missing(command, "fddp's per-call overhead"))
    else:
        out.append(_columns_table(over["results_us"], "call", "{} leaves", ".0f") + "\n\n" + _load_line(over).strip())
    return "\n\n".join(out)


def _columns_table(res: dict, corner: str, heading: str, fmt: str) -> str:
    """A Markdown table of ``res[column][row]``, one column per key (``heading`` formats its name)."""
    cols = list(res)
    rows = [f"| {corner} | " + " | ".join(heading.format(c) for c in cols) + " |", "| --- |" + " ---: |" * len(cols)]
    for row in res[cols[0]]:
        rows.append(f"| {row} | " + " | ".join(format(res[c][row], fmt) for c in cols) + " |")
    return "\n".join(rows)


def _optim_section() -> str:
    command = "python benchmarks/optim.py"
    out = ["## Optimizers: fddp.optim against torch.optim", f"Command: `{command}`."]
    data = _load("optim.json")
    if data is None:
        return "\n\n".join([*out, _missing(command, "the optimizers")])
    large, ens = data["large"], data["ensemble"]
    out.append(
        f"torch {data['torch']}, {data['threads']} threads, medians of {data['repeats']} repeats, "
        "both sides timed in the same run."
    )
    out.append(
        "\n".join([
            "| case | median ms | relative to torch |",
            "| --- | ---: | ---: |",
            f"| AdamW, {large['tensors']} tensors / {large['values'] / 1e6:.0f}M values: "
            f"`torch.optim.AdamW(foreach=True).step()` | {large['torch_adamw_foreach_s'] * 1e3:.2f} | 1.00× |",
            f"| `torch.optim.AdamW(fused=True).step()`, for context | "
            f"{large['torch_adamw_fused_s'] * 1e3:.2f} | {large['ratio_torch_fused']:.2f}× the time |",
            f"| `fddp.optim.apply_gradients(adamw, ...)`: pure, torch's fused kernel on new buffers | "
            f"{large['fddp_apply_gradients_s'] * 1e3:.2f} | {large['ratio_apply_gradients']:.2f}× the time |",
            f"| the same with `donate=True` (in place) | "
            f"{large['fddp_apply_gradients_donated_s'] * 1e3:.2f} | {large['ratio_apply_gradients_donated']:.2f}× the time |",
            f"| `fddp.optim.adamw`: `update` + `apply_updates` (flat buffers) | "
            f"{large['fddp_update_and_apply_s'] * 1e3:.2f} | {large['ratio_update_and_apply']:.2f}× the time |",
            f"| ensemble of {ens['models']} small models: a loop of {ens['models']} torch AdamW steps | "
            f"{ens['torch_loop_s'] * 1e3:.2f} | 1.00× |",
            f"| the same with one `vmap(opt.update)` + `apply_updates` | {ens['fddp_vmap_s'] * 1e3:.2f} "
            f"| {ens['speedup']:.2f}× faster |",
        ])  # fmt: skip
    )
    out.extend(_optim_zoo_tables(data))
    return "\n\n".join(out)


def _optim_zoo_tables(data: dict) -> list[str]:
    """Issue 54's rows: each optimizer's apply_gradients against torch.optim's step, and the ensembles."""
    zoo, ens = data.get("zoo"), data.get("zoo_ensemble")
    if not zoo:
        return []
    large = data["large"]
    rows = [
        f"Each optimizer's `apply_gradients` on the model above ({large['tensors']} tensors), against its "
        "torch.optim counterpart's `step()`: foreach or fused, whichever ran faster (the reference). "
        "`lamb`, `lars` and `lion` have none in torch.optim; they are shown against AdamW's foreach step, for scale. "
        "Over 1.10×: `apply_gradients` is pure and runs torch's single-tensor arithmetic op for op (to equal it to the bit), "
        "so each line writes a new buffer where torch updates a leaf in place while it is in the cache, and gradients "
        "that did not come from fddp's sync are copied into flat buffers first; Adagrad's reference is torch's fused "
        "kernel, one pass where the single-tensor arithmetic takes five.",
        "| optimizer | torch reference | torch ms | fddp ms | relative to torch |\n| --- | --- | ---: | ---: | ---: |",
    ]
    for name, r in zoo.items():
        ref = r["reference"].removeprefix("torch_")
        ref = f"AdamW({ref})" if name in ("lamb", "lars", "lion") else ref
        rows[-1] += (
            f"\n| `{name}` | {ref} | {r['reference_s'] * 1e3:.2f} | {r['fddp_apply_gradients_s'] * 1e3:.2f} "
            f"| {r['ratio']:.2f}× the time |"
        )
    if ens:
        table = "| optimizer | loop of torch steps, ms | fddp `vmap(update)` + apply, ms | speed-up |\n| --- | ---: | ---: | ---: |"
        for name, r in ens.items():
            table += f"\n| `{name}` | {r['torch_loop_s'] * 1e3:.2f} | {r['fddp_vmap_s'] * 1e3:.2f} | {r['speedup']:.2f}× |"
        rows += ["An ensemble of 8 MLPs: one vmapped step against 8 torch.optim instances stepped in a loop.", table]
    return rows


def _cluster_section() -> str:
    command = "python benchmarks/cluster_step.py --hosts 2 --rate 1gbit --repeats 3"
    out = [
        "## Where bytes cost: a training step across the test bed",
        f"Command: `{command}` (needs root: it builds the [multi-node test bed](multi-node.md#the-test-bed-a-cluster-on-one-machine)).",
    ]
    files = sorted(RESULTS.glob("cluster_step_*.json"))
    if not files:
        return "\n\n".join([*out, _missing(command, "every step mode across hosts joined by rate-limited links")])
    out.append(
        "Every mode of `benchmarks/step.py` against torch DDP in the same run, one torchrun agent per host. "
        "**wire ms** is the time a ring all-reduce of the mode's bytes keeps each link busy at the measured "
        "TCP rate, 2(W-1)/W × bytes / rate; **limit** is max(the fastest no-communication floor, wire): no step can be "
        "faster, even with perfect overlap. The floors send nothing: their bytes, wire and limit read \"—\"."
    )
    for path in files:
        data = json.loads(path.read_text())
        c, args = data["cluster"], data.get("args", {})
        out.append(
            f"### {c['hosts']} hosts × {c['nproc_per_node']} rank{'s' if c['nproc_per_node'] > 1 else ''}, {c['rate']} links\n\n"
            f"TCP measured at {c['tcp_bps'] / 1e9:.3f} Gbit/s; torch {data.get('torch')}; medians of "
            f"{args.get('repeats', '?')} repeats of {args.get('steps', '?')} steps. Command: `{data.get('command', '')}`."
            + _load_line(data)
        )
        png = path.with_suffix(".png")
        if png.is_file():
            out.append(f"![Step time relative to torch DDP, {c['hosts']} hosts at {c['rate']}](results/{png.name})")
        tabs = []
        for model, r in data["results"].items():
            rows = [
                "| mode | median ms | × DDP | MB sent | wire ms | limit ms | limit × DDP |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
            ]
            for mode, d in r["modes"].items():
                lim = data["limits"][model].get(mode)
                tail = (
                    "| — | — | — | — |" if lim is None else f"| {d['bytes'] / 2**20:.2f} | {lim['wire_ms']:.1f} "
                    f"| {lim['limit_ms']:.1f} | {lim['limit_ratio_to_ddp']:.2f} |"
                )
                rows.append(f"| `{mode}` | {d['median_ms']:.1f} | {d['ratio_to_ddp']:.2f} {tail}")
            tabs.append(_tab(f"{model}: {r['values'] / 1e6:.2f}M values, {r['tensors']} tensors", "\n".join(rows)))
        out.append("\n\n".join(tabs))
    return "\n\n".join(out)


def _load_line(data: dict) -> str:
    load = data.get("load_avg")
    if not load:
        return ""
    if isinstance(load, list):  # one reading, os.getloadavg() at the end (floor.py, overhead.py)
        return " Load average (1, 5, 15 min) after the run " + ", ".join(f"{x:.2f}" for x in load) + "."
    fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    return f" Load average (1, 5, 15 min) before the run {fmt(load['before'])}, after {fmt(load['after'])}, on {load['cpus']} CPUs."


def _allreduce_section() -> str:
    command = "python benchmarks/allreduce.py --hosts 2,4 --rates 1gbit,10gbit"
    out = ["## All-reduce latency and bandwidth on the test bed", f"Command: `{command}`."]
    data = _load("allreduce.json")
    if data is None:
        return "\n\n".join([*out, _missing(command, "gloo's all-reduce from 4 KiB to 64 MiB")])
    runs = data["runs"]
    sizes = [s["bytes"] for s in runs[0]["sizes"]]
    head = "| size | " + " | ".join(f"{r['hosts']} hosts, {r['rate']}" for r in runs) + " |"
    rows = [head, "| ---: |" + " ---: |" * len(runs)]
    for i, b in enumerate(sizes):
        cells = " | ".join(f"{1e3 * r['sizes'][i]['median_s']:.3f}" for r in runs)
        rows.append(f"| {b / 2**10:g} KiB | {cells} |")
    out.append("Median milliseconds per all-reduce of float32, one rank per host.\n\n" + "\n".join(rows))
    import sys

    sys.path.insert(0, str(RESULTS.parent))
    import costmodel

    out.append("`python benchmarks/costmodel.py` fits an alpha-beta model of a ring all-reduce on the 2-host runs and "
               "predicts the others:\n\n```\n" + costmodel.report(data, detail=False) + "\n```")  # fmt: skip
    return "\n\n".join(out)


# What each mode of benchmarks/zero.py runs (its docstring has the same list).
ZERO_MODES = {
    "ddp": "torch DDP + `torch.optim.AdamW(fused=True)` (the reference)",
    "torch_zero": "torch DDP + `ZeroRedundancyOptimizer(AdamW, fused=True)`: state sharded, full gradients",
    "fddp": "`fddp.grad_and_value` + `fddp.optim.apply_gradients`: replicated",
    "fddp_zero": "`fddp.grad_and_value(compression=fddp.zero.ReduceScatter())` + `apply_gradients` on the shards + `fddp.zero.gather`",
    "fddp_donated": "`fddp`, params and state donated (updated in place)",
    "fddp_zero_donated": "`fddp_zero`, shards and state donated",
}


def _zero_section() -> str:
    command = "python benchmarks/zero.py"
    out = ["## ZeRO: memory per rank and step time", f"Command: `{command}`."]
    data = _load("zero.json")
    if data is None:
        return "\n\n".join([*out, _missing(command, "the sharded path's memory and step time")])
    results = data["results"]
    first = next(iter(results.values()))
    out.append(
        f"benchmarks/step.py's {data['model']} ({first['values'] / 1e6:.2f}M values in {first['tensors']} tensors), "
        f"AdamW, torch {data['torch']}, gloo on CPU. Memory is per rank (the fullest one), counted as the "
        "distinct buffers the loop holds after a step; fddp's buffer pool additionally keeps freed buffers for "
        "reuse (`fddp.clear_caches()` returns them). "
        f"Machine load during the run: {data.get('load_average', 'unknown')}."
    )
    rows = [
        "| ranks | mode | what runs | optimizer state MB | ÷ DDP | gradients MB | ÷ DDP | parameters MB |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for world, r in results.items():
        mem = r["memory"]
        ref = mem.get("ddp")
        for mode, m in mem.items():
            rows.append(
                f"| {world} | `{mode}` | {ZERO_MODES.get(mode, '')} | {m['state'] / 1e6:.3f} | "
                f"{m['state'] / ref['state']:.3f} | {m['grads'] / 1e6:.3f} | {m['grads'] / ref['grads']:.3f} | "
                f"{m['params'] / 1e6:.3f} |"
            )
    out.append("\n".join(rows))
    timed = results.get(str(data.get("time_world")))
    if timed and any(timed["times_ms"].values()):
        wall = {m: statistics.median(ts) for m, ts in timed["times_ms"].items() if ts}
        cpu = {m: statistics.median(ts) for m, ts in timed.get("cpu_ms", {}).items() if ts}
        n = len(next(iter(timed["times_ms"].values())))
        out.append(
            f"Step time on {data['time_world']} ranks, medians of {n} repeats of {data['args'].get('steps', '?')} steps, "
            "modes interleaved; wall time is the slowest rank's, CPU time is every rank's (all threads) added up, "
            "which a loaded machine disturbs less:"
        )
        rows = [
            "| mode | wall ms | × DDP | × torch ZeRO | × fddp replicated | CPU ms | × fddp replicated |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for mode, t in wall.items():
            c = cpu.get(mode)
            cpu_cells = f"{c:.1f} | {c / cpu['fddp']:.2f}" if c is not None and "fddp" in cpu else "not measured | —"
            rows.append(
                f"| `{mode}` | {t:.1f} | {t / wall['ddp']:.2f} | {t / wall['torch_zero']:.2f} | {t / wall['fddp']:.2f} | {cpu_cells} |"
            )
        out.append("\n".join(rows))
    return "\n\n".join(out)


def _checkpoint_section() -> str:
    command = "python benchmarks/checkpoint.py --mb 100 --leaves 50 --repeats 9"
    out = [
        "## What verifying checkpoints costs",
        f"Command: `{command}`. One process; 100 MB of float32 tensors saved and loaded with the CRC-32 checks "
        "on and off, interleaved; median ms of wall-clock and CPU time (all threads). Loads read the file just "
        "written, from the page cache, so the checks are the whole extra cost there.",
    ]
    data = _load("checkpoint.json")
    if data is None:
        out.append(_missing(command, "the cost of checkpoint verification"))
        return "\n\n".join(out)
    res = data["results_ms"]
    cols = ["wall verified", "wall unverified", "wall ratio", "cpu verified", "cpu unverified", "cpu ratio"]
    table = _columns_table({c: res[c] for c in cols}, "call", "{}", ".2f")
    before = data.get("args", {}).get("load_avg_before")
    load = f" Load average (1, 5, 15 min) before the run {', '.join(f'{x:.2f}' for x in before)}." if before else ""
    out.append(table + "\n\n" + (load + _load_line(data)).strip())
    return "\n\n".join(out)


def _stage3_section() -> str:
    """benchmarks/stage3.py (loopback) and benchmarks/cluster_stage3.py (the test bed)."""
    command = "python benchmarks/stage3.py"
    out = ["## ZeRO stage 3: memory per rank and step time", f"Command: `{command}`."]
    data = _load("stage3.json")
    if data is None:
        return "\n\n".join([*out, _missing(command, "stage 3's memory and step time")])
    out.append(
        f"benchmarks/step.py's models, AdamW, torch {data['torch']}, gloo on CPU; load average before the run "
        f"{', '.join(f'{x:.1f}' for x in data['load_before'])}, after {', '.join(f'{x:.1f}' for x in data['load_after'])}. "
        "Memory per rank (the fullest rank), MB: what the loop holds between steps (distinct storages), stage 3's "
        "gathered units and gradient buffers at their peak inside a step, and the peak RSS over three steps, one "
        "process group per mode."
    )
    for model, r in data["results"].items():
        rows = [
            f"**{model}** ({r['values'] / 1e6:.2f}M values; 16 P = {16 * r['values'] / 2**20:.1f} MB)",
            "",
            "| ranks | mode | params | grads | AdamW state | held | stage 3's units at their peak | peak RSS |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for world, mem in r["memory"].items():
            for mode, m in mem.items():
                held = m["params"] + m["grads"] + m["state"]
                tr = f"{m['transient'] / 2**20:.2f}" if m.get("transient") else "—"
                rows.append(
                    f"| {world} | `{mode}` | {m['params'] / 2**20:.2f} | {m['grads'] / 2**20:.2f} | {m['state'] / 2**20:.2f} | "
                    f"{held / 2**20:.2f} | {tr} | {m['peak_rss'] / 2**20:.0f} |"
                )
        out.append("\n".join(rows) + "\n\n\"—\": the mode gathers no units (only stage 3 does).")
        t = r.get("times")
        if t:
            med = {m: statistics.median(v) for m, v in t["times_ms"].items()}
            cpu = {m: statistics.median(v) for m, v in t.get("cpu_ms", {}).items()}
            n = len(next(iter(t["times_ms"].values())))
            rows = [
                f"Step time on {t['world']} ranks, medians of {n} interleaved repeats:",
                "",
                "| mode | wall ms | × stage 2 | × FSDP2 | × DDP | CPU ms (all ranks) | × stage 2 |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
            ]
            for m, v in med.items():
                c = cpu.get(m)
                cpu_cells = f"{c:.1f} | {c / cpu['stage2']:.2f}" if c is not None and "stage2" in cpu else "not measured | —"
                rows.append(
                    f"| `{m}` | {v:.1f} | {v / med['stage2']:.2f} | {v / med['fsdp2']:.2f} | {v / med['ddp']:.2f} | {cpu_cells} |"
                )
            out.append("\n".join(rows))
    cluster = _load("cluster_stage3_1gbit.json")
    if cluster is not None:
        t = cluster["two_hosts"]
        med, floor = t["median_ms"], t["median_ms"]["stage3_floor"]
        rows = [
            f"On the test bed (`{cluster['command']}`): 2 hosts x 1 rank at {cluster['rate']} (TCP measured "
            f"{cluster['tcp_bps'] / 1e9:.3f} Gbit/s); the limit is max(stage 3's floor, its wire bytes at that rate).",
            "",
            "| mode | step ms | × DDP | wire ms | limit ms | step ÷ limit |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for m, v in med.items():
            c = t["per_step"].get(m)
            if c and m != "stage3_floor":
                limit = max(floor, c["wire_ms"])
                rows.append(f"| `{m}` | {v:.1f} | {v / med['ddp']:.2f} | {c['wire_ms']:.1f} | {limit:.1f} | {v / limit:.2f} |")
            else:
                rows.append(f"| `{m}` | {v:.1f} | {v / med['ddp']:.2f} | — | — | — |")
        out.append("\n".join(rows) + "\n\n\"—\": the limit is stage 3's; the floor itself sends nothing.")
        h = cluster.get("two_hosts_two_ranks")
        if h:
            med, ddp_bytes = h["median_ms"], h["ddp_payload_bytes"]
            rows = [
                "2 hosts x 2 ranks: hybrid sharding (within a host) against flat stage 3 and DDP.",
                "",
                "| mode | step ms | × DDP | bytes per rank into cross-host collectives | ÷ DDP's |",
                "| --- | ---: | ---: | ---: | ---: |",
            ]
            for m, v in med.items():
                c = h["per_step"].get(m, {})
                flat = (c.get("gathered_bytes") or 0) + (c.get("reduced_bytes") or 0)
                cross = {"ddp": ddp_bytes, "hybrid": c.get("replica_bytes"), "stage3": flat}.get(m)
                rows.append(f"| `{m}` | {v:.1f} | {v / med['ddp']:.2f} | {cross / 2**20:.2f} MB | {cross / ddp_bytes:.2f} |")
            out.append("\n".join(rows))
    return "\n\n".join(out)


def _scaling_validation() -> str:
    command = "python benchmarks/scaling.py validate --hosts 2,4 --rates 1gbit,10gbit"
    data = _load("scaling_validation.json")
    if data is None:
        return _missing(command, "the model against the test bed")
    rows = [
        f"Command: `{data.get('command', command)}`. Per row: the bucket cap, the step the model predicts from "
        "what fddp measured in the same run (link, timeline, the optimizer's time), the measured step (median of "
        "the repeats, with the range), and the error of the prediction.",
        "",
        "| hosts | links | model | mode | cap MiB | buckets | predicted ms | measured ms (range) | error | DDP ms | load |",
        "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in data["runs"]:
        load = run.get("load_avg")
        for model, m in run["models"].items():
            for mode, r in m["modes"].items():
                lo, hi = 1e3 * min(r["measured_all_s"]), 1e3 * max(r["measured_all_s"])
                rows.append(
                    f"| {run['hosts']} | {run['rate']} | {model} | `{mode}` | {r['bucket_cap_mb']:g} | {r['buckets']} "
                    f"| {1e3 * r['predicted_s']:.1f} | {1e3 * r['measured_s']:.1f} ({lo:.1f}-{hi:.1f}) "
                    f"| {100 * r['error']:+.1f}% | {1e3 * m['ddp_s']:.1f} | {'' if load is None else f'{load[0]:.2f}'} |"
                )
    rows.append("")
    rows.append("The links fddp measured (`fddp.scaling.measure_link`, the same fit every rank gets):")
    rows.append("")
    rows.append(
        "| hosts | links | TCP Gbit/s | model | latency µs | all-reduce bandwidth Gbit/s "
        "| timeline: forward ms, last gradient ms, end ms | after ms |"
    )
    rows.append("| ---: | --- | ---: | --- | ---: | ---: | --- | ---: |")
    for run in data["runs"]:
        for model, m in run["models"].items():
            t = m["timeline"]
            rows.append(
                f"| {run['hosts']} | {run['rate']} | {run['tcp_bps'] / 1e9:.3f} | {model} | {1e6 * m['link']['latency_s']:.0f} "
                f"| {8 * m['link']['bandwidth_Bps'] / 1e9:.3f} | {1e3 * t['backward']:.1f}, {1e3 * max(t['ready']):.1f}, "
                f"{1e3 * t['end']:.1f} | {1e3 * m['after_s']:.1f} |"
            )
    return "\n".join(rows)


def _scaling_projection() -> str:
    command = "python benchmarks/scaling.py project"
    data = _load("scaling.json")
    if data is None:
        return _missing(command, "the projection to 256 ranks")
    out = [
        f"Command: `{data.get('command', command)}`; {data['latency_us']:g} µs per message step, links at "
        f"{100 * data['link_efficiency']:.0f}% of their line rate (what TCP reached on the test bed).",
        "![Predicted scaling efficiency, 2 to 256 ranks](results/scaling.png)",
    ]
    worlds = [w for w in data["worlds"] if w in (2, 8, 32, 64, 256)]
    head = "| model | compute ms | link | " + " | ".join(f"N={w}" for w in worlds) + " | cap at 256 (MiB) |"
    rows = [head, "| --- | ---: | --- |" + " ---: |" * len(worlds) + " ---: |"]
    for name, m in data["models"].items():
        for rate in data["rates_gbit"]:
            for algorithm in ("ring", "tree"):
                cells = []
                for w in worlds:
                    r = next(r for r in m["rows"] if r["rate_gbit"] == rate and r["algorithm"] == algorithm and r["world"] == w)
                    cells.append(f"{r['efficiency']:.2f}")
                last = next(r for r in m["rows"] if r["rate_gbit"] == rate and r["algorithm"] == algorithm and r["world"] == 256)
                rows.append(
                    f"| {name} ({m['values'] / 1e6:.1f}M) | {1e3 * m['compute_s']:.1f} | {rate} Gbit/s {algorithm} | "
                    + " | ".join(cells) + f" | {last['bucket_cap_mb']:g} |"
                )
    out.append("Predicted scaling efficiency (compute ÷ step; 1 is linear scaling), bucket cap chosen per point:\n\n" + "\n".join(rows))
    notes = [f"- **{name}**: {m['compute']}." for name, m in data["models"].items()]
    out.append("Compute per step:\n\n" + "\n".join(notes))
    return "\n\n".join(out)


# The benchmark sections, by the names the pages' markers use (in the order of the full page).
def _collectives_section() -> str:
    command = "torchrun --standalone --nproc-per-node=2 benchmarks/collectives.py"
    out = [f"Command: `{command}` (the table below is its last run's output, `benchmarks/results/collectives.json`)."]
    data = _load("collectives.json")
    if data is None:
        return "\n\n".join([*out, _missing(command, "what each collective returns under each transform")])
    names = {"sum": "sum (`fddp.psum`)", "gather": "gather (`fddp.all_gather`)", "scatter": "reduce-scatter (`fddp.reduce_scatter`)"}
    # An error repeats in most cells: each distinct one is written once, under the tables, and a
    # cell says "raises (1)".
    errors: dict[str, int] = {}

    def cell(text: str) -> str:
        if not text.startswith("raises "):
            return text.replace("|", "/")
        number = errors.setdefault(text, len(errors) + 1)
        return f"raises ({number})"

    for kind, rows in data["table"].items():
        impls = list(next(iter(rows.values())))
        lines = ["| transform | " + " | ".join(impls) + " |", "| --- |" + " --- |" * len(impls)]
        for transform, cells in rows.items():
            lines.append(f"| {transform} | " + " | ".join(cell(cells[i]) for i in impls) + " |")
        out.append(f"**{names.get(kind, kind)}**, {data['world_size']} gloo ranks, torch {data['torch']}:\n\n" + "\n".join(lines))
    if errors:
        out.append("\n".join(f"({n}) {text[len('raises ') :].replace('|', '/')}  " for text, n in errors.items()))
    per = data["per_call_us"]
    out.append(
        f"Per call, a 64-float `fddp.psum` took {per['fddp.psum']:.0f} us against {per['torch.distributed.all_reduce']:.0f} us for "
        f"`torch.distributed.all_reduce` of the same tensor (medians of {data['repeats']} interleaved calls; the difference is "
        "the agreement's header, which a repeated call sends just ahead of its all-reduce)." + _load_line(data)
    )
    return "\n\n".join(out)


SECTIONS = {
    "step": _step_section,
    "floor": _floor_section,
    "optim": _optim_section,
    "cluster": _cluster_section,
    "allreduce": _allreduce_section,
    "zero": _zero_section,
    "checkpoint": _checkpoint_section,
    "stage3": _stage3_section,
    "collectives": _collectives_section,
}
