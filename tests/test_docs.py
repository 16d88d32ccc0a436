"""The documentation a user reads: the option reference is generated from the
code and up to date, every relative link in the README and docs/ leads to a
file, and nothing names a path of the machine the docs were written on.
The measured figures live in docs/performance.md, each copied from the run
report its section links; the topic pages link that page, never a dated
report; the archive of reports (docs/results/) marks every report that
names an option removed since."""
import re
import subprocess
import sys

import specdec_helpers as H

DOCS = [H.ROOT / "README.md"] + sorted((H.ROOT / "docs").rglob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_option_reference_is_generated_from_the_code_and_current():
    proc = H.run([sys.executable, H.ROOT / "scripts" / "options-doc.py", "--check"], check=False, timeout=300,
                 cwd=H.ROOT)
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


def test_every_figure_of_the_readme_is_in_the_performance_page():
    """Each speed ratio "N.NNx" the README states occurs verbatim in
    docs/performance.md (whose figures are copied from the reports it links,
    see below) or in a docs/results report the README links (not an older
    run's report it does not name, not a figure computed by hand)."""
    text = README.read_text()
    reports = {target.split("#", 1)[0] for target in LINK.findall(text)
               if target.startswith("docs/results/") and target.split("#", 1)[0].endswith(".md")
               and not target.split("#", 1)[0].endswith("README.md")}
    assert "docs/performance.md" in {target.split("#", 1)[0] for target in LINK.findall(text)}
    sources = "\n".join((H.ROOT / path).read_text() for path in sorted(reports | {"docs/performance.md"}))
    figures = sorted(set(FIGURE.findall(text)))
    assert len(figures) >= 10, figures
    missing = [f for f in figures if not _occurs(f, sources)]
    assert not missing, f"figures of the README in neither docs/performance.md nor a report it links: {missing}"


# ---------------------------------------------------------------- the performance page and the archive

PERFORMANCE = H.ROOT / "docs" / "performance.md"
RESULTS = H.ROOT / "docs" / "results"
#: a dated run report: docs/results/YYYY-MM-DD-<commit>-<name>.md
DATED_REPORT = re.compile(r"results/(20\d\d-[01]\d-[0-3]\d)-([0-9a-f]{7,40})-[\w.-]+\.md")
#: a figure: a number with a decimal point, a "%" or an "x", or an integer of two digits or more
#: ("1.33x", "29.7", "881", "1,139", "4.8.5"), not part of a word (a commit, "d256", "H200")
NUMBER = re.compile(r"(?<![\w.,/])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)*(?:x|%)?(?!\w)")
DAY = re.compile(r"\b(19|20)\d\d-[01]\d-[0-3]\d\b")
MACHINE = re.compile(r"AMD EPYC|Intel Xeon|NVIDIA H\d00")


def _occurs(figure, text):
    """``figure`` occurs verbatim in ``text``, not as part of a longer number
    ("1.3x" is not in "1.33x", "29.7" not in "29.79" nor in "129.7")."""
    return re.search(rf"(?<![\d.,]){re.escape(figure)}(?!\d|\.\d|,\d{{3}})", text) is not None


def _figures(text):
    """The figures of a Markdown text: dates, link targets and links within
    the page (a section's name) left out."""
    text = re.sub(r"\[[^\]]*\]\(#[^)]*\)", " ", text)
    text = DAY.sub(" ", re.sub(r"\]\([^)]*\)", "]", text))
    return [m.group(0) for m in NUMBER.finditer(text) if not re.fullmatch(r"\d", m.group(0))]


def _dated_reports(text):
    """The docs/results reports a text of docs/ links, as paths relative to docs/."""
    return [target.split("#", 1)[0] for target in LINK.findall(text) if DATED_REPORT.fullmatch(target.split("#", 1)[0])]


def _sections(text):
    """The preamble and each "## " section of a Markdown text: (heading, body)."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return [("", parts[0])] + list(zip(parts[1::2], parts[2::2]))


def _anchor(heading):
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _performance_problems(text):
    problems = []
    for heading, body in _sections(text):
        if not heading:
            problems += [f"a figure before the first section: {f}" for f in _figures(body)]
            continue
        reports = _dated_reports(body)
        if not reports:
            problems.append(f"## {heading}: links no report of docs/results")
            continue
        plain = re.sub(r"\]\([^)]*\)", "]", body)
        for report in reports:
            day, commit = DATED_REPORT.fullmatch(report).groups()
            if day not in plain or commit not in plain:
                problems.append(f"## {heading}: does not name the date and the commit of {report}")
        if not MACHINE.search(body):
            problems.append(f"## {heading}: names no machine")
        texts = {report: (PERFORMANCE.parent / report).read_text() for report in reports}
        for line in body.splitlines():
            # a line that links reports (a table row, a sentence) is checked against those; the rest
            # against every report its section links
            own = _dated_reports(line) or reports
            for figure in _figures(line):
                if not any(_occurs(figure, texts[report]) for report in own):
                    problems.append(f"## {heading}: {figure} is in none of {sorted(set(own))} ({line.strip()[:60]})")
    return problems


def test_every_figure_of_the_performance_page_is_in_the_report_its_section_links():
    """docs/performance.md states current figures only as copied from a run's
    report: each "## " section links its reports, names their date, commit
    and machine, and each of its figures occurs verbatim in a report it links
    (in the reports of its own line where the line links some)."""
    text = PERFORMANCE.read_text()
    assert len(_sections(text)) >= 8
    problems = _performance_problems(text)
    assert not problems, problems


def test_no_topic_page_links_a_dated_report():
    """The topic pages (docs/*.md, the README) do not age with the runs: they
    link the sections of docs/performance.md, never a dated report of
    docs/results/ (the archive's index, docs/results/README.md, they may),
    and every section they link exists."""
    pages = [README] + [doc for doc in sorted((H.ROOT / "docs").glob("*.md")) if doc != PERFORMANCE]
    anchors = {_anchor(heading) for heading, _ in _sections(PERFORMANCE.read_text()) if heading}
    dated, unknown = [], []
    for page in pages:
        text = page.read_text()
        dated += [f"{page.relative_to(H.ROOT)}: {m.group(0)}" for m in DATED_REPORT.finditer(text)]
        for target in LINK.findall(text):
            path, _, anchor = target.partition("#")
            if (page.parent / path).resolve() == PERFORMANCE.resolve() and anchor and anchor not in anchors:
                unknown.append(f"{page.relative_to(H.ROOT)}: {target}")
    assert not dated, dated
    assert not unknown, f"links to sections of performance.md that do not exist: {unknown}"


def _removed_options():
    """The options of docs/results/README.md's table "Options named in older
    reports", as written there (``--accept-impl``, ``--decoding ngram-draft``)."""
    text = (RESULTS / "README.md").read_text()
    section = text.split("## Options named in older reports", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `--")]
    return [re.match(r"\| `([^`]+)`", row).group(1) for row in rows]


def _names(option, text):
    """``text`` names ``option`` as a whole word ("--draft-tree" does not name
    "--draft-tree-x"; "--decoding ngram-draft" also as "--decoding=ngram-draft")."""
    words = option.split()
    pattern = r"[ =]".join(map(re.escape, words))
    return re.search(rf"(?<![\w-]){pattern}(?![\w-])", text) is not None


def _marked_rows():
    """Each row of the archive's index: (the reports it links, the removed options it marks)."""
    text = (RESULTS / "README.md").read_text()
    index = text.split("## Options named in older reports", 1)[0]
    rows = []
    for line in index.splitlines():
        if re.match(r"\| 20\d\d-", line):
            files = {target.split("#", 1)[0] for target in LINK.findall(line) if DATED_REPORT.fullmatch("results/" + target)}
            marked = re.search(r"names removed: ((?:`[^`]+`(?:, )?)+)", line)
            rows.append((files, set(re.findall(r"`([^`]+)`", marked.group(1))) if marked else set()))
    return rows


def test_the_removed_options_are_gone():
    """Every option of the archive's table of removed options is no option
    today: not in fairseq-generate's or fairseq-train's options with the
    plugin's task, architectures and criteria, not in docs/options.md, not a
    decoding, and not in the source of the package or of its scripts."""
    import fairseq_specdec  # noqa: F401
    from fairseq import options

    removed = _removed_options()
    assert len(removed) >= 7, removed
    current = set()
    parser = options.get_generation_parser()
    options.parse_args_and_arch(parser, ["data", "--user-dir", H.USER_DIR, "--task", "draft_verify", "--cpu"])
    current |= set(parser._option_string_actions)
    for arch, criterion in (("specdec_vsd", "glat_block"), ("specdec_nat_tiny", "glat_block"),
                            ("blockwise_transformer", "blockwise_heads")):
        parser = options.get_training_parser()
        options.parse_args_and_arch(parser, ["data", "--user-dir", H.USER_DIR, "--task", "draft_verify",
                                             "--arch", arch, "--criterion", criterion])
        current |= set(parser._option_string_actions)
    assert {"--decoding", "--specdec-backend", "--draft-tree", "--init-from-verifier"} <= current
    reference = (H.ROOT / "docs" / "options.md").read_text()
    decodings = set(re.findall(r"^\| `([a-z0-9+-]+)`", reference.split("## Decodings", 1)[1].split("\n## ", 1)[0], re.M))
    assert {"ngram", "self-draft", "loop-greedy"} <= decodings
    code = [f for f in sorted((H.ROOT / "fairseq_specdec").rglob("*.py")) + sorted((H.ROOT / "scripts").glob("*"))
            if f.is_file()]
    sources = "\n".join(f.read_text() for f in code)
    still = []
    for option in removed:
        flag, *value = option.split()
        if value:
            if flag != "--decoding" or value[0] in decodings or _names(option, sources):
                still.append(option)
        elif flag in current or f"`{flag}" in reference or _names(flag, sources):
            still.append(option)
    assert not still, f"options of the removed-options table that exist today: {still}"


def test_the_archive_marks_every_report_that_names_a_removed_option():
    """docs/results/README.md lists every report, and each index row marks
    ("names removed: `--option`") exactly the removed options its reports
    name: a report that names one is marked, and no row is marked for an
    option its reports do not name."""
    removed = _removed_options()
    rows = _marked_rows()
    listed = set().union(*(files for files, _ in rows))
    reports = {path.name for path in RESULTS.glob("20*.md")}
    assert reports == listed, f"reports the index does not list: {sorted(reports - listed)}; " \
                              f"listed but missing: {sorted(listed - reports)}"
    wrong = []
    for files, marked in rows:
        named = {option for option in removed for name in files if _names(option, (RESULTS / name).read_text())}
        if named != marked:
            wrong.append(f"{sorted(files)}: names {sorted(named)}, marked {sorted(marked)}")
    assert not wrong, wrong
    assert any(marked for _, marked in rows)


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
