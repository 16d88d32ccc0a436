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
