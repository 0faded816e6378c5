"""The README's and docs/' links and cited paths lead somewhere.

Links (outside code): every relative link names a file of the repository and, with a
#fragment, a heading of that file (as GitHub makes anchors of headings).

Cited paths: every inline code span outside fenced blocks made only of path characters
(letters, digits, ``_ . / -``; so no command, URL or glob), with no placeholder in capitals
(``DIR/ca.crt``) or ``...`` elision, is checked when it looks like a repository path:

- rooted: its first part is a top-level folder of the repository (``gateway/http/sse.py``,
  ``tests/``, ``bench/mesh_load.py``, ``docs/benchmarks/``): that path exists;
- relative: a path with a ``/`` that names a file (``api/generation.py``) or a folder (``lua/``),
  or a bare file name of our sources (``sse.py``, ``admit.lua``): some path of the repository
  ends with it, and in a table row that cites folders (the floors and rooms tables) it lies under
  one of them. (A span such as ``ev/req`` or ``pods/portforward`` is a unit or a name.)

A path exists when it is in the working tree, or lies in a place a ``.gitignore`` names (where
``make proto``, ``make model`` or the deployment scripts write), or in another project's tree
that the docs name (``_OTHER_PROJECTS``). A span starting with ``/`` is an HTTP path, not a file.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Set
from pathlib import Path

import pytest

_ROOT = Path(__file__).parents[1]
_DOCS = [_ROOT / "README.md", *sorted((_ROOT / "docs").rglob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_SPAN = re.compile(r"`([^`\n]+)`")
_PATHLIKE = re.compile(r"[\w.-]+(/[\w.-]+)*/?")
# an elision (.../usage) or a placeholder in capitals (DIR/redis.crt)
_PLACEHOLDER = re.compile(r"\.\.\.|(^|/)[A-Z]{2,}(/|$)")
_SOURCE_FILE = re.compile(r"[\w-]+\.(py|lua|proto|j2|sh)")
# Paths of other projects the docs cite as theirs: vLLM's source tree, DeepSeek-V3's inference/.
_OTHER_PROJECTS = ("vllm/", "inference/")
_NOT_THE_TREE = {".git", ".venv", "__pycache__"}


@functools.cache  # one walk for every document
def tree_paths(root: Path) -> frozenset[str]:
    """Every file and folder of the working tree (not git's, the venv or caches), as ``a/b.py``
    and ``a/`` with the folder's slash."""
    out: set[str] = set()
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _NOT_THE_TREE and d[-6:] != "_cache"]
        prefix = Path(folder).relative_to(root).as_posix() + "/"
        prefix = "" if prefix == "./" else prefix
        out.update(f"{prefix}{d}/" for d in subfolders)
        out.update(f"{prefix}{f}" for f in files)
    return frozenset(out)


@functools.cache
def ignored_places(root: Path) -> frozenset[str]:
    """The folders ``.gitignore`` files name (no globs): where generated files go."""
    out = set()
    for ignore in root.rglob(".gitignore"):
        folder = ignore.parent.relative_to(root).as_posix()
        prefix = "" if folder == "." else folder + "/"
        for line in ignore.read_text().splitlines():
            line = line.strip().strip("/")
            if line and not line.startswith("#") and not re.search(r"[*?\[!]", line):
                out.add(f"{prefix}{line}/")
    return frozenset(out)


def stale_citations(text: str, tree: Set[str], ignored: Set[str]) -> list[str]:
    """The cited paths of a Markdown text that lead nowhere (see the module's rule)."""
    tops = {p.rstrip("/") for p in tree if "/" not in p.rstrip("/")}
    places = ignored | set(_OTHER_PROJECTS)
    stale = []
    for line in _FENCE.sub("", text).splitlines():
        spans = [s.strip() for s in _SPAN.findall(line)]
        spans = [s for s in spans if _PATHLIKE.fullmatch(s) and not _PLACEHOLDER.search(s)]
        folders = (
            [s for s in spans if s.endswith("/") and s in tree] if line.startswith("|") else []
        )
        for span in spans:
            if not _cited_path_exists(span, tree, tops, places, folders):
                stale.append(span)
    return stale


def _cited_path_exists(
    span: str, tree: Set[str], tops: set[str], places: Set[str], folders: list[str]
) -> bool:
    if any((span + "/").startswith(place) for place in places):
        return True
    if span.split("/")[0] in tops:
        return span in tree or span + "/" in tree
    if "/" in span.rstrip("/"):
        if not span.endswith("/") and "." not in span.rsplit("/", 1)[1]:
            return True  # a unit (ev/req) or a name (pods/portforward), not a file
    elif not span.endswith("/") and not _SOURCE_FILE.fullmatch(span):
        return True  # a bare word (a module, a file name of no source of ours)
    if folders:
        return any(p.startswith(f) and p.endswith("/" + span) for f in folders for p in tree)
    return any(p.endswith("/" + span) for p in tree)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores
    dropped, spaces as hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        if match := re.match(r"#+ (.*)", line):
            base = anchor(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def test_anchor_is_githubs():
    assert anchor("Engine precision (issue #7)") == "engine-precision-issue-7"
    assert anchor("`make run` stop and restart (issue #17)") == "make-run-stop-and-restart-issue-17"
    assert anchor("Coding agents: the Responses API (Codex CLI, OpenAI Agents SDK)") == (
        "coding-agents-the-responses-api-codex-cli-openai-agents-sdk"
    )


@pytest.mark.parametrize("doc", _DOCS, ids=lambda p: str(p.relative_to(_ROOT)))
def test_every_relative_link_resolves(doc: Path):
    broken = []
    for target in _LINK.findall(_SPAN.sub("", _FENCE.sub("", doc.read_text()))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, fragment = target.partition("#")
        linked = (doc.parent / file).resolve() if file else doc
        if not linked.exists():
            broken.append(f"{target}: no {file}")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{target}: no heading #{fragment} in {linked.name}")
    assert broken == [], f"{doc.name}: broken links"


def test_a_stale_citation_is_found_and_a_true_one_is_not():
    tree = {
        "gateway/",
        "gateway/api/",
        "gateway/api/wire.py",
        "gateway/http/",
        "gateway/http/sse.py",
    }
    text = (
        "`gateway/api/wire.py`, `api/wire.py`, `sse.py`, `gateway/api/`, `python -m gateway`, "
        "`/v1/models`, `infermesh.tls`, `gateway/pb/x_pb2.py`, `vllm/v1/engine.py`, `ev/req`, "
        "`.../disable`, `DIR/ca.crt`\n"
        "`gateway/api/sampling.py`, `worker_svc/`, `api/sampling.py`, `nothere.py`, `http/`\n"
        "| `gateway/api/` | `wire.py`, `sse.py` |\n"
        "```\n`gateway/in_a_fence.py`\n```\n"
    )
    assert stale_citations(text, tree, {"gateway/pb/"}) == [
        "gateway/api/sampling.py",
        "worker_svc/",
        "api/sampling.py",
        "nothere.py",
        "sse.py",
    ]


@pytest.mark.parametrize("doc", _DOCS, ids=lambda p: str(p.relative_to(_ROOT)))
def test_every_cited_repository_path_exists(doc: Path):
    stale = stale_citations(doc.read_text(), tree_paths(_ROOT), ignored_places(_ROOT))
    assert stale == [], f"{doc.name} cites paths the repository does not have"
