"""``mpcourse site``: the course as a static website, built offline from the stored notebooks.

The site holds the lessons (``notebooks/``, rendered with their stored outputs and figures, the
predict-first answers behind a click as in JupyterLab; nothing is executed), each lesson's exercise (``exercises/``: the instructions and the cells to fill in),
the results pages (``docs/*.md`` where the repository has them, else the README's results
section), and the library map (the README's library section), with navigation between lessons and
full-text search. Each lesson page links to its exercise and says how to open both in JupyterLab
(``mpcourse lab``).

The generator is MkDocs (https://www.mkdocs.org) with the Material theme
(https://squidfunk.github.io/mkdocs-material/) and the mkdocs-jupyter plugin, pinned in the
package's ``site`` extra. Everything the pages need (styles, scripts, the search index) ships in
those packages, so the build fetches nothing: web fonts are switched off (``font: false``) and so
is mkdocs-jupyter's require.js from a CDN. ``tests/course/test_site.py`` opens the result in headless
Chromium and checks that every lesson loads with its figures, that no internal link is broken,
that search works and that no page asks for anything outside the site.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from .predict_first import is_hidden

DEFAULT_OUT = Path("mpcourse-site")
MARKER = ".mpcourse-site"          # written into a built site; a non-empty folder without it is never cleaned
SITE_NAME = "mpcourse: mixed-precision training, from the bits up"

_LINK = re.compile(r"(!?)\[([^\]\n]*)\]\(([^)\s]+)(\s+\"[^\"]*\")?\)")


class SiteError(Exception):
    """A site that cannot be built as asked (the message names the fix)."""


def notebook_title(path: Path) -> str:
    """The first markdown heading of a notebook (its title), else its file name."""
    return markdown_title(page_markdown(path), path.stem)


def page_markdown(page: Path) -> str:
    """A page's markdown: a ``.md`` file's text, a notebook's markdown cells (blank lines between them)."""
    if page.suffix == ".md":
        return page.read_text(encoding="utf-8")
    cells = json.loads(page.read_text(encoding="utf-8")).get("cells", [])
    return "\n\n".join("".join(c.get("source", "")) for c in cells if c.get("cell_type") == "markdown")


def markdown_title(text: str, default: str) -> str:
    """The first heading of a markdown page, else ``default``."""
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
    return default


def readme_section(readme: str, word: str) -> str | None:
    """The README's ``## ...`` section whose heading starts with ``word`` (case-insensitive), with its
    subsections, promoted so that its heading is the page's ``#`` title; None where there is none."""
    lines = readme.splitlines()
    start, fenced = None, False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        m = re.match(r"^## (.*)$", line)
        if m and start is None and m.group(1).strip().lower().startswith(word.lower()):
            start = i
        elif start is not None and re.match(r"^#{1,2} ", line):
            return _promote(lines[start:i])
    return _promote(lines[start:]) if start is not None else None


def _promote(lines: list[str]) -> str:
    out, fenced = [], False
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        out.append(line[1:] if not fenced and re.match(r"^#{2,} ", line) else line)
    return "\n".join(out).rstrip() + "\n"


def _md_cell(text: str) -> dict:
    return {"cell_type": "markdown", "id": "mpcourse-site-note", "metadata": {}, "source": text}


def _lab_note(folder: str, name: str) -> str:
    return (f"**Open in JupyterLab:** from your clone of the course, run `mpcourse lab` "
            f"(after `pip install -e \".[dev]\"`) and open `{folder}/{name}` in its file browser.")


def stage_lesson(src: Path, dest: Path, exercise: Path | None) -> None:
    """Copy a lesson notebook, outputs kept, with a note under its title: its exercise, JupyterLab.
    (A notebook's markdown is rendered by nbconvert, which MkDocs does not rewrite: links name the pages.)"""
    nb = json.loads(src.read_text(encoding="utf-8"))
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code" and cell.get("outputs") and is_hidden(cell):
            cell["outputs"] = [behind_a_click(cell["outputs"])]
    note = [_lab_note("notebooks", src.name)]
    if exercise is not None:
        note.insert(0, f"**Exercise:** [{notebook_title(exercise)}](../exercises/{exercise.stem}.html) "
                       f"(`exercises/{exercise.name}`; grade it with `mpcourse grade exercises/{exercise.name}`).")
    _insert_after_title(nb, "\n\n".join(note))
    dest.write_text(json.dumps(nb, ensure_ascii=False), encoding="utf-8")
    toc_anchors(dest)


