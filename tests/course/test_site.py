"""The course website (``mpcourse site``), built from this checkout and checked in a real browser.

Headless Chromium from the system packages (``apt-get install chromium``), driven by playwright (the
``site`` extra), opens the built site through a local HTTP server: every lesson page loads with as
many decoded figures as its notebook stores, links to its exercise and says how to open it in
JupyterLab; a crawl from the home page finds no broken internal link or anchor; the search box finds
"hysteresis" in lesson 04; and no page asks for anything from outside the site. Without Chromium or
playwright these tests skip, except under CI (``CI=true``), where they fail: CI must run them.
The builder's own checks (folders it refuses, the missing extra, links it unlinks, run outputs in the clone
changing nothing in the site) run without them.
"""
from __future__ import annotations

import functools
import http.server
import json
import os
import sys
import threading
from collections import deque
from pathlib import Path
from urllib.parse import urldefrag

import pytest

from mpcourse.course import site
from mpcourse.course.root import course_root

ROOT = course_root(Path(__file__).parent)
LESSONS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
CHROMIUM = os.environ.get("MPCOURSE_CHROMIUM", "/usr/bin/chromium")
IMAGE_TYPES = ("image/png", "image/jpeg", "image/svg+xml", "image/gif")


def _missing(why: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{why}; CI must run the website test (.ci/run installs Chromium and the site extra)")
    pytest.skip(why)


def _need(*modules: str) -> None:
    """Skip (fail under CI) unless the site extra's ``modules`` import."""
    for module in modules:
        try:
            __import__(module)
        except ImportError:
            _missing(f'{module} is not installed (pip install -e ".[site]")')


def _empty_course(root: Path) -> Path:
    """``root`` made a course folder with empty notebooks/, exercises/ and docs/."""
    for folder in ("notebooks", "exercises", "docs"):
        (root / folder).mkdir(parents=True)
    return root


def _stored(nb_path: Path) -> tuple[int, str | None]:
    """(figures stored in the notebook's outputs, the first non-empty line of its first stream output)."""
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    images, first_line = 0, None
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            images += any(t in out.get("data", {}) for t in IMAGE_TYPES)
            if first_line is None and out.get("output_type") == "stream":
                lines = [ln.strip() for ln in "".join(out.get("text", "")).splitlines() if ln.strip()]
                first_line = lines[0] if lines else None
    return images, first_line


# --- the builder, without a browser ------------------------------------------------------------------------

def test_refuses_a_folder_it_did_not_build(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert site.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--out" in err and "Traceback" not in err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_missing_extra_names_the_install_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "mkdocs", None)     # import mkdocs now raises ImportError
    assert site.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'pip install -e ".[site]"' in err


def test_links_outside_the_site_become_text(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A")
    page = tmp_path / "index.md"
    text = ("[kept](docs/a.md#x) [gone](benchmarks/run.py) [`code`](../tests/t.py) [web](https://example.org) "
            "[anchor](#results) ![fig](docs/missing.png)")
    assert site.unlink_outside(text, page, tmp_path.resolve()) == (
        "[kept](docs/a.md#x) gone `code` [web](https://example.org) [anchor](#results) ![fig](docs/missing.png)")


def test_readme_section_is_promoted_and_stops_at_the_next_section():
    readme = "# T\n## Results\nr\n### Sub\n```\n## not a heading\n```\n## The library\nl\n"
    assert site.readme_section(readme, "results") == "# Results\nr\n## Sub\n```\n## not a heading\n```\n"
    assert site.readme_section(readme, "the library") == "# The library\nl\n"
    assert site.readme_section(readme, "missing") is None


def _notebook(title: str, *extra_cells: dict) -> str:
    cells = [{"cell_type": "markdown", "id": "t", "metadata": {}, "source": f"# {title}\n\nIntro."}, *extra_cells]
    return json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5})


def test_stage_takes_results_from_docs_and_the_library_map_from_the_readme(tmp_path):
    _need("mkdocs_jupyter")
    root = _empty_course(tmp_path / "course")
    code = {"cell_type": "markdown", "id": "h", "metadata": {}, "source": "## 2. Nesting and `enabled=False`"}
    (root / "notebooks" / "00_a.ipynb").write_text(_notebook("00 — Lesson A", code))
    (root / "notebooks" / "01_b.ipynb").write_text(_notebook("01 — Lesson B"))
    (root / "exercises" / "00_a.ipynb").write_text(_notebook("Exercise 00"))
    (root / "docs" / "speed.md").write_text("# Speed\n\nSee [lesson A](../notebooks/00_a.ipynb), "
                                            "[the script](../benchmarks/run.py).\n")
    (root / "docs" / "setup.md").write_text("# Set-up\n")
    (root / "README.md").write_text("# C\n## Results\nold\n## The library\n| module |\n|---|\n| `x` |\n")
    docs = tmp_path / "src"
    docs.mkdir()
    nav = site.stage(root, docs)
    assert nav == [{"Home": "index.md"},
                   {"Lessons": [{"00 — Lesson A": "notebooks/00_a.ipynb"}, {"01 — Lesson B": "notebooks/01_b.ipynb"}]},
                   {"Exercises": [{"Exercise 00": "exercises/00_a.ipynb"}]},
                   {"Guides": [{"Set-up": "docs/setup.md"}]},          # how-to pages apart from the results
                   {"Results": [{"Speed": "docs/speed.md"}]},
                   {"The library map": "library.md"}]
    assert not (docs / "results.md").exists()                     # docs/ replaces the README's results
    assert (docs / "docs" / "speed.md").read_text() == "# Speed\n\nSee [lesson A](../notebooks/00_a.ipynb), the script.\n"
    lesson = json.loads((docs / "notebooks" / "00_a.ipynb").read_text())
    head = lesson["cells"][0]["source"]
    assert head.startswith("# 00 — Lesson A\n\n> **Exercise:** [Exercise 00](../exercises/00_a.html)")
    assert "mpcourse lab" in head
    # the contents link to the heading with code in it lands (mkdocs-jupyter slugs it without the code)
    assert lesson["cells"][1]["source"].startswith('<a id="2-nesting-and"></a>')
    assert "Exercise" not in json.loads((docs / "notebooks" / "01_b.ipynb").read_text())["cells"][0]["source"]
    exercise = json.loads((docs / "exercises" / "00_a.ipynb").read_text())["cells"][0]["source"]
    assert "[00 — Lesson A](../notebooks/00_a.html)" in exercise and "mpcourse grade exercises/00_a.ipynb" in exercise


def _small_course(root: Path) -> None:
    """A course of one lesson (with "hysteresis" in it), one exercise, a results page showing a figure from
    docs/, and a README with a library section."""
    _empty_course(root)
    (root / "notebooks" / "04_scaling.ipynb").write_text(_notebook(
        "04 — Scaling", {"cell_type": "markdown", "id": "h", "metadata": {}, "source": "Hysteresis keeps the scale."}))
    (root / "exercises" / "04_scaling.ipynb").write_text(_notebook("Exercise 04"))
    (root / "docs" / "results.md").write_text("# Results\n\n![loss](loss_curves.png)\n\nSee [set-up](setup.md).\n")
    (root / "docs" / "setup.md").write_text("# Set-up\n")
    (root / "docs" / "loss_curves.png").write_bytes(b"\x89PNG the figure the results page shows")
    (root / "README.md").write_text("# C\n## The library\n| module |\n|---|\n| `x` |\n")


def _run_outputs(root: Path) -> None:
    """What runs and tools leave in a clone: the main job's mpcourse-out/ (with a report), a side run's folder,
    a run sent into docs/ or started from notebooks/, an old results folder with a script and a notebook in
    docs/, JupyterLab's checkpoints: pages, JSON, figures, all mentioning hysteresis."""
    report = "# Run report\n\nhysteresis: the scale halved 3 times\n"
    for folder in ("mpcourse-out", "mpcourse-out-runs/recipes=fp32+steps=2", "docs/mpcourse-out",
                   "docs/results-old", "notebooks/mpcourse-out", "docs/.ipynb_checkpoints"):
        d = root / folder
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps({"results": [{"recipe": "fp32", "note": "hysteresis"}]}))
        (d / "loss_curves.png").write_bytes(b"\x89PNG a run's plot")
        (d / "report.md").write_text(report)
    (root / "docs" / "results-old" / "rerun.py").write_text("# hysteresis\nprint('hysteresis')\n")
    (root / "docs" / "results-old" / "04_scaling.ipynb").write_text(_notebook("Old run: hysteresis"))
    (root / "docs" / ".ipynb_checkpoints" / "results-checkpoint.md").write_text(report)


