"""fairseq-specdec: lossless speculative (draft-then-verify) decoding for fairseq.

Install without build isolation so that pip never pulls a second torch:

    pip install torch==2.13.0 cython numpy
    pip install --no-build-isolation -e .
"""
from setuptools import find_packages, setup

setup(
    name="fairseq-specdec",
    version="0.1.0",
    description="Speculative decoding (draft-then-verify) plugin for fairseq seq2seq models",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["fairseq_specdec", "fairseq_specdec.*"]),
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
    extras_require={"test": ["pytest"], "ct2": ["ctranslate2"]},
)
