"""The documentation agrees with the code: the configuration reference is what the config's
docstrings generate, every key has one, every link between the documents leads somewhere,
and CI runs the test command the README gives."""

from __future__ import annotations

import re
from pathlib import Path

from engine.config_docs import markdown, reference

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_configuration_reference_is_generated_from_the_code() -> None:
    written = (ROOT / "docs" / "configuration.md").read_text()
    assert written == markdown(reference()), (
        "docs/configuration.md differs from engine/config.py's docstrings: "
        "regenerate it with python -m engine.config_docs > docs/configuration.md"
    )


def test_every_section_and_key_has_a_summary() -> None:
    missing = [f"{s.name}.{k.name}" for s in reference() for k in s.keys if not k.summary]
    missing += [s.name for s in reference() if not s.summary]
    assert not missing, f"write a docstring (its first paragraph a summary) for: {', '.join(missing)}"


def test_every_relative_link_leads_to_a_file_and_heading() -> None:
    broken = []
    for document in DOCUMENTS:
        text = document.read_text()
        for target in re.findall(r"\]\(([^)#:\s]*)(#[^)\s]*)?\)", text):
            path, anchor = target
            linked = (document.parent / path).resolve() if path else document
            if not linked.exists():
                broken.append(f"{document.name} -> {path}")
            elif anchor and linked.suffix == ".md" and anchor[1:] not in anchors(linked.read_text()):
                broken.append(f"{document.name} -> {path}{anchor}")
    assert not broken, f"links that lead nowhere: {broken}"


def anchors(markdown_text: str) -> set[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", markdown_text, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    command = re.search(r'^pip install (torch==\S+ -e "\.\[test\]") && pytest$', readme, flags=re.MULTILINE)
    assert command, "README.md's set-up gives the test command as: pip install ... && pytest"
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"pip install (--quiet )?{re.escape(command[1])}$", ci, flags=re.MULTILINE), command[1]
    assert re.search(r"^(python -m )?pytest$", ci, flags=re.MULTILINE), "CI runs pytest as the README does"
