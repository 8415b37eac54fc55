"""docs/changing.md's worked examples hold: each numbered section's diffs match the files as they
are now and change as many places (hunks outside tests/) as its title says; applied to a copy of
the repository, the section's test passes there (its python block, appended to the loop's test
file, or else the tests its text names). The first check reads files only; the second runs pytest
in the copy, one process per section."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

PAGE = os.path.join(ROOT, "docs", "changing.md")
WORDS = {"one": 1, "two": 2, "three": 3}


def sections():
    """{title: (diff blocks, python blocks, tests its text names)} of the page's numbered
    sections ("## 1. ...")."""
    with open(PAGE, encoding="utf-8") as f:
        text = f.read()
    out = {}
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        title, _, body = part.partition("\n")
        if re.match(r"\d+\. ", title):
            blocks = re.findall(r"^```(\w+)\n(.*?)^```", body, flags=re.M | re.S)
            diffs = [b for lang, b in blocks if lang == "diff"]
            code = [b for lang, b in blocks if lang == "python"]
            prose = re.sub(r"^```.*?^```", "", body, flags=re.M | re.S)
            out[title] = (diffs, code, re.findall(r"`(test_\w+)`", prose))
    return out


SECTIONS = sections()


def hunks(diff):
    """[(file, header, old lines, new lines)] of a diff block: "--- FILE" names the file, "@@ X"
    starts a hunk found after the file's first line that starts with X (a def, a class, a
    statement), then " " a line kept, "-" a line removed, "+" a line added."""
    file, out = None, []
    for line in diff.splitlines():
        if line.startswith(("--- ", "+++ ")):
            file = line[4:].strip()
        elif line.startswith("@@"):
            out.append((file, line[2:].strip(), [], []))
        else:
            tag, text = line[:1], line[1:]
            _, _, old, new = out[-1]
            if tag in (" ", "", "-"):
                old.append(text)
            if tag in (" ", "", "+"):
                new.append(text)
    return out


def apply(root, diffs):
    """Each hunk of `diffs` applied to its file under root; an AssertionError names a hunk that
    does not match the file as it is."""
    for diff in diffs:
        for file, header, old, new in hunks(diff):
            path = os.path.join(root, file)
            with open(path, encoding="utf-8") as f:
                lines = f.read().split("\n")
            at = next((i for i, x in enumerate(lines) if x.strip().startswith(header)), None)
            assert at is not None, f"{file}: no line starts with {header!r}"
            n = len(old)
            where = [i for i in range(at, len(lines) - n + 1) if lines[i : i + n] == old]
            assert where, f"{file}: after {header!r} no lines read\n" + "\n".join(old)
            lines[where[0] : where[0] + n] = new
            with open(path, "w", encoding="utf-8") as f:
                f.write("\n".join(lines))


def copy_repo(dest):
    """The top-level modules, configs and tests: what a section's test imports and reads."""
    os.makedirs(dest)
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            shutil.copy(os.path.join(ROOT, name), dest)
    for name in ("configs", "tests"):
        ignore = shutil.ignore_patterns("__pycache__", ".pytest_cache")
        shutil.copytree(os.path.join(ROOT, name), os.path.join(dest, name), ignore=ignore)


def test_the_page_has_its_worked_examples():
    titles = " ".join(SECTIONS)
    assert len(SECTIONS) >= 6 and "KL-Cov" in titles and "OPO" in titles, titles


@pytest.mark.parametrize("title", SECTIONS)
def test_each_diff_matches_the_code_and_its_count_of_places(title, tmp_path):
    """Pure file work: the hunks apply to a copy of the files they name, and the title's "N
    places, one file" counts the hunks and files outside tests/."""
    diffs, _, _ = SECTIONS[title]
    found = [h for d in diffs for h in hunks(d)]
    files = {file for file, *_ in found}
    for file in files:
        os.makedirs(tmp_path / os.path.dirname(file), exist_ok=True)
        shutil.copy(os.path.join(ROOT, file), tmp_path / file)
    apply(str(tmp_path), diffs)
    places, many = re.search(r": (\d+) places?, (\w+) files?", title).groups()
    code = [h for h in found if not h[0].startswith("tests/")]
    assert len(code) == int(places), f"{title}: {len(code)} hunks outside tests/"
    assert len({file for file, *_ in code}) == WORDS[many], title


@pytest.mark.parametrize("title", SECTIONS)
def test_each_example_passes_its_test_once_applied(title, tmp_path):
    """The section's edit made on a copy of the repository, its test run there with pytest."""
    diffs, code, named = SECTIONS[title]
    root = str(tmp_path / "repo")
    copy_repo(root)
    apply(root, diffs)
    loop = next(f for d in diffs for f, *_ in hunks(d) if not f.startswith("tests/"))
    test_file = os.path.join("tests", f"test_{os.path.splitext(loop)[0]}.py")
    with open(os.path.join(root, test_file), "a", encoding="utf-8") as f:
        f.write("".join(f"\n\n{block}" for block in code))
    tests = re.findall(r"^def (test_\w+)", "".join(code), flags=re.M) or named
    assert tests, f"{title}: no test to run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    argv = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider"]
    out = subprocess.run(
        [*argv, "-k", " or ".join(tests)], cwd=root, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and " passed" in out.stdout, f"{title}:\n{out.stdout[-3000:]}"
