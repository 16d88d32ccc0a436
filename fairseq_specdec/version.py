"""The version of fairseq-specdec: the one place it is written.

``setup.py`` reads it without importing the package (an import would need
fairseq and torch), and ``fairseq_specdec.__version__`` re-exports it.
"""
__version__ = "0.1.0"