#: the summary line of an output the notebook keeps collapsed (a predict-first answer)
HIDDEN_SUMMARY = "Output hidden: predict first, then click to show it"
_IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif")


def behind_a_click(outputs: list[dict]) -> dict:
    """One HTML output holding ``outputs`` (streams, text, figures) inside a closed ``<details>`` element: the
    page shows only its summary until the reader clicks (mkdocs-jupyter renders a collapsed cell's outputs open;
    ``predict_first`` hides them in the notebook)."""
    import html

    parts = []
    for out in outputs:
        data = out.get("data", {})
        if out.get("output_type") == "stream":
            parts.append(f"<pre>{html.escape(''.join(out.get('text', '')))}</pre>")
        elif any(t in data for t in _IMAGE_TYPES):
            kind = next(t for t in _IMAGE_TYPES if t in data)
            src = "".join(data[kind]).replace("\n", "")
            parts.append(f'<img src="data:{kind};base64,{src}" alt="figure">')
        elif "image/svg+xml" in data or "text/html" in data:
            parts.append("".join(data.get("image/svg+xml") or data["text/html"]))
        elif "text/plain" in data:
            parts.append(f"<pre>{html.escape(''.join(data['text/plain']))}</pre>")
    body = "\n".join(parts)
    return {"output_type": "display_data", "metadata": {},
            "data": {"text/html": f'<details class="mpcourse-hidden-output"><summary>{HIDDEN_SUMMARY}</summary>\n'
                                  f"{body}\n</details>", "text/plain": HIDDEN_SUMMARY}}


def stage_exercise(src: Path, dest: Path, lesson: Path | None) -> None:
    """Copy an exercise notebook with a note under its title: its lesson, JupyterLab, grading."""
    nb = json.loads(src.read_text(encoding="utf-8"))
    note = [_lab_note("exercises", src.name) + f" Fill in the marked cells, then grade your work with "
            f"`mpcourse grade exercises/{src.name}`."]
    if lesson is not None:
        note.insert(0, f"**Lesson:** [{notebook_title(lesson)}](../notebooks/{lesson.stem}.html)")
    _insert_after_title(nb, "\n\n".join(note))
    dest.write_text(json.dumps(nb, ensure_ascii=False), encoding="utf-8")
    toc_anchors(dest)


def toc_anchors(path: Path) -> None:
    """Give each heading of the notebook at ``path`` the anchor the page's table of contents links
    to, where that differs from the heading's own id. mkdocs-jupyter builds the contents from the
    notebook converted to markdown, where a heading's code spans are gone ("5. Nesting and
    `enabled=False`" becomes "5-nesting-and"), while nbconvert's id for the heading keeps their text;
    an empty ``<a id=...>`` before the heading makes the contents link land."""
    import html
    import markdown
    from mkdocs_jupyter.plugin import get_nb_toc
    from mkdocs_jupyter.utils import slugify

    nb = json.loads(path.read_text(encoding="utf-8"))
    headings = []                                   # (cell, line index, line), in document order
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "markdown":
            continue
        cell["source"] = "".join(cell.get("source", ""))
        fenced = False
        for i, line in enumerate(cell["source"].split("\n")):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced and re.match(r"^#{1,6} ", line):
                headings.append((cell, i, line))
    toc, _ = get_nb_toc(str(path), 6)
    links, stack = [], list(toc)
    while stack:
        link = stack.pop(0)
        links.append(link)
        stack[:0] = link.children
    if len(links) != len(headings):                 # cannot pair them: leave the notebook as it is
        return
    edits: dict[int, dict[int, str]] = {}
    for (cell, i, line), link in zip(headings, links):
        nb_id = slugify(html.unescape(re.sub(r"<[^>]+>", "", markdown.markdown(line))))
        if link.id != nb_id:
            edits.setdefault(id(cell), {})[i] = f'<a id="{link.id}"></a>\n\n{line}'
    for cell in nb["cells"]:
        if id(cell) in edits:
            lines = cell["source"].split("\n")
            for i, text in edits[id(cell)].items():
                lines[i] = text
            cell["source"] = "\n".join(lines)
    path.write_text(json.dumps(nb, ensure_ascii=False), encoding="utf-8")


