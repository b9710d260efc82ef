"""The documentation's pages, parsed once for the docs tests (test_readme.py, test_readme_commands.py): the README,
then docs/README.md (the index), then the pages of docs/ in the order the index links them."""

import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
INDEX = REPO / "docs" / "README.md"

# Pages the index links before the change that writes them lands: a link to one is not followed while it is missing.
# Once the page exists, test_readme fails until its entry here is removed (and the page is then tested like the rest).
PENDING: dict[str, str] = {}


@functools.cache
def text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def outside_code(page: Path) -> str:
    """The page without its fenced code blocks (their lines blanked, so line numbers stay)."""
    return re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text(page), flags=re.S)


def links(page: Path) -> list[str]:
    """The targets of the page's Markdown links, in order (not those inside code)."""
    return re.findall(r"\]\(([^)\s]+)\)", outside_code(page))


def local_target(page: Path, target: str) -> tuple[Path, str] | None:
    """(file, anchor) of a link within the repository, or None for a link elsewhere (http, mailto)."""
    if re.match(r"[a-z]+:", target):
        return None
    path, _, anchor = target.partition("#")
    return (page.parent / path).resolve() if path else page, anchor


@functools.cache
def pages() -> tuple[Path, ...]:
    """README, the index, then every page the index links under docs/ (existing ones), in the index's order."""
    found = [README, INDEX]
    for target in links(INDEX):
        local = local_target(INDEX, target)
        if local and local[0].suffix == ".md" and local[0].parent == INDEX.parent and local[0].is_file():
            if local[0] not in found:
                found.append(local[0])
    return tuple(found)


def code_blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text(page), re.S)


def headings(page: Path) -> list[tuple[int, str]]:
    """(level, text) of the page's headings, outside code."""
    return [(len(hashes), title.strip()) for hashes, title in re.findall(r"^(#{1,6}) (.+)$", outside_code(page), re.M)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation and symbols dropped (letters, digits, '-', '_' and
    spaces kept), each space a '-'."""
    return "".join(ch for ch in heading.lower() if ch.isalnum() or ch in " -_").replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for _, title in headings(page):
        base = slug(title)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix()
