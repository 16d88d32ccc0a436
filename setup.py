"""fairseq-specdec: lossless speculative (draft-then-verify) decoding for fairseq.

Install without build isolation so that pip never pulls a second torch:

    pip install torch==2.13.0 cython numpy
    pip install --no-build-isolation -e .

The install compiles one small C++ extension, ``fairseq_specdec.kernels._native``
(the verify pass's row-blocked products, docs/verify-kernels.md), with the
C++ compiler torch uses (gcc here).  It is optional: when it cannot be built
the install still succeeds, says so, and the plugin uses torch's products;
``FAIRSEQ_SPECDEC_NO_EXT=1`` skips it.
"""
import os
import re
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def read_version():
    """The version written once, in fairseq_specdec/version.py (read, not
    imported: importing the package needs fairseq)."""
    with open(os.path.join(HERE, "fairseq_specdec", "version.py"), encoding="utf-8") as f:
        match = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M)
    if match is None:
        raise RuntimeError("fairseq_specdec/version.py has no line __version__ = \"X.Y.Z\"")
    return match.group(1)


ext_modules, cmdclass = [], {}
if os.environ.get("FAIRSEQ_SPECDEC_NO_EXT", "") not in ("1", "true", "yes"):
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:  # torch is installed first (see above); without it, no extension
        print("WARNING: fairseq_specdec: torch is not importable at build time, so the C++ extension "
              "fairseq_specdec.kernels._native is not built; install torch first and use --no-build-isolation",
              file=sys.stderr)
        BuildExtension = None
    if BuildExtension is not None:

        class OptionalBuildExtension(BuildExtension):
            """Builds the extension, or warns and goes on without it."""

            def build_extension(self, ext):
                try:
                    super().build_extension(ext)
                except Exception as error:  # noqa: BLE001 - any compiler failure
                    print(
                        f"WARNING: fairseq_specdec: the C++ extension {ext.name} was not built ({error}); "
                        "the plugin will use torch's products (--specdec-backend auto then runs the reference path on a CPU)",
                        file=sys.stderr,
                    )

        ext_modules = [
            CppExtension(
                "fairseq_specdec.kernels._native",
                ["fairseq_specdec/kernels/csrc/rowgemm.cpp", "fairseq_specdec/kernels/csrc/rowgemm_avx512.cpp",
                 "fairseq_specdec/kernels/csrc/rowgemm_avx512_emulated.cpp", "fairseq_specdec/kernels/csrc/step.cpp"],
                extra_compile_args=["-O3"],
            )
        ]
        cmdclass = {"build_ext": OptionalBuildExtension.with_options(use_ninja=False)}

setup(
    name="fairseq-specdec",
    version=read_version(),
    description="Speculative decoding (draft-then-verify) plugin for fairseq seq2seq models",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    packages=find_packages(include=["fairseq_specdec", "fairseq_specdec.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    install_requires=[
        "torch==2.13.0",
        "fairseq-fixed==0.12.3.1",
        "numpy",
        "sacrebleu>=2.0",
        "sacremoses",
        "subword-nmt",
        "matplotlib",
        "tqdm",
    ],
    # ct2: the optional CTranslate2 rows of the benchmark (--rows ...,ct2); never a dependency
    # test: pytest, and build for the packaging test (python -m build)
    extras_require={"test": ["pytest", "pytest-xdist>=3.8", "filelock", "build"], "ct2": ["ctranslate2"]},
)
