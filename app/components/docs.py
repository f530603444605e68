"""The project's documentation the app shows: the verdict rule of docs/verdicts.md, the sections of
docs/deployment-whatifs.md the Deployment page's tabs open, and the experts sweep table the Learn page
draws. Read from the installed copy or the checkout's docs/ (`moeviz.resources.bundled_path("docs")`: the
wheel ships exactly these files). No Streamlit here.
"""

from __future__ import annotations

from moeviz.resources import bundled_path

DOCS = bundled_path("docs")
VERDICTS = DOCS / "verdicts.md"
DEPLOYMENT_WHATIFS = DOCS / "deployment-whatifs.md"
EXPERTS_SWEEP = DOCS / "experts-sweep.csv"
# docs/verdicts.md from its "## The rule" section up to (without) its measured false-alarm rates
VERDICT_RULE_FROM, VERDICT_RULE_TO = "## The rule", "## Measured false-alarm rates"


def verdict_rule() -> str:
    """The rule, null and sample-size sections of docs/verdicts.md ("" when the docs are not there)."""
    if not VERDICTS.is_file():
        return ""
    text = VERDICTS.read_text(encoding="utf-8")
    start, end = text.find(VERDICT_RULE_FROM), text.find(VERDICT_RULE_TO)
    return text[start : end if end > start else None].strip() if start >= 0 else ""


def deployment_section(heading: str) -> str:
    """The first `## ` section of docs/deployment-whatifs.md whose title contains `heading` (any case), up to
    the next `## `, its headings two levels smaller (it is shown inside an expander); "" when the docs are
    not there or have no such section."""
    if not DEPLOYMENT_WHATIFS.is_file():
        return ""
    sections = DEPLOYMENT_WHATIFS.read_text(encoding="utf-8").split("\n## ")
    for section in sections[1:]:
        if heading.lower() in section.partition("\n")[0].lower():
            text = f"## {section.strip()}"
            return "\n".join(f"##{line}" if line.startswith("#") else line for line in text.splitlines())
    return ""
