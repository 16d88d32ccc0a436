"""The benchmark harness: decoders built as ``fairseq-generate`` builds them,
timed one per process, scored and plotted.

``scripts/benchmark.py`` is :func:`fairseq_specdec.bench.cli.main`;
``scripts/profile-draft-verify.py`` is :func:`fairseq_specdec.bench.profiling.main`;
``scripts/learning-curve.py`` is :func:`fairseq_specdec.bench.learning_curve.main`.

* :mod:`.loading`  ``load_decoder``: task, models, generator and batches of one row spec
* :mod:`.timing`   ``run_worker``: warm-up, the timed pass, statistics of the timed pass only (every engine's warm-up and timed loop)
* :mod:`.worker`   the worker process (``python -m fairseq_specdec.bench.worker SPEC.json``)
* :mod:`.workers`  ``WorkerProcess`` and ``run_specs``, the scheduler with its filler
* :mod:`.specs`    row specs: beam 5/1, strict/relaxed per drafter, every registered decoding, sweeps
* :mod:`.scoring`  detokenize, sacreBLEU and tokenized BLEU, reference files
* :mod:`.plots`    the PNG plots
* :mod:`.cli`      options, checks, the table and the result files
* :mod:`.profiling` where decoding time goes, component by component
* :mod:`.ct2`      the optional CTranslate2 rows (the verifier converted, greedy)
* :mod:`.learning_curve` Tok. and ms/sentence against drafter training minutes, per checkpoint
"""
