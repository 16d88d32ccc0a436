"""Where decoding time goes: the plugin's loop against fairseq's greedy
decoder, component by component (the breakdown of Table 18 of the SpecDec ICLR 2023 submission).

Every decoder is built as ``fairseq-generate`` builds it
(:func:`fairseq_specdec.bench.loading.load_decoder`), with threads pinned, and
decodes the same sentences at ``--batch-size`` (default 1) after a warm-up: fairseq's ``--beam 1``,
then strict draft-verify with ``--drafter``, the blockwise heads of
``--blockwise``, greedy decoding through the loop (``--loop-greedy``),
n-gram drafting from the data directory's train split (``--ngram``) and
the verifier's int8 copy drafting (``--self-draft``), as given.  Each
component is timed around its call:

* greedy (``SequenceGenerator``, ``--beam 1``): encoder, decoder step (one
  token, vocabulary projection and log-softmax included), and everything else
  (search bookkeeping);
* the plugin's loop: verifier encoder, the drafter's start of a batch (own
  encoder, or memory from the verifier's: next to nothing when the drafter
  shares the verifier's encoder), the drafter's pass (prefix + k masks,
  projection; the blockwise heads' update from the verifier's state),
  verifier pass (k + 1 tokens over the KV cache), KV-cache rollback and row
  removal, and everything else (acceptance, bookkeeping, host transfers).

"other" is the decoder's total time minus its timed components.  Rows
marked "of which" are parts of the row above them (the vocabulary
projections) and are not subtracted twice; so is the row of the weight
checks (``WeightsWatch.changed``: whether the cached weight layouts are
current), made inside the encoder, the first verify pass of a batch and the
drafter's calls.  A component whose method does
not exist, or that the decoder never called (renamed in the generator), stops
the profile with its name, rather than leaving its time in "other" (only the
KV-cache rollback and row removal may go uncalled).

Example (the `make demo` models):
    scripts/profile-draft-verify.py --data runs/multi30k.en-de/distill/bin \\
        --verifier runs/multi30k.en-de/verifier/checkpoint_best.pt \\
        --drafter runs/multi30k.en-de/vsd/checkpoint_last.pt --limit 200 \\
        --blockwise runs/multi30k.en-de/blockwise/checkpoint_best.pt --loop-greedy
"""
import argparse
import json
import os
import sys
import time
from collections import defaultdict

from ..generation.drafters import TimedParts, TreeDrafter
from ..utils.projection import WeightsWatch
from .loading import load_decoder
from .timing import fairseq_decode, timed_batches, warm_up


class MissingComponent(AttributeError):
    """A component to time names a method that does not exist or is never called."""


