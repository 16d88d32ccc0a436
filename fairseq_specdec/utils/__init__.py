"""The package's lowest layer: what models, the generation loop, the task and
the benchmark share, importing none of them.

* :mod:`.dictionary`: the drafter's mask symbol and the dictionary checks;
* :mod:`.encoder_out`: reading fairseq's encoder output, its output length limit;
* :mod:`.rowgemm`: the row-blocked product kernel (the C++ extension) and
  the fused decoder layer;
* :mod:`.projection`: derived weight layouts (transposed, packed) and the
  owner of each, :class:`~.projection.DerivedWeight`.
"""
