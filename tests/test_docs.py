"""The README's and docs/' links lead somewhere: every relative link names a file of the
repository and, with a #fragment, a heading of that file (as GitHub makes anchors of headings)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

_ROOT = Path(__file__).parents[1]
_DOCS = [_ROOT / "README.md", *sorted((_ROOT / "docs").rglob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


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
    for target in _LINK.findall(_FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, fragment = target.partition("#")
        linked = (doc.parent / file).resolve() if file else doc
        if not linked.exists():
            broken.append(f"{target}: no {file}")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{target}: no heading #{fragment} in {linked.name}")
    assert broken == [], f"{doc.name}: broken links"