class Timers:
    """Wall-clock milliseconds and call counts of wrapped methods."""

    def __init__(self):
        self.ms = defaultdict(float)
        self.calls = defaultdict(int)
        self.names = []  # in the order they were wrapped
        self.required = {}  # name -> "Owner.attr" of the components that must be called
        self.enabled = False

    def wrap(self, obj, attr: str, name: str, required: bool = True) -> None:
        """Time every call of ``obj.attr`` as ``name``; :class:`MissingComponent`
        naming the attribute if ``obj`` is None or has no callable ``attr``.
        A ``required`` component must be called (see :meth:`check_called`)."""
        fn = getattr(obj, attr, None) if obj is not None else None
        owner = "None" if obj is None else type(obj).__name__
        if not callable(fn):
            raise MissingComponent(
                f"cannot time '{name}': {owner} has no method {attr!r} (renamed? update the profiler's components)"
            )
        self.names.append(name)
        if required:
            self.required[name] = f"{owner}.{attr}"

        def timed(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ms[name] += (time.perf_counter() - t0) * 1000.0
                self.calls[name] += 1

        setattr(obj, attr, timed)

    def check_called(self) -> None:
        """:class:`MissingComponent` naming every required component never called."""
        idle = [f"'{name}' ({where})" for name, where in self.required.items() if not self.calls[name]]
        if idle:
            raise MissingComponent(
                f"never called while decoding: {', '.join(idle)} (the decoder calls something else now? "
                f"update the profiler's components)"
            )


def profile(spec, components, warmup: int):
    """Decode with ``spec`` (the first ``warmup`` sentences once untimed,
    then all of them timed); ``components(generator)`` yields (object,
    method, name) to time.  Returns (total ms, sentences, output tokens, timers)."""
    task, models, generator, batches = load_decoder(spec)
    timers = Timers()
    for component in components(generator):
        timers.wrap(*component)
    # the check that cached weight layouts are current, wherever a component makes it (class-wide, undone below)
    changed = WeightsWatch.changed
    timers.wrap(WeightsWatch, "changed", WEIGHT_CHECKS, required=False)
    try:
        decode = fairseq_decode(task, models, generator)
        warm_up(batches, decode, warmup)
        timers.enabled = True
        total, sentences, tokens = 0.0, 0, 0
        for _, out, ms in timed_batches(batches, decode):
            total += ms
            sentences += len(out)
            tokens += sum(len(hyps[0]["tokens"]) for hyps in out)
    finally:
        WeightsWatch.changed = changed
    timers.check_called()
    return total, sentences, tokens, timers


SUB = "of which: "
#: the weight checks' row: part of the components whose calls make them (the encoder, the first verify pass of a
#: batch, a drafter's start of batch or pass)
WEIGHT_CHECKS = f"{SUB}weight checks (WeightsWatch, inside the rows above)"


def greedy_components(generator):
    yield generator.model, "forward_encoder", "encoder"
    yield generator.model, "forward_decoder", "decoder step (1 token)"
    yield generator.model.models[0].decoder, "output_layer", f"{SUB}vocabulary projection (1 row)"


def drafter_parts(drafter, k: int):
    """(object, method, name[, required]) of a drafter's calls to time: what
    it declares (:class:`~fairseq_specdec.generation.drafters.TimedParts`),
    else the contract's: its start of batch, its pass (its tree where it
    drafts trees) and its feedback.  Only the start of batch is required:
    the draft policy may draft in no iteration (``TimedParts.timed_parts``)."""
    if isinstance(drafter, TimedParts):
        yield from drafter.timed_parts(k)
        return
    yield drafter, "start_batch", "drafter start of batch"
    trees = isinstance(drafter, TreeDrafter)
    yield drafter, "propose", f"drafter pass (up to {k} drafts)", False
    if trees:
        yield drafter, "propose_tree", f"drafter tree (up to {k} deep)", False
    yield drafter, "update", "drafter feedback", False


def draft_verify_components(generator):
    """(object, method, name[, required]) of the speculative loop's parts:
    what the drafter and the verify pass are made of (:func:`drafter_parts`,
    ``VerifyPass.timed_parts``), so that a decoding registered by another
    plugin is profiled by its own parts."""
    k = generator.block_size
    verifier = list(generator.verifier.timed_parts(k))
    yield verifier[0]  # the encoder first: it runs before the drafter's start of batch
    yield from drafter_parts(generator.drafter, k)
    yield from verifier[1:]


def rows_of(label, total, sentences, timers, iterations):
    rows = []
    for name in [n for n in timers.names if n in timers.ms]:
        rows.append(dict(decoder=label, component=name, calls=timers.calls[name],
                         ms_per_call=timers.ms[name] / max(timers.calls[name], 1),
                         ms_per_sentence=timers.ms[name] / sentences, share=timers.ms[name] / total))
    other = total - sum(ms for name, ms in timers.ms.items() if not name.startswith(SUB))
    rows.append(dict(decoder=label, component=f"other ({iterations} iterations)", calls=iterations,
                     ms_per_call=other / max(iterations, 1), ms_per_sentence=other / sentences,
                     share=other / total))
    rows.append(dict(decoder=label, component="total", calls=sentences, ms_per_call=total / sentences,
                     ms_per_sentence=total / sentences, share=1.0))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="binarized data directory")
    parser.add_argument("--verifier", required=True, help="verifier checkpoint")
    parser.add_argument("--drafter", help="drafter checkpoint (specdec_nat or specdec_vsd): the draft-verify row")
    parser.add_argument("--blockwise", help="blockwise_transformer checkpoint: a blockwise-heads row")
    parser.add_argument("--loop-greedy", action="store_true", help="also profile greedy decoding through the plugin's loop")
    parser.add_argument("--ngram", action="store_true",
                        help="also profile --decoding ngram (drafts from the --data directory's train split)")
    parser.add_argument("--self-draft", action="store_true",
                        help="also profile --decoding self-draft (the verifier's int8 copy drafts)")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--subset", default="test")
    parser.add_argument("--limit", type=int, default=200, help="sentences to decode (the first in fairseq's batch order)")
    parser.add_argument("--warmup", type=int, default=10, help="sentences decoded before timing")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--block-size", type=int, default=None, help="k (default: the drafter's)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="sentences per batch, for every decoder (default 1)")
    parser.add_argument("--extra", default="",
                        help="more fairseq-generate options for the draft-verify decoder, one string "
                             "(write it with =, e.g. --extra=\"--adaptive-draft --draft-min-confidence 0.3\")")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    if not (args.drafter or args.blockwise or args.loop_greedy or args.ngram or args.self_draft):
        parser.error("give at least one decoder to profile against fairseq's --beam 1: --drafter, --blockwise, "
                     "--ngram, --self-draft or --loop-greedy")
    for path in (args.verifier, args.drafter, args.blockwise):
        if path is not None and not os.path.exists(path):
            parser.error(f"no such file: {path}")
    for name, least in (("limit", 1), ("threads", 1), ("warmup", 0), ("batch_size", 1)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(args, name)}")

    common = dict(data=args.data, src=args.src, tgt=args.tgt, subset=args.subset, threads=args.threads,
                  limit=args.limit, batch_size=args.batch_size, beam=1, device="cpu")
    greedy = dict(common, path=args.verifier, extra=["--decoding", "autoregressive"])
    k = ["--block-size", str(args.block_size)] if args.block_size else []
    loops = []  # (label, spec) of the plugin's loop
    if args.loop_greedy:
        loops.append(("loop-greedy", dict(common, path=args.verifier, extra=["--decoding", "loop-greedy"])))
    if args.drafter:
        loops.append(("draft-verify strict", dict(common, path=f"{args.verifier}:{args.drafter}",
                                                   extra=["--decoding", "draft-verify"] + k + args.extra.split())))
    if args.blockwise:
        loops.append(("blockwise heads strict", dict(common, path=args.blockwise,
                                                      extra=["--decoding", "blockwise"] + k + args.extra.split())))

    if args.ngram:
        loops.append(("n-gram corpus strict", dict(common, path=args.verifier,
                                                   extra=["--decoding", "ngram"] + k + args.extra.split())))
    if args.self_draft:
        loops.append(("self-draft strict", dict(common, path=args.verifier,
                                                extra=["--decoding", "self-draft"] + k + args.extra.split())))

    def calls(timers, prefix):  # every part whose name starts so (a screened pass is a pass too)
        return sum(timers.calls[name] for name in timers.ms if name.startswith(prefix))

    total, n, _, timers = profile(greedy, greedy_components, args.warmup)
    rows = rows_of("fairseq beam 1", total, n, timers, calls(timers, "decoder step"))
    summary = []
    for label, spec in loops:
        total, n, tokens, timers = profile(spec, draft_verify_components, args.warmup)
        iterations = calls(timers, "verifier pass")
        rows += rows_of(label, total, n, timers, iterations)
        # an iteration's tokens: all rows' (a batch's), and a run of screened greedy steps' several a row
        summary.append(f"{label}: {tokens} output tokens in {iterations} iterations "
                       f"({tokens / max(iterations, 1):.2f} tokens an iteration)")

    print(f"batch {args.batch_size}, {args.threads} thread(s), {n} sentences after a warm-up of {args.warmup}; " + "; ".join(summary) + "\n")
    print("| decoder | component | calls | ms/call | ms/sentence | share |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['decoder']} | {r['component']} | {r['calls']} | {r['ms_per_call']:.2f} | "
              f"{r['ms_per_sentence']:.2f} | {100 * r['share']:.0f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), threads=args.threads, sentences=n, rows=rows), f, indent=1)
