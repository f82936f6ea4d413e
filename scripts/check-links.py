#!/usr/bin/env python3
"""Checks the links of the README and the manual (Python standard library only).

    scripts/check-links.py            check README.md and docs/**/*.md
    scripts/check-links.py --root DIR the same for another checkout

For every Markdown file checked:

- every relative link (inline, image, reference definition) must name a file
  or directory of the repository, without leaving it;
- every `#anchor`, on its own or after a link to a Markdown file, must be a
  heading of that file as GitHub names it (lowercased; punctuation and
  symbols dropped; spaces to hyphens; a repeated heading gets -1, -2, ...);
- every http(s) link must be well-formed (a scheme, a host, no spaces). CI
  has no general internet, so none is fetched.

And every page under docs/ must be reachable from docs/README.md by links
between the pages of docs/.

Links inside code (fenced blocks and `code spans`) are text, not links.
Exits 1 and prints one `file:line: problem` per finding, else prints a
summary and exits 0.
"""

import argparse
import re
import sys
import unicodedata
from pathlib import Path
from urllib.parse import unquote, urlsplit

INDEX = Path("docs/README.md")

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
ATX_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
# `](target)` or `](<target>)`, with an optional title: the tail of every
# inline link and image, whatever its text holds.
INLINE_TARGET = re.compile(r"\]\(\s*(<[^>\n]*>|[^\s)]*)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
AUTOLINK = re.compile(r"<((?:https?|ftp|mailto):[^>\s]*)>", re.IGNORECASE)
HTML_ANCHOR = re.compile(r"<a\s[^>]*?(?:name|id)\s*=\s*\"([^\"]+)\"", re.IGNORECASE)
CODE_SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
HEADING_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")


def slug_base(heading: str) -> str:
    """GitHub's anchor for a heading's text, before de-duplication."""
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = HEADING_LINK.sub(lambda m: m.group(1), text)
    text = re.sub(r"<[^>]+>", "", text)
    kept = []
    for ch in text.strip().lower():
        category = unicodedata.category(ch)
        if ch in " -" or category[0] in "LNM" or category == "Pc":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


class Page:
    """One Markdown file: its anchors, and its links with their lines."""

    def __init__(self, path: Path, text: str):
        self.path = path
        self.anchors: set[str] = set()
        self.links: list[tuple[int, str]] = []
        self._read(text)

    def _read(self, text: str) -> None:
        counts: dict[str, int] = {}
        prose: list[tuple[int, str]] = []
        fence = None
        for number, line in enumerate(text.splitlines(), start=1):
            opening = FENCE.match(line)
            if fence is not None:
                if opening and opening.group(1)[0] == fence[0] and len(opening.group(1)) >= len(fence) \
                        and not line.strip()[len(opening.group(1)):].strip():
                    fence = None
                continue
            if opening:
                fence = opening.group(1)
                continue
            heading = ATX_HEADING.match(line)
            if heading:
                base = slug_base(heading.group(2))
                seen = counts.get(base, 0)
                counts[base] = seen + 1
                self.anchors.add(base if seen == 0 else f"{base}-{seen}")
            for anchor in HTML_ANCHOR.findall(line):
                self.anchors.add(anchor)
            prose.append((number, line))
        # Code spans may run over lines of one paragraph: blank them out a
        # paragraph at a time, keeping every character's line.
        paragraph: list[tuple[int, str]] = []
        for number, line in prose + [(0, "")]:
            if line.strip():
                paragraph.append((number, line))
                continue
            if paragraph:
                self._links_of(paragraph)
                paragraph = []

    def _links_of(self, paragraph: list[tuple[int, str]]) -> None:
        joined = "\n".join(line for _, line in paragraph)
        blanked = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), joined)
        starts = []
        offset = 0
        for number, line in paragraph:
            starts.append((offset, number))
            offset += len(line) + 1

        def line_at(position: int) -> int:
            number = paragraph[0][0]
            for start, n in starts:
                if start <= position:
                    number = n
            return number

        for m in INLINE_TARGET.finditer(blanked):
            self.links.append((line_at(m.start()), m.group(1).strip("<>")))
        for m in AUTOLINK.finditer(blanked):
            self.links.append((line_at(m.start()), m.group(1)))
        for i, line in enumerate(blanked.split("\n")):
            definition = REFERENCE_DEF.match(line)
            if definition:
                self.links.append((paragraph[i][0], definition.group(1).strip("<>")))


def well_formed_url(target: str) -> bool:
    parts = urlsplit(target)
    return bool(parts.scheme in ("http", "https") and parts.hostname and " " not in target
                and not any(ch in target for ch in "<>\"{}|\\^`"))


def check(root: Path) -> tuple[list[str], int, int]:
    """Returns (problems, links checked, pages checked)."""
    root = root.resolve()
    files = [root / "README.md"] + sorted((root / "docs").rglob("*.md"))
    files = [f for f in files if f.is_file()]
    pages: dict[Path, Page] = {}

    def page(path: Path) -> Page:
        if path not in pages:
            pages[path] = Page(path, path.read_text(encoding="utf-8"))
        return pages[path]

    problems: list[str] = []
    edges: dict[Path, set[Path]] = {}
    checked = 0
    for path in files:
        here = page(path)
        where = path.relative_to(root)
        edges[path] = set()
        for number, target in here.links:
            checked += 1
            at = f"{where}:{number}"
            if not target:
                problems.append(f"{at}: empty link target")
                continue
            scheme = urlsplit(target).scheme.lower()
            if scheme in ("http", "https"):
                if not well_formed_url(target):
                    problems.append(f"{at}: malformed URL {target!r}")
                continue
            if scheme == "mailto":
                continue
            if scheme:
                problems.append(f"{at}: unsupported link scheme in {target!r}")
                continue
            file_part, _, anchor = target.partition("#")
            file_part = unquote(file_part)
            anchor = unquote(anchor)
            if file_part:
                base = root if file_part.startswith("/") else path.parent
                resolved = (base / file_part.lstrip("/")).resolve()
                if resolved != root and root not in resolved.parents:
                    problems.append(f"{at}: {target!r} leaves the repository")
                    continue
                if not resolved.exists():
                    problems.append(f"{at}: {target!r}: no such file or directory")
                    continue
            else:
                resolved = path
            if resolved.is_file() and resolved.suffix == ".md":
                edges[path].add(resolved)
            if "#" in target:
                if not (resolved.is_file() and resolved.suffix == ".md"):
                    problems.append(f"{at}: {target!r}: an anchor on something that is not a Markdown file")
                elif anchor not in page(resolved).anchors:
                    problems.append(f"{at}: {target!r}: no heading with the anchor #{anchor} in "
                                    f"{resolved.relative_to(root)}")

    docs = root / "docs"
    index = root / INDEX
    if not index.is_file():
        problems.append(f"{INDEX}: the manual's index is missing")
    else:
        reached = {index}
        todo = [index]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if docs in nxt.parents and nxt not in reached:
                    reached.add(nxt)
                    todo.append(nxt)
        for path in files:
            if docs in path.parents and path not in reached:
                problems.append(f"{path.relative_to(root)}: not reachable from {INDEX}")
    return problems, checked, len(files)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the repository's root (default: this script's checkout)")
    args = parser.parse_args()
    problems, links, pages = check(args.root)
    for problem in problems:
        print(problem)
    if problems:
        print(f"check-links: {len(problems)} problem(s) in {links} links of {pages} pages", file=sys.stderr)
        return 1
    print(f"check-links: {links} links of {pages} pages: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
