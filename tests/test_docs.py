"""The documentation stays a ten-minute README plus docs/ pages that hold together: README.md is at
most 320 lines; every relative link in README.md and docs/*.md names a file that exists (and a
heading that exists, for links with a #fragment); no page speaks of "sessions" (the docs describe
the project, not how it was written; a process started with setsid is "a process group of its
own" there); README's test counts are those of docs/testing.md. Pure file reads, well under a
second."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PAGES = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
MAX_README_LINES = 320
# Pages other branches add; README links to them before they land, so a link to one of these is
# skipped while the file is absent (and checked like any other once it exists).
RESERVED = {"docs/update.md", "docs/gpu.md", "docs/real-model.md"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def rel(path):
    return os.path.relpath(path, ROOT).replace(os.sep, "/")


def prose_lines(path):
    """The page's lines outside fenced and indented code blocks (links there are not links)."""
    out, fenced = [], False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if FENCE.match(line.lstrip()):
                fenced = not fenced
                continue
            if not fenced and not line.startswith("    "):
                out.append(line)
    return out


def anchors(path):
    """GitHub's heading ids: lower case, punctuation but '-' and '_' dropped, spaces to '-', and
    '-1', '-2', ... on repeats."""
    seen, out = {}, set()
    for line in prose_lines(path):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_readme_is_short():
    with open(README, encoding="utf-8") as f:
        n = len(f.readlines())
    assert n <= MAX_README_LINES, (
        f"README.md has {n} lines (at most {MAX_README_LINES}): move reference material to docs/"
    )


def test_docs_exist():
    assert len(PAGES) > 5, "docs/*.md is missing"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_resolve(page):
    bad = []
    for line in prose_lines(page):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(dest):
                if rel(dest) not in RESERVED:
                    bad.append(f"{target}: no file {rel(dest)}")
                continue
            if fragment and dest.endswith(".md") and fragment not in anchors(dest):
                bad.append(f"{target}: no heading #{fragment} in {rel(dest)}")
    assert not bad, f"{rel(page)}: broken links:\n" + "\n".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_no_sessions(page):
    with open(page, encoding="utf-8") as f:
        hits = [i for i, line in enumerate(f, 1) if "session" in line.lower()]
    assert not hits, f"{rel(page)} lines {hits} speak of a session: describe the project instead"


def test_test_counts_agree():
    """README's figures for the suite and for `bash test.sh --fast` are one each, and those of
    docs/testing.md's measurements."""
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    with open(os.path.join(ROOT, "docs", "testing.md"), encoding="utf-8") as f:
        testing = f.read()
    fast = set(re.findall(r"(\d+) tests(?: in|,) (\d+ min \d+ s)", readme))
    measured = re.search(r"Measured, `bash test.sh --fast`: (\d+) passed, \d+ deselected, in "
                         r"(\d+ min \d+ s)", testing)  # fmt: skip
    assert fast == {measured.groups()}, (fast, measured.groups())
    suite = set(re.findall(r"(\d+) passed, (\d+) skipped", readme))
    assert suite == set(re.findall(r"clean clone: (\d+) passed and (\d+) skipped", testing)), suite