def _tree(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_run_outputs_never_reach_the_site(tmp_path):
    """The site is built from notebooks/, exercises/, docs/*.md (and what they show) and the README, nothing
    else: the same course with run outputs beside it and in its folders builds the same site, byte for byte,
    and the search index finds "hysteresis" in the lesson only."""
    _need("mkdocs", "material", "mkdocs_jupyter")
    clean, cluttered = tmp_path / "clean", tmp_path / "cluttered"
    _small_course(clean)
    _small_course(cluttered)
    _run_outputs(cluttered)
    site.build_site(tmp_path / "site-clean", clean)
    site.build_site(tmp_path / "site-cluttered", cluttered)
    want, got = _tree(tmp_path / "site-clean"), _tree(tmp_path / "site-cluttered")
    assert sorted(got) == sorted(want), f"files only in the cluttered build: {sorted(set(got) - set(want))}"
    assert [name for name in want if got[name] != want[name]] == []
    assert got["docs/loss_curves.png"] == b"\x89PNG the figure the results page shows"   # what a page shows comes
    index = json.loads(got["search/search_index.json"])
    hits = {d["location"].split("#")[0] for d in index["docs"] if "hysteresis" in (d["title"] + d["text"]).lower()}
    assert hits == {"notebooks/04_scaling.html"}


def test_every_file_a_page_shows_comes_along_however_the_link_is_written(tmp_path):
    """What MkDocs renders as a link or an image (Python-Markdown: a target in angle brackets, with a space, escaped
    as %20, with a single-quoted title, a query, by reference, or raw HTML) and what a lesson's markdown shows from
    docs/ is staged with the page; a file nothing links to is not."""
    _need("mkdocs_jupyter")
    root = _empty_course(tmp_path / "course")
    shown = {"plain.png": "![a](plain.png)", "angle fig.png": "![a](<angle fig.png>)",
             "pct fig.png": "![a](pct%20fig.png)", "single.png": "![a](single.png 'the title')",
             "query.png": "![a](query.png?raw=true)", "ref.png": "![a][r]\n\n[r]: ref.png",
             "html.png": '<img src="html.png" width="300">', "figs/table(1).csv": "[t](figs/table(1).csv)"}
    (root / "docs" / "results.md").write_text("# Results\n\n" + "\n\n".join(shown.values()) + "\n")
    (root / "notebooks" / "00_a.ipynb").write_text(_notebook("00 — A", {
        "cell_type": "markdown", "id": "f", "metadata": {}, "source": "![curves](../docs/lesson.png)"}))
    for name in [*shown, "lesson.png", "unlinked.png"]:
        (root / "docs" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "docs" / name).write_bytes(b"\x89PNG " + name.encode())
    docs = tmp_path / "src"
    docs.mkdir()
    site.stage(root, docs)
    missing = [name for name in [*shown, "lesson.png"] if not (docs / "docs" / name).is_file()]
    assert missing == []
    assert (docs / "docs" / "angle fig.png").read_bytes() == b"\x89PNG angle fig.png"
    assert not (docs / "docs" / "unlinked.png").exists()


# --- the built site, in a browser --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    _need("mkdocs", "material", "mkdocs_jupyter", "playwright")
    if not Path(CHROMIUM).exists():
        _missing(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    out = tmp_path_factory.mktemp("site") / "site"
    elsewhere = tmp_path_factory.mktemp("cwd")
    here = Path.cwd()
    os.chdir(elsewhere)                    # the course is found from the package; nothing lands in the cwd
    try:
        assert site.main(["--out", str(out)]) == 0
    finally:
        os.chdir(here)
    assert list(elsewhere.iterdir()) == [], "the build wrote into the current folder"
    assert (out / site.MARKER).exists()
    return out


@pytest.fixture(scope="module")
def base_url(built):
    handler = functools.partial(_QuietHandler, directory=str(built))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser_page(base_url):
    """A Chromium page whose requests outside the site are refused and recorded."""
    from playwright.sync_api import sync_playwright   # (``built`` checked that it and Chromium are here)

    outside: list[str] = []

    def route(r):
        if r.request.url.startswith(base_url) or r.request.url.startswith("data:"):
            r.continue_()
        else:
            outside.append(r.request.url)
            r.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        context.route("**/*", route)
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.outside, page.js_errors = outside, errors
        yield page
        browser.close()


def _visit(page, url: str):
    response = page.goto(url, wait_until="load")
    assert response is not None and response.ok, f"{url}: HTTP {response and response.status}"
    assert not page.outside, f"{url} asked for things outside the site: {page.outside}"
    assert not page.js_errors, f"{url}: JavaScript errors {page.js_errors}"
    return response


@pytest.mark.slow
@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_page_loads_with_its_figures(browser_page, base_url, lesson):
    page = browser_page
    _visit(page, f"{base_url}notebooks/{lesson.stem}.html")
    figures, first_line = _stored(lesson)
    images = page.eval_on_selector_all(
        "article img", "els => els.map(i => ({src: i.src.slice(0, 60), ok: i.complete && i.naturalWidth > 0}))")
    assert len(images) >= figures, f"{len(images)} images on the page, {figures} figures in the notebook"
    assert all(i["ok"] for i in images), f"images not decoded: {[i['src'] for i in images if not i['ok']]}"
    text = page.inner_text("article")
    if first_line is not None:
        assert first_line in text, f"stored output {first_line!r} is not on the page"
    assert "mpcourse lab" in text
    if (ROOT / "exercises" / lesson.name).exists():
        links = page.eval_on_selector_all("article a", "els => els.map(a => a.href)")
        assert f"{base_url}exercises/{lesson.stem}.html" in links


@pytest.mark.slow
def test_no_broken_internal_link(browser_page, base_url):
    """Crawl from the home page: every internal link's page or file answers, every anchor exists."""
    page = browser_page
    seen_pages: dict[str, set[str]] = {}
    anchors: list[tuple[str, str, str]] = []          # (from page, target page, fragment)
    files: dict[str, str] = {}                        # non-HTML target -> a page linking to it
    queue = deque([base_url + "index.html"])
    while queue:
        url = queue.popleft()
        if url in seen_pages:
            continue
        _visit(page, url)
        seen_pages[url] = set(page.eval_on_selector_all("[id], a[name]", "els => els.map(e => e.id || e.name)"))
        hrefs = page.eval_on_selector_all("a[href]", "els => els.map(a => a.href)")
        hrefs += page.eval_on_selector_all("img[src], link[href], script[src]", "els => els.map(e => e.src || e.href)")
        for href in hrefs:
            if not href.startswith(base_url):
                continue
            target, fragment = urldefrag(href)
            if target.endswith("/"):
                target += "index.html"
            if fragment:
                anchors.append((url, target, fragment))
            if target.endswith(".html"):
                queue.append(target)
            else:
                files.setdefault(target, url)
    lessons = {f"{base_url}notebooks/{p.stem}.html" for p in LESSONS}
    assert lessons <= set(seen_pages), f"lessons not reachable from the home page: {lessons - set(seen_pages)}"
    for target, source in files.items():
        response = page.request.get(target)
        assert response.ok, f"{source} links to {target}: HTTP {response.status}"
    missing = [(s, t, f) for s, t, f in anchors if t.endswith(".html") and f not in seen_pages[t]]
    assert not missing, f"anchors that are not on their page (from, page, anchor): {missing[:10]}"


@pytest.mark.slow
def test_every_page_comes_from_the_course(built):
    """The built site's pages are the home page, the lessons, the exercises, docs/*.md and the README's pages:
    nothing a run or a tool left in the clone (mpcourse-out/, a results folder) becomes a page."""
    pages = {str(p.relative_to(built)) for p in built.rglob("*.html")}
    lessons = {f"notebooks/{p.stem}.html" for p in LESSONS}
    allowed = (lessons | {f"exercises/{p.stem}.html" for p in (ROOT / "exercises").glob("[0-9]*.ipynb")}
               | {f"docs/{p.stem}.html" for p in (ROOT / "docs").glob("*.md")}
               | {"index.html", "404.html", "results.html", "library.html"})
    assert lessons <= pages
    assert pages <= allowed, f"pages from outside the course's sources: {sorted(pages - allowed)}"
    index = json.loads((built / "search" / "search_index.json").read_text(encoding="utf-8"))
    assert {d["location"].split("#")[0] or "index.html" for d in index["docs"]} <= allowed


@pytest.mark.slow
def test_search_finds_hysteresis(browser_page, base_url):
    page = browser_page
    _visit(page, base_url + "index.html")
    page.fill("input.md-search__input", "hysteresis")
    page.wait_for_selector(".md-search-result__item a", timeout=30_000)
    hits = page.eval_on_selector_all(".md-search-result__item a", "els => els.map(a => a.href)")
    assert any("notebooks/04_dynamic_loss_scaling.html" in h for h in hits), hits
    assert not page.outside


PNG_1X1 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


def test_a_predict_first_answer_is_behind_a_click(tmp_path):
    """A lesson's collapsed output (a predict-first answer) is built into a closed <details> element, its text and
    figure inside it; an output the notebook shows stays on the page."""
    _need("mkdocs", "material", "mkdocs_jupyter")
    import html.parser

    from mpcourse.course.predict_first import PROMPT, hide_answers

    root = _empty_course(tmp_path / "course")
    shown = {"cell_type": "code", "id": "c1", "metadata": {}, "execution_count": 1, "source": "print('shown')",
             "outputs": [{"output_type": "stream", "name": "stdout", "text": "the table everyone sees\n"}]}
    prompt = {"cell_type": "markdown", "id": "p", "metadata": {}, "source": f"{PROMPT} what comes out?"}
    answer = {"cell_type": "code", "id": "c2", "metadata": {}, "execution_count": 2, "source": "print(6 * 7)",
              "outputs": [{"output_type": "stream", "name": "stdout", "text": "the answer <is> 42\n"},
                          {"output_type": "display_data", "metadata": {},
                           "data": {"image/png": PNG_1X1, "text/plain": "<Figure>"}}]}
    nb = json.loads(_notebook("09 — Hidden", shown, prompt, answer))
    assert hide_answers(nb) == 1
    (root / "notebooks" / "09_hidden.ipynb").write_text(json.dumps(nb))
    out = site.build_site(tmp_path / "site", root)
    page = (out / "notebooks" / "09_hidden.html").read_text(encoding="utf-8")

    class Where(html.parser.HTMLParser):
        """The text of the page outside any <details>, and inside closed ones; the images inside them."""
        def __init__(self):
            super().__init__()
            self.depth, self.outside, self.inside, self.hidden_imgs, self.open_details = 0, [], [], 0, 0

        def handle_starttag(self, tag, attrs):
            if tag == "details":
                self.depth += 1
                self.open_details += any(k == "open" for k, _ in attrs)
            elif tag == "img" and self.depth and any(k == "src" and v.startswith("data:image/png") for k, v in attrs):
                self.hidden_imgs += 1

        def handle_endtag(self, tag):
            if tag == "details":
                self.depth -= 1

        def handle_data(self, data):
            (self.inside if self.depth else self.outside).append(data)

    w = Where()
    w.feed(page)
    outside, inside = "".join(w.outside), "".join(w.inside)
    assert "the table everyone sees" in outside and "the answer <is> 42" not in outside
    assert "the answer <is> 42" in inside and site.HIDDEN_SUMMARY in inside
    assert w.hidden_imgs == 1 and w.open_details == 0
