"""The README is a door and ``docs/`` the rooms: a short README that links every page, links and repository paths that
resolve inside the repository, and nothing pointing outside it."""

from __future__ import annotations

import re

from tests.paths import ROOT

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
GENERATED = ("loadtest/results/quick", "loadtest/results/logs")
"""Paths the docs name that a run writes (not committed)."""

PATH = re.compile(r"`((?:common|services|loadtest|tests|helm|ray_configs|docs)/[^`\s]*)`")


def _slug(heading: str) -> str:
    """A heading's anchor as Markdown renderers make it: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _anchors(path) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), flags=re.M)}


def test_the_readme_is_short_and_links_every_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    assert DOCS, "no docs/ pages"
    linked = {m for m in LINK.findall(text)}
    for page in DOCS:
        assert any(link.split("#")[0] == f"docs/{page.name}" for link in linked), f"README does not link {page.name}"


def test_every_link_resolves_inside_the_repository():
    for page in PAGES:
        for link in LINK.findall(page.read_text(encoding="utf-8")):
            assert "://" not in link and not link.startswith("mailto:"), f"{page.name} links outside: {link}"
            target, _, anchor = link.partition("#")
            path = (page.parent / target).resolve() if target else page
            assert path.is_relative_to(ROOT) and path.exists(), f"{page.name}: {link} does not resolve"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path), f"{page.name}: no heading #{anchor} in {path.name}"


def test_every_repository_path_named_exists():
    """A page that names ``services/…/x.py`` (or a folder) names something that is there: docs move with the code."""
    for page in PAGES:
        for raw in PATH.findall(page.read_text(encoding="utf-8")):
            path = raw.split(":", 1)[0].rstrip(".,;…")
            if any(ch in path for ch in "*<>{}") or path.endswith("…") or path.startswith(GENERATED):
                continue  # (a pattern or a placeholder, not a path)
            assert (ROOT / path).exists(), f"{page.name} names {raw}, which is not in the repository"


def test_nothing_refers_outside_the_repository():
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        assert "../shared" not in text and "design.md" not in text, page.name


def test_the_checks_can_fail(tmp_path):
    """The link and path patterns find what they are meant to find."""
    assert LINK.findall("see [x](docs/a.md#b) and [y](https://e.org)") == ["docs/a.md#b", "https://e.org"]
    assert PATH.findall("`services/ingress/plan.py` and `common/nowhere.py:f`") == [
        "services/ingress/plan.py",
        "common/nowhere.py:f",
    ]
    assert not (ROOT / "common/nowhere.py").exists()
    assert _slug("Scaling, deadlines and failures") == "scaling-deadlines-and-failures"
