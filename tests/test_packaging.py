"""The package installs like one: the version is written once, the sdist
carries every source the install compiles, and an sdist installed into a
fresh virtual environment (torch already there, as the README's install
has it) decodes a toy model from outside the checkout."""
import os
import re
import sys
import sysconfig
import tarfile

import pytest

import specdec_helpers as H


def test_version_is_written_once():
    """setup.py reads fairseq_specdec/version.py; no other file spells the version."""
    from fairseq_specdec.version import __version__

    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    setup = (H.ROOT / "setup.py").read_text()
    assert "read_version()" in setup and __version__ not in setup
    import fairseq_specdec

    assert fairseq_specdec.__version__ == __version__
    proc = H.run([sys.executable, "setup.py", "--version"], cwd=H.ROOT)
    assert proc.stdout.strip().splitlines()[-1] == __version__


def test_license_and_citation():
    license_text = (H.ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT License") and "the fairseq-specdec authors" in license_text
    import yaml

    from fairseq_specdec.version import __version__

    citation = yaml.safe_load((H.ROOT / "CITATION.cff").read_text())
    assert citation["cff-version"] and citation["type"] == "software" and citation["license"] == "MIT"
    assert citation["version"] == __version__
    titles = " | ".join(ref["title"] for ref in citation["references"])
    for paper in ("Lossless Speedup of Autoregressive Translation", "Exploiting Speculative Execution",
                  "Aggressive Decoding", "Blockwise Parallel Decoding"):
        assert paper in titles, paper


def build_sdist(out_dir):
    """python -m build --sdist, without an isolated environment (no download)."""
    H.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", out_dir, str(H.ROOT)],
          timeout=600)
    (sdist,) = [p for p in os.listdir(out_dir) if p.endswith(".tar.gz")]
    return os.path.join(out_dir, sdist)


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    return build_sdist(str(tmp_path_factory.mktemp("dist")))


def test_sdist_carries_the_sources_the_install_compiles(sdist):
    """Every C++ source of the checkout's package (wherever it lives in the
    package) and the files setup.py reads are in the sdist."""
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    sources = {str(p.relative_to(H.ROOT)) for ext in ("*.cpp", "*.h")
               for p in (H.ROOT / "fairseq_specdec").rglob(ext)}
    assert sources, "no C++ source found in the checkout"
    assert sources <= names, sorted(sources - names)
    for name in ("setup.py", "README.md", "LICENSE", "CITATION.cff", "fairseq_specdec/version.py"):
        assert name in names, name


@pytest.mark.slow
def test_sdist_installs_into_a_fresh_venv_and_decodes(sdist, toy_bin, ar_checkpoint, tmp_path):
    """A fresh venv that sees the running one's packages (torch and fairseq
    already installed, as after the README's first install line) installs the
    sdist with pip --no-build-isolation --no-deps; that copy, not the
    checkout, is imported from a directory outside the checkout and decodes
    the toy test split as stock fairseq --beam 1 does.  The install skips
    the C++ extension (FAIRSEQ_SPECDEC_NO_EXT=1, documented in setup.py):
    compiling it is two minutes of the suite, the checkout's install compiles
    the same sources with the same setup.py, and the test above checks that
    every one of them is in the sdist; so the decoding here runs the plugin
    without its extension, as on a machine without a compiler."""
    venv = tmp_path / "venv"
    H.run([sys.executable, "-m", "venv", venv])
    python = venv / "bin" / "python"
    site = H.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    # the running venv's site-packages after the fresh one's own (a plain path:
    # its .pth files, the checkout's editable install among them, are not read)
    with open(os.path.join(site, "running-venv.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    # nothing on PYTHONPATH (a checkout there would be imported instead of the install)
    alone = {"PYTHONPATH": ""}
    H.run([python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index", sdist],
          timeout=900, cwd=tmp_path, env=dict(alone, FAIRSEQ_SPECDEC_NO_EXT="1"))

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    probe = ("import os, fairseq_specdec; d = os.path.dirname(fairseq_specdec.__file__); "
             "print(d); print(fairseq_specdec.__version__); "
             "print(any(n.endswith('.so') for _, _, fs in os.walk(d) for n in fs))")
    package_dir, version, has_extension = H.run([python, "-c", probe], cwd=outside, env=alone).stdout.split()
    assert os.path.realpath(package_dir).startswith(os.path.realpath(site)), package_dir
    assert not os.path.realpath(package_dir).startswith(os.path.realpath(H.ROOT))
    from fairseq_specdec.version import __version__

    assert version == __version__
    assert has_extension == "False", "FAIRSEQ_SPECDEC_NO_EXT=1 did not skip the extension"

    def generate(*extra):
        cmd = [python, "-c", "from fairseq_cli.generate import cli_main; cli_main()", toy_bin,
               "--path", ar_checkpoint, "--gen-subset", "test", "--beam", "1", "--batch-size", "8", "--cpu", *extra]
        return H.parse_generate(H.run(cmd, cwd=outside, env=alone).stdout)

    # fairseq's own task and decoder (the plugin loaded for its safe checkpoint loader only)
    ref = generate("--user-dir", package_dir, "--task", "translation", "--required-batch-size-multiple", "1")
    got = generate("--user-dir", package_dir, "--task", "draft_verify", "--decoding", "loop-greedy")
    assert sorted(ref) == list(range(H.SPLIT_SIZES["test"]))
    H.assert_same_hypotheses(ref, got)