def _insert_after_title(nb: dict, text: str) -> None:
    """Put ``text`` (as a quote) right under the notebook's title line, else in a first cell of its own."""
    cells = nb.setdefault("cells", [])
    quote = "\n>\n".join("> " + para for para in text.split("\n\n"))
    if cells and cells[0].get("cell_type") == "markdown":
        lines = "".join(cells[0].get("source", "")).split("\n")
        if lines[0].startswith("# "):
            cells[0]["source"] = "\n".join([lines[0], "", quote, "", *lines[1:]])
            return
    cells.insert(0, _md_cell(quote))


def unlink_outside(text: str, page: Path, docs_dir: Path) -> str:
    """Markdown links whose target is not part of the site (a source file, a test) become plain text
    (code stays code), so the site has no broken link; web links and in-page anchors are kept."""
    def fix(m: re.Match) -> str:
        bang, label, target = m.group(1), m.group(2), m.group(3)
        if bang or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            return m.group(0)
        path = target.split("#", 1)[0]
        if (page.parent / path).resolve().exists() and (page.parent / path).resolve().is_relative_to(docs_dir):
            return m.group(0)
        return label
    return _LINK.sub(fix, text)


#: files MkDocs (``.md``) and mkdocs-jupyter (``.ipynb``, ``.py``) would build into pages: never copied as a download
PAGE_SUFFIXES = (".md", ".ipynb", ".py")


#: the markdown MkDocs renders the pages with (``mkdocs_config``); ``link_targets`` reads links through it too
MARKDOWN_EXTENSIONS = ["tables", "toc", "admonition", "attr_list", {"pymdownx.superfences": {}},
                       {"pymdownx.highlight": {}}]


def link_targets(text: str) -> list[str]:
    """The local targets of every link and image in markdown ``text``, as MkDocs reads them: rendered by
    Python-Markdown with the site's extensions, so a target in angle brackets, with a title, by reference or in
    raw HTML (``<img src=...>``) counts, and code does not; each URL-decoded, without its query or anchor. Web
    links (a scheme or a host) and absolute paths are left out."""
    import html.parser
    from urllib.parse import unquote, urlsplit

    import markdown

    names = [e if isinstance(e, str) else next(iter(e)) for e in MARKDOWN_EXTENSIONS]
    configs = {k: v for e in MARKDOWN_EXTENSIONS if isinstance(e, dict) for k, v in e.items()}
    found: list[str] = []

    class Links(html.parser.HTMLParser):
        def handle_starttag(self, tag, attrs):
            found.extend(v for k, v in attrs if k in ("src", "href") and v)

    Links().feed(markdown.markdown(text, extensions=names, extension_configs=configs))
    out = []
    for url in found:
        parts = urlsplit(url)
        path = unquote(parts.path)
        if not parts.scheme and not parts.netloc and path and not path.startswith("/"):
            out.append(path)
    return out


def copy_linked_files(root: Path, docs: Path) -> None:
    """Copy into the staged site the files under ``root/docs`` that its staged pages (markdown, and the lessons'
    and exercises' markdown cells) link to (a figure, a download), at the same place. The staged folder mirrors
    the course (``docs/docs/x.md`` is ``root/docs/x.md``, a page made from the README sits where the README is),
    so a link means the same file in both. Only what a page links to comes along (``link_targets``): a run's
    output in ``docs/`` (a results folder, its JSON, its reports) never reaches the site unless a page shows it.
    A linked page (``PAGE_SUFFIXES``: MkDocs and mkdocs-jupyter would make it a page of the site) is not copied;
    ``unlink_outside`` makes the link text."""
    source_docs = (root / "docs").resolve()
    pages = [*docs.rglob("*.md"), *docs.rglob("*.ipynb")]
    for page in pages:
        for target in link_targets(page_markdown(page)):
            rel = Path(os.path.normpath(page.parent.relative_to(docs) / target))
            if rel.parts[:1] == ("..",) or (docs / rel).exists():
                continue
            src = (root / rel).resolve()
            if src.is_file() and src.is_relative_to(source_docs) and src.suffix not in PAGE_SUFFIXES:
                (docs / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, docs / rel)


