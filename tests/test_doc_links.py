"""The docs' cross-references lead somewhere: a link between docs pages names a page and a heading that exist,
and a page that points the reader to a pattern has it there."""

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
LINK = re.compile(r"\]\((?!https?:)([\w./-]*\.md)?(?:#([\w-]+))?\)")


def slug(title: str) -> str:
    """A heading's anchor as MyST makes it (docs/conf.py: myst_heading_anchors), GitHub's rule."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower().replace(" ", "-"))


def sections(page: Path) -> dict[str, str]:
    """``{anchor: the section's text}`` of the page's headings (# to ###), code blocks skipped."""
    found, anchor, fenced = {}, None, False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        heading = None if fenced else re.match(r"^#{1,3} (.+)$", line)
        if heading:
            anchor = slug(heading.group(1))
            found[anchor] = ""
        elif anchor is not None:
            found[anchor] += line + "\n"
    return found


def test_every_link_between_docs_pages_leads_to_a_page_and_a_heading_that_exist():
    broken = []
    for page in sorted(DOCS.glob("*.md")):
        for match in LINK.finditer(page.read_text()):
            target = page if not match.group(1) else (page.parent / match.group(1))
            if not target.exists():
                broken.append(f"{page.name}: {match.group(0)} (no page)")
            elif match.group(2) and match.group(2) not in sections(target):
                broken.append(f"{page.name}: {match.group(0)} (no such heading in {target.name})")
    assert not broken, broken


def test_the_checkpoints_page_has_the_requeue_pattern_it_refers_to():
    """It said "the SLURM requeue pattern below", and nothing below was one."""
    page = (DOCS / "checkpoints.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `--resume` of a run that already finished"))
    anchor = LINK.search(row).group(2)
    section = sections(DOCS / "checkpoints.md")[anchor]
    assert "--resume" in section and "--checkpoint-dir" in section and "already finished" in section
    target = re.search(r"\]\((cluster\.md)#([\w-]+)\)", section)
    assert "#SBATCH" in sections(DOCS / target.group(1))[target.group(2)]
