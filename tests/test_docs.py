"""The documentation a user reads: the option reference is generated from the
code and up to date, every relative link in the README and docs/ leads to a
file, and nothing names a path of the machine the docs were written on."""
import re
import subprocess
import sys

import specdec_helpers as H

DOCS = [H.ROOT / "README.md"] + sorted((H.ROOT / "docs").rglob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_option_reference_is_generated_from_the_code_and_current():
    proc = subprocess.run([sys.executable, str(H.ROOT / "scripts" / "options-doc.py"), "--check"],
                          capture_output=True, text=True, timeout=300, cwd=H.ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_option_reference_lists_every_option_of_the_plugin():
    """Each dataclass field with a help string has its row (the generator
    cannot silently skip one)."""
    import dataclasses

    import fairseq_specdec  # noqa: F401
    from fairseq_specdec.tasks.draft_verify import DraftVerifyConfig
    from fairseq_specdec.models.specdec_vsd import SpecDecVSDConfig
    from fairseq_specdec.criterions.glat_block import GlatBlockConfig

    text = (H.ROOT / "docs" / "options.md").read_text()
    for name in ("drafter_path", "specdec_backend", "specdec_stats", "block_size"):
        assert f"| `--{name.replace('_', '-')}" in text, name
    for config in (SpecDecVSDConfig, GlatBlockConfig):
        for field in dataclasses.fields(config):
            if (field.metadata or {}).get("help"):
                assert f"| `--{field.name.replace('_', '-')}" in text, field.name
    assert "drafter_path" in DraftVerifyConfig.__dataclass_fields__


def test_every_relative_link_leads_to_a_file():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{doc.relative_to(H.ROOT)}: {target}")
    assert not broken, broken


def test_no_path_of_the_build_machine_and_no_internal_numbering():
    """Users cannot know a checkout directory, a work period or an unlinked
    issue number; the papers are cited by name."""
    bad = re.compile(r"/work/|/tmp/[a-z]|/home/|\b[Ss]ession \d|\bissue \d|\bpaper 00\d")
    found = [f"{doc.relative_to(H.ROOT)}:{i}: {line.strip()[:80]}"
             for doc in DOCS for i, line in enumerate(doc.read_text().splitlines(), 1) if bad.search(line)]
    assert not found, found


def test_no_path_of_the_build_machine_in_the_package_and_scripts():
    """Docstrings and comments of the code a user runs name no directory of
    the machine they were written on, and no work period."""
    bad = re.compile(r"/work/|/home/|\b[Ss]ession[- ]\d|\bpaper 00\d")
    files = sorted((H.ROOT / "fairseq_specdec").rglob("*.py")) + sorted((H.ROOT / "scripts").glob("*"))
    files += sorted((H.ROOT / "configs").glob("*.sh")) + [H.ROOT / "Makefile", H.ROOT / "setup.py"]
    found = [f"{f.relative_to(H.ROOT)}:{i}: {line.strip()[:80]}" for f in files if f.is_file()
             for i, line in enumerate(f.read_text().splitlines(), 1) if bad.search(line)]
    assert not found, found


# ---------------------------------------------------------------- the README a user reads first

README = H.ROOT / "README.md"
FIGURE = re.compile(r"\b\d+\.\d\dx\b")


def test_readme_is_short_with_a_table_of_contents_and_the_two_commands_near_the_top():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    top = "\n".join(lines[:80])
    assert "make demo" in top and "make test" in top
    # every section has its entry in the table of contents, before the first section
    headings = [line[3:].strip() for line in lines if line.startswith("## ")]
    first = next(i for i, line in enumerate(lines) if line.startswith("## "))
    contents = "\n".join(lines[:first])
    assert len(headings) >= 6, headings
    for heading in headings:
        anchor = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        assert f"](#{anchor})" in contents, f"no table-of-contents entry for '## {heading}' (#{anchor})"


def test_every_figure_of_the_readme_is_in_a_report_it_links():
    """Each speed ratio "N.NNx" the README states occurs verbatim in one of
    the docs/results reports the README links (not an older run's report it
    does not name, not a figure computed by hand)."""
    text = README.read_text()
    reports = {target.split("#", 1)[0] for target in LINK.findall(text)
               if target.startswith("docs/results/") and target.split("#", 1)[0].endswith(".md")
               and not target.split("#", 1)[0].endswith("README.md")}
    assert reports, "the README links no report of docs/results"
    linked = "\n".join((H.ROOT / report).read_text() for report in sorted(reports))
    figures = sorted(set(FIGURE.findall(text)))
    assert len(figures) >= 10, figures
    missing = [f for f in figures if not re.search(rf"(?<![\d.]){re.escape(f)}", linked)]
    assert not missing, f"figures of the README in none of the reports it links ({sorted(reports)}): {missing}"


def test_user_docs_name_no_lending_arrangement():
    """The limits of a machine the project borrowed for a run (its lending,
    the length of a call, what travels with it) are no user's limits. The
    check is the plain case-insensitive grep, so words that contain "lent"
    (equivalent, silently, ...) are reworded too."""
    docs = [README] + sorted((H.ROOT / "docs").glob("*.md"))
    proc = subprocess.run(["grep", "-ri", "-n", "-E", "lent|10-minute call|MiB that travel", *map(str, docs)],
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout[:3000]


DATE = re.compile(r"\b(19|20)\d\d-[01]\d(-[0-3]\d)?\b|\b(January|February|March|April|May|June|July|August"
                  r"|September|October|November|December) (\d{1,2}, )?(19|20)\d\d\b")


def test_no_heading_outside_the_results_has_a_date():
    """The docs are organised by topic; dated runs belong in docs/results/."""
    skip = {".venv", ".git", "node_modules", "build", "dist", ".pytest_cache", "runs", "data"}
    found = []
    for doc in sorted(H.ROOT.rglob("*.md")):
        rel = doc.relative_to(H.ROOT)
        if set(rel.parts[:-1]) & skip or rel.parts[:2] == ("docs", "results"):
            continue
        in_code = False
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            if line.startswith("```"):
                in_code = not in_code
            elif not in_code and line.startswith("#") and DATE.search(line):
                found.append(f"{rel}:{i}: {line}")
    assert not found, found


def test_license_citation_and_references():
    """The README points to the license and the citation file, and cites the
    papers whose methods the plugin implements."""
    text = README.read_text()
    assert "(LICENSE)" in text and "(CITATION.cff)" in text
    for url in ("openreview.net/forum?id=H-VlwsYvVi", "arxiv.org/abs/2203.16487", "2023.findings-emnlp.257",
                "arxiv.org/abs/2205.10350", "arxiv.org/abs/1811.03115"):
        assert url in text, url


def test_benchmarking_lists_every_native_part():
    """docs/benchmarking.md's table of FAIRSEQ_SPECDEC_OFF names exactly the
    parts the package knows (a removed part leaves the table too)."""
    import re

    from fairseq_specdec.kernels import PARTS

    text = (H.ROOT / "docs" / "benchmarking.md").read_text()
    section = text.split("## Measuring the native parts", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([a-z0-9]+)` \|", section, re.M))
    assert listed == set(PARTS)