def index_page(lessons: list[Path], exercises: dict[str, Path], pages: list[tuple[str, str]]) -> str:
    rows = ["| lesson | exercise |", "|---|---|"]
    for lesson in lessons:
        ex = exercises.get(lesson.name)
        ex_cell = f"[exercise](exercises/{ex.name})" if ex else ""
        rows.append(f"| [{notebook_title(lesson)}](notebooks/{lesson.name}) | {ex_cell} |")
    more = "\n".join(f"- [{title}]({path})" for title, path in pages)
    return f"""# {SITE_NAME}

This is the course read as a website: each lesson with its stored outputs and figures, the exercise
that goes with it, the measured results and the library map. Search (the box at the top) covers every
page.

To run the code, work through the exercises and grade them, open the course in JupyterLab from a
clone of the repository:

```bash
pip install -e ".[dev]"
mpcourse lab
```

then open `notebooks/00_number_formats.ipynb`. Each lesson's exercise is `exercises/` with the same
name; `mpcourse grade exercises/NN_name.ipynb` grades it.

## Lessons

{chr(10).join(rows)}

## More

{more}
"""


def _stage_notebooks(root: Path, docs: Path) -> tuple[list, dict, list, list]:
    """The lessons and exercises staged under ``docs``: (lessons, exercises by name, lesson nav, exercise nav)."""
    lessons = sorted((root / "notebooks").glob("[0-9]*.ipynb"))
    if not lessons:
        raise SiteError(f"no lesson notebooks in {root / 'notebooks'}: run it from your clone of the course")
    exercises = {p.name: p for p in sorted((root / "exercises").glob("[0-9]*.ipynb"))}
    by_name = {p.name: p for p in lessons}
    (docs / "notebooks").mkdir(parents=True)
    (docs / "exercises").mkdir()
    lesson_nav, exercise_nav = [], []
    for lesson in lessons:
        stage_lesson(lesson, docs / "notebooks" / lesson.name, exercises.get(lesson.name))
        lesson_nav.append({notebook_title(lesson): f"notebooks/{lesson.name}"})
    for ex in exercises.values():
        stage_exercise(ex, docs / "exercises" / ex.name, by_name.get(ex.name))
        exercise_nav.append({notebook_title(ex): f"exercises/{ex.name}"})
    return lessons, exercises, lesson_nav, exercise_nav


def _stage_pages(root: Path, docs: Path, readme: str) -> tuple[list, list, str | None]:
    """docs/*.md staged with their layout (so the README's links into docs/ and its pages' links to each other
    hold; nothing else of docs/ comes along but the files those pages link to): (guide nav, result nav, the
    library map's page or None). Without a results page or a library map, the README's sections stand in."""
    for page in sorted(p for p in (root / "docs").glob("*.md") if p.is_file()):
        (docs / "docs").mkdir(exist_ok=True)
        shutil.copyfile(page, docs / "docs" / page.name)
    result_nav, guide_nav = [], []
    doc_pages = sorted((docs / "docs").glob("*.md")) if (docs / "docs").is_dir() else []
    library_doc = next((p for p in doc_pages if p.stem.lower() in ("library", "library_map")), None)
    for p in doc_pages:
        if p is not library_doc:
            title = markdown_title(p.read_text(encoding="utf-8"), p.stem.replace("_", " "))
            (guide_nav if p.stem in GUIDES else result_nav).append({title: f"docs/{p.name}"})
    if not result_nav:
        section = readme_section(readme, "results")
        if section:
            (docs / "results.md").write_text(section, encoding="utf-8")
            result_nav.append({markdown_title(section, "Results"): "results.md"})
    if library_doc is not None:
        return guide_nav, result_nav, f"docs/{library_doc.name}"
    section = readme_section(readme, "the library") or readme_section(readme, "library")
    if not section:
        return guide_nav, result_nav, None
    (docs / "library.md").write_text(section, encoding="utf-8")
    return guide_nav, result_nav, "library.md"


def stage(root: Path, docs: Path) -> list:
    """Write the site's sources under ``docs`` from the course at ``root``; returns MkDocs' nav."""
    lessons, exercises, lesson_nav, exercise_nav = _stage_notebooks(root, docs)
    readme = (root / "README.md").read_text(encoding="utf-8") if (root / "README.md").is_file() else ""
    guide_nav, result_nav, library_nav = _stage_pages(root, docs, readme)
    pages = [(t, p) for d in guide_nav + result_nav for t, p in d.items()]
    if library_nav:
        pages.append(("The library map", library_nav))
    (docs / "index.md").write_text(index_page(lessons, exercises, pages), encoding="utf-8")
    copy_linked_files(root, docs)
    for md in docs.rglob("*.md"):
        md.write_text(unlink_outside(md.read_text(encoding="utf-8"), md, docs.resolve()), encoding="utf-8")
    nav: list = [{"Home": "index.md"}, {"Lessons": lesson_nav}]
    for title, section in (("Exercises", exercise_nav), ("Guides", guide_nav), ("Results", result_nav)):
        if section:
            nav.append({title: section})
    if library_nav:
        nav.append({"The library map": library_nav})
    return nav


#: docs/ pages that say how to do something (set up, train with your own functions); the others hold results
GUIDES = ("setup", "training-with-your-code")


def mkdocs_config(docs: Path, out: Path, nav: list) -> dict:
    """MkDocs' configuration: Material without web fonts, search, notebooks rendered as stored."""
    return {
        "site_name": SITE_NAME,
        "docs_dir": str(docs),
        "site_dir": str(out),
        "use_directory_urls": False,      # page.html, not page/: the site also reads from the disk
        "nav": nav,
        "theme": {"name": "material", "font": False,
                  "features": ["navigation.footer", "navigation.indexes", "search.highlight"]},
        "plugins": ["search", {"mkdocs-jupyter": {"execute": False, "include_source": True, "cache": False,
                                                  "include_requirejs": False, "ignore_h1_titles": True}}],
        "markdown_extensions": MARKDOWN_EXTENSIONS,
        "validation": {"links": {"not_found": "warn", "anchors": "info"}},
    }


def build_site(out: Path, root: Path) -> Path:
    """Build the site from the course at ``root`` into ``out`` (created; a previous site there is replaced)."""
    out = out.resolve()
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).exists())):
        raise SiteError(f"{out} exists and is not a site built by mpcourse site (building would delete what "
                        "is there); choose a new or empty folder with --out")
    if root.resolve() == out or root.resolve().is_relative_to(out):
        raise SiteError(f"--out {out} holds the course itself; choose a new or empty folder")
    try:
        from mkdocs.commands.build import build
        from mkdocs.config import load_config
        import material  # noqa: F401  (the theme)
        import mkdocs_jupyter  # noqa: F401
    except ImportError as e:
        raise SiteError(f"the site generator is not installed ({e.name} missing): "
                        "pip install -e \".[site]\"") from None
    with tempfile.TemporaryDirectory(prefix="mpcourse-site-") as tmp:
        docs = Path(tmp) / "src"
        docs.mkdir()
        nav = stage(root, docs)
        cfg_file = Path(tmp) / "mkdocs.yml"
        cfg_file.write_text(json.dumps(mkdocs_config(docs, out, nav)), encoding="utf-8")  # JSON is YAML
        config = load_config(str(cfg_file))
        build(config)
    (out / MARKER).write_text("built by `mpcourse site`; rebuilding replaces this folder\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None, prog: str = "mpcourse site") -> int:
    from .root import course_root

    p = argparse.ArgumentParser(prog=prog, description="Build the course as a static website (lessons with their "
                                "stored outputs, exercises, results, the library map; navigation and search), "
                                "offline. Open OUT/index.html, or serve it: python -m http.server -d OUT "
                                "(search needs the server).")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT}/)")
    args = p.parse_args(argv)
    log = logging.getLogger("mkdocs")           # MkDocs' own warnings (a link it cannot resolve), one line each
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"{prog}: %(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.WARNING)
    try:
        out = build_site(args.out, course_root())
    except SiteError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote the course website to {out}: open {out / 'index.html'}, or for search "
          f"python -m http.server -d {out} and open http://127.0.0.1:8000/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
