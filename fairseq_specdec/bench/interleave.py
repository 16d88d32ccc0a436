"""Interleaved timing of several decoders, in one run (in this process, or
each in its own with --process-row): the firm way to compare speeds on a
machine whose speed drifts.

Every row is a decoder built as ``fairseq-generate`` builds it
(:func:`fairseq_specdec.bench.loading.load_decoder`) from the verifier and
the row's own fairseq-generate options; all of them are loaded first, then
each round decodes the same sentences with every row in turn, so a slow
minute of the machine hits every row alike (``--by-batch``: each batch is
decoded by every row in turn, the first row rotating, so that even a drift
within seconds does).  A row's time is its fastest round (ms per
sentence); ratios are against the first row, and every row's output is
compared with the first row's, sentence by sentence.  A row
decoded by the plugin's loop also reports its Tok. (output tokens, EOS
included, per iteration, from the generator's statistics over one round);
fairseq's own decoders leave the column empty.

A ``--process-row NAME=OPTIONS`` is a row decoded in a process of its own
(:mod:`fairseq_specdec.bench.interleave_worker`), started with the row's
``NAME=value`` words in its environment: what a process reads once, such as
``FAIRSEQ_SPECDEC_ISA=avx512``, or ``PYTHONPATH=DIR`` to decode with
another checkout of the plugin (built in place) instead of this one.  It
takes its turns with the other rows as an in-process row does, timed in
its process around the decoding alone, so that two instruction sets or two
versions of the code are compared batch by batch under the same drift of
the machine, which two whole runs one after the other are not.

--ct2 adds the row "ctranslate2" (--ct2-int8: "ctranslate2-int8", weights
quantized to int8 when loaded), after the --row rows: the verifier converted
once to CTranslate2 (into --ct2-dir, by default a temporary directory removed
at the end), decoding greedily the same sentences in the same batches as the
other rows, timed the same way, its output mapped back to the target
dictionary for the identity column (Tok. empty); it needs the optional
ctranslate2 package (pip install ctranslate2) and is refused without it.

Example (the `make demo` models)::

    scripts/interleave.py --data runs/multi30k.en-de/distill/bin \\
        --verifier runs/multi30k.en-de/verifier/checkpoint_best.pt --limit 400 --rounds 3 \\
        --row 'loop-greedy=--decoding loop-greedy' \\
        --row 'blockwise=--path runs/multi30k.en-de/blockwise/checkpoint_best.pt --decoding blockwise' --ct2
"""
import argparse
import contextlib
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Dict, List, Optional

#: --ct2 option -> (row name, CTranslate2 compute type)
CT2_ROWS = {"ct2": ("ctranslate2", "float32"), "ct2_int8": ("ctranslate2-int8", "int8")}


def parse_row(text: str) -> Dict:
    """``NAME=OPTIONS`` -> {"name", "path" (or None), "extra"}: OPTIONS are
    fairseq-generate options; a ``--path`` among them replaces the verifier."""
    if "=" not in text:
        raise ValueError(f"--row {text!r}: expected NAME=OPTIONS, e.g. 'loop-greedy=--decoding loop-greedy'")
    name, options = text.split("=", 1)
    name = name.strip()
    if not name:
        raise ValueError(f"--row {text!r}: the name before '=' is empty")
    extra = shlex.split(options)
    path = None
    if "--path" in extra:
        i = extra.index("--path")
        if i + 1 >= len(extra):
            raise ValueError(f"--row {name}: --path needs a checkpoint")
        path = extra[i + 1]
        del extra[i : i + 2]
    return {"name": name, "path": path, "extra": extra}


def process_environment(name: str, extra: List[str]):
    """A --process-row's options as ``(environment, options)``: its
    ``NAME=value`` words go to its process's environment, except
    ``FAIRSEQ_SPECDEC_OFF``, which stays a row option (the benchmark reads
    it when the row is built); a ``PYTHONPATH`` must name checkouts of the
    plugin (folders holding ``fairseq_specdec/``)."""
    from .loading import ASSIGNMENT, OFF_ENV

    env, rest = {}, []
    for word in extra:
        match = ASSIGNMENT.match(word)
        if match is None or match.group(1) == OFF_ENV:
            rest.append(word)
        else:
            env[match.group(1)] = match.group(2)
    if "PYTHONPATH" in env:
        folder = env["PYTHONPATH"].split(os.pathsep)[0]
        if not os.path.isfile(os.path.join(folder, "fairseq_specdec", "__init__.py")):
            raise ValueError(f"--process-row {name}: PYTHONPATH={env['PYTHONPATH']}: no fairseq_specdec/ in "
                             f"{folder!r} (name the folder of another checkout of the plugin first)")
    return env, rest


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/interleave.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", required=True, help="binarized data directory (fairseq-preprocess output)")
    p.add_argument("--verifier", required=True, help="the verifier checkpoint (every row's --path unless it names one)")
    p.add_argument("--row", action="append", dest="rows", type=lambda text: ("here", text), metavar="NAME=OPTIONS",
                   help="a decoder: its name and fairseq-generate options (repeat; the first --row or "
                        "--process-row is the reference)")
    p.add_argument("--process-row", action="append", dest="rows", type=lambda text: ("process", text),
                   metavar="NAME=OPTIONS",
                   help="a decoder in a process of its own, started with the row's NAME=value words in its "
                        "environment (e.g. FAIRSEQ_SPECDEC_ISA=avx512, or PYTHONPATH=DIR: another checkout of the "
                        "plugin, built in place); it takes its turns with the other rows")
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--subset", default="test", help="the split to decode (default test)")
    p.add_argument("--limit", type=int, default=None, help="the first N sentences in fairseq's batch order")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="rounds over every row (default 3); a row's time is its fastest")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--by-batch", action="store_true",
                   help="take turns batch by batch: each batch is decoded by every row in turn (the first row "
                        "rotating) before the next batch, so that a machine whose speed drifts within seconds "
                        "slows every row alike; a row's time in a round is the sum of its batches")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--ct2", action="store_true",
                   help="add the row 'ctranslate2': the verifier converted to CTranslate2, float32 greedy "
                        "(needs the ctranslate2 package)")
    p.add_argument("--ct2-int8", action="store_true",
                   help="add the row 'ctranslate2-int8': the same model, weights quantized to int8 when loaded")
    p.add_argument("--ct2-dir", default=None,
                   help="where the converted verifier goes (a new or empty directory, or one converted before, "
                        "which is replaced; kept); default a temporary directory removed at the end")
    return p


def ct2_rows(args) -> List[Dict]:
    """The CTranslate2 rows that ``--ct2`` and ``--ct2-int8`` ask for, in that order."""
    return [{"name": name, "option": "--" + option.replace("_", "-"), "compute_type": compute}
            for option, (name, compute) in CT2_ROWS.items() if getattr(args, option)]


def check_ct2(parser, args, names: List[str]) -> List[Dict]:
    """The CTranslate2 rows, refused (before anything is loaded) without the
    ctranslate2 package, with a name that a --row has, or with a --ct2-dir
    that holds something other than a converted model."""
    rows = ct2_rows(args)
    if not rows:
        if args.ct2_dir:
            parser.error("--ct2-dir needs --ct2 or --ct2-int8")
        return rows
    from . import ct2

    try:
        ct2.require(rows[0]["option"])
    except ValueError as error:
        parser.error(str(error))
    for r in rows:
        if r["name"] in names:
            parser.error(f"{r['option']} adds the row {r['name']}: a --row has that name")
    d = args.ct2_dir
    if d and os.path.exists(d) and not (
        os.path.isdir(d) and (not os.listdir(d) or os.path.isfile(os.path.join(d, "model.bin")))
    ):
        parser.error(f"--ct2-dir {d}: not a new or empty directory, nor a converted CTranslate2 model "
                     "(the conversion replaces the directory)")
    return rows


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.rows:
        parser.error("give at least one --row or --process-row")
    try:
        rows = [dict(parse_row(text), process=where == "process") for where, text in args.rows]
        for row in rows:
            if row["process"]:
                row["env"], row["extra"] = process_environment(row["name"], row["extra"])
    except ValueError as error:
        parser.error(str(error))
    names = [r["name"] for r in rows]
    if len(set(names)) != len(names):
        parser.error(f"--row and --process-row names must differ, got {', '.join(names)}")
    for name, least in (("limit", 1), ("batch_size", 1), ("rounds", 1), ("threads", 1)):
        value = getattr(args, name)
        if value is not None and value < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    for path in [args.verifier] + [r["path"] for r in rows if r["path"]]:
        if not os.path.isfile(path):
            parser.error(f"no such checkpoint: {path}")
    if not os.path.isdir(args.data):
        parser.error(f"--data {args.data}: no such directory")
    extra_rows = check_ct2(parser, args, names)

    # hydra's and torch's notes are not results; both settings are as they were after the run
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.ExitStack() as stack:
            warnings.filterwarnings("ignore")
            return run(args, rows, extra_rows, stack)
    finally:
        logging.disable(disabled)


def run(args, rows: List[Dict], extra_rows: List[Dict], stack: contextlib.ExitStack) -> int:
    """The run, once the options are checked: the CTranslate2 rows' model
    directory (a temporary one, left to ``stack``, unless --ct2-dir names one),
    then :func:`interleave`."""
    ct2_dir = args.ct2_dir
    if extra_rows and not ct2_dir:  # a temporary directory, removed at the end
        from .ct2 import model_dir

        ct2_dir = model_dir(stack.enter_context(tempfile.TemporaryDirectory(prefix="interleave-ct2-")))
    return interleave(args, rows, extra_rows, ct2_dir)


class HereRow:
    """A row decoded in this process: ``decode(sample)`` timed around the call."""

    def __init__(self, row: Dict, decode, generator, batches: list):
        self.row, self.decode, self.generator, self.batches = row, decode, generator, batches
        self.ids = [sample["id"].tolist() for sample in batches]
        self.described: Dict = {}

    def run(self, b: int):
        """``(seconds, [(id, tokens), ...])`` of batch ``b``."""
        sample = self.batches[b]
        t0 = time.perf_counter()
        out = self.decode(sample)
        return time.perf_counter() - t0, list(zip(self.ids[b], out))

    def reset(self) -> None:
        from .timing import reset_statistics

        if self.generator is not None:  # the plugin's loop: Tok. of this round only
            reset_statistics(self.generator)

    def tok(self) -> Optional[float]:
        from ..generation import SpeculativeGenerator

        stats = self.generator.stats if isinstance(self.generator, SpeculativeGenerator) else None
        return stats.mean_accepted if stats is not None and stats.iterations else None

    def close(self) -> None:
        pass


#: the worker of a --process-row, run by its path (see its docstring)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "interleave_worker.py")


class ProcessRow:
    """A --process-row: its decoder in a worker process
    (:mod:`fairseq_specdec.bench.interleave_worker`) started with the row's
    environment, asked for each batch in turn; the time is the worker's,
    around the decoding alone."""

    def __init__(self, row: Dict, spec: Dict, threads: int):
        from .workers import worker_environment

        env = worker_environment(threads)
        env.update(row["env"])  # the row's own PYTHONPATH (another checkout) replaces this one's
        self.row = row
        self.log = tempfile.TemporaryFile(mode="w+")
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, WORKER, str(write_fd)], stdin=subprocess.PIPE,
                                         stdout=self.log, stderr=subprocess.STDOUT, env=env, text=True,
                                         pass_fds=(write_fd,))
        finally:
            os.close(write_fd)
        self.replies = os.fdopen(read_fd)
        try:
            loaded = self.ask({"load": spec})
        except BaseException:
            self.close()
            raise
        self.ids = loaded["ids"]
        self.described = {"process": {"env": row["env"], "package": loaded["package"], "isa": loaded["isa"],
                                      "prefetch": loaded.get("prefetch")}}

    def ask(self, request: Dict) -> Dict:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.replies.readline()
        except BrokenPipeError:  # it ended between two requests
            line = ""
        reply = json.loads(line) if line else {"error": "the process ended"}
        if "error" in reply:
            self.log.seek(0)
            raise RuntimeError(f"--process-row {self.row['name']} failed: {reply['error']}\n"
                               f"its log (end):\n{self.log.read()[-4000:]}")
        return reply

    def run(self, b: int):
        reply = self.ask({"decode": b})
        return reply["seconds"], [(sid, tokens) for sid, tokens in reply["out"]]

    def reset(self) -> None:
        self.ask({"reset": True})

    def tok(self) -> Optional[float]:
        return self.ask({"tok": True})["tok"]

    def close(self) -> None:
        """The process ends (at the end of its input; killed if it has not
        ended 30 s later)."""
        try:
            self.proc.stdin.close()
        except OSError:  # it ended first
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.replies.close()
        self.log.close()


def row_spec(args, row: Dict) -> Dict:
    """The spec that builds a --row's or --process-row's decoder
    (:func:`fairseq_specdec.bench.loading.load_decoder`)."""
    return dict(data=args.data, path=row["path"] or args.verifier, batch_size=args.batch_size, beam=1,
                src=args.src, tgt=args.tgt, threads=args.threads, limit=args.limit, subset=args.subset,
                extra=row["extra"])


def fairseq_row(args, row: Dict):
    """``(decode, batches, generator)`` of a --row: ``decode(sample)`` is
    each sentence's output tokens (ids, EOS last)."""
    from .loading import load_decoder

    task, models, generator, batches = load_decoder(row_spec(args, row))

    def decode(sample) -> List[List[int]]:
        return [h[0]["tokens"].tolist() for h in task.inference_step(generator, models, sample)]

    return decode, batches, generator


def translator_row(args, row: Dict, ct2_dir: str):
    """``(decode, batches, None)`` of a CTranslate2 row: the converted
    verifier in ``ct2_dir``, built as the benchmark's CTranslate2 rows are
    (:func:`fairseq_specdec.bench.ct2.load_translator`); ``decode(sample)``
    maps its output to target dictionary ids."""
    from .ct2 import load_translator, target_ids

    spec = dict(data=args.data, path=ct2_dir, batch_size=args.batch_size, beam=1, src=args.src, tgt=args.tgt,
                threads=args.threads, limit=args.limit, subset=args.subset, extra=[],
                compute_type=row["compute_type"])
    task, batches, translate = load_translator(spec)
    tgt_dict = task.target_dictionary

    def decode(sample) -> List[List[int]]:
        return [target_ids(tokens, tgt_dict) for tokens in translate(sample)]

    return decode, batches, None


def interleave(args, rows: List[Dict], extra_rows: List[Dict], ct2_dir: Optional[str]) -> int:
    """Load every row (the --row and --process-row rows, then the
    CTranslate2 rows), time them in turn for ``args.rounds`` rounds, print
    the table; every --process-row's process ends with it."""
    if extra_rows:
        from .ct2 import convert

        convert(args.verifier, args.data, args.src, args.tgt, ct2_dir)
        print(f"converted the verifier to CTranslate2 into {ct2_dir}", file=sys.stderr, flush=True)

    loaded = []
    try:
        for row in rows + extra_rows:
            if row.get("process"):
                loaded.append(ProcessRow(row, row_spec(args, row), args.threads))
            else:
                build = translator_row(args, row, ct2_dir) if "compute_type" in row else fairseq_row(args, row)
                decode, batches, generator = build
                loaded.append(HereRow(row, decode, generator, list(batches())))
            print(f"loaded {row['name']}", file=sys.stderr, flush=True)
        return timed_rounds(args, rows, extra_rows, ct2_dir, loaded)
    finally:
        for entry in loaded:
            entry.close()


def timed_rounds(args, rows: List[Dict], extra_rows: List[Dict], ct2_dir: Optional[str], loaded: List) -> int:
    """Time the loaded rows (:class:`HereRow`, :class:`ProcessRow`) in turn
    for ``args.rounds`` rounds; print (and write) the table."""
    if any(entry.ids != loaded[0].ids for entry in loaded):
        raise RuntimeError("the rows decode different batches: " + ", ".join(
            f"{entry.row['name']} {len(entry.ids)} batches" for entry in loaded))
    times: Dict[str, List[float]] = {r["name"]: [] for r in rows + extra_rows}
    tok: Dict[str, Optional[float]] = {}
    outputs: Dict[str, Dict[int, List[int]]] = {}
    for round_ in range(args.rounds):
        for entry in loaded:
            entry.reset()
            outputs[entry.row["name"]] = {}
        seconds = {entry.row["name"]: 0.0 for entry in loaded}
        sentences = {entry.row["name"]: 0 for entry in loaded}
        # (row, batch) in the order they are decoded: --by-batch, every
        # batch by every row in turn (the first row rotating), so that the
        # machine's drift within a round hits all rows alike; else each row
        # the whole split in turn
        n, batches = len(loaded), range(len(loaded[0].ids))
        if args.by_batch:
            turns = [(loaded[(b + j) % n], b) for b in batches for j in range(n)]
        else:
            turns = [(entry, b) for entry in loaded for b in batches]
        for entry, b in turns:
            elapsed, out = entry.run(b)
            name = entry.row["name"]
            seconds[name] += elapsed
            outputs[name].update(out)
            sentences[name] += len(out)
        for entry in loaded:
            name = entry.row["name"]
            times[name].append(seconds[name] / max(1, sentences[name]) * 1e3)
            tok[name] = entry.tok()
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    from .machine import describe, header

    first = rows[0]["name"]
    base = min(times[first])
    machine = describe(ct2_dir if extra_rows else None)
    result = {"sentences": len(outputs[first]), "batch_size": args.batch_size, "rounds": args.rounds,
              "by_batch": args.by_batch, "threads": args.threads, "machine": machine, "rows": []}
    if extra_rows:
        result["ctranslate2"] = {"version": machine["ctranslate2"]["version"], "model": args.ct2_dir}
    turns = "batch by batch" if args.by_batch else "row by row"
    lines = [f"Machine: {header(machine)}", "",
             f"{result['sentences']} sentences, batch size {args.batch_size}, {args.rounds} rounds taken {turns}, "
             f"{args.threads} thread(s)", "",
             f"| decoder | ms/sentence | vs {first} | Tok. | identical to {first} | rounds (ms/sentence) |",
             "|---|---|---|---|---|---|"]
    for entry in loaded:  # the --row and --process-row rows, then the CTranslate2 rows
        row, name = entry.row, entry.row["name"]
        best = min(times[name])
        same = sum(outputs[name].get(i) == outputs[first][i] for i in outputs[first])
        if "compute_type" in row:
            options = row["option"]
            described = {"engine": "ctranslate2", "compute_type": row["compute_type"]}
        else:
            options = " ".join(([f"--path {row['path']}"] if row["path"] else []) + row["extra"])
            described = entry.described
        result["rows"].append({"name": name, "options": options, **described,
                               "ms_per_sentence": round(best, 3), "speedup": round(base / best, 3),
                               "tok": None if tok.get(name) is None else round(tok[name], 3),
                               "identical": same, "rounds_ms": [round(t, 3) for t in times[name]]})
        tok_cell = "" if tok.get(name) is None else f"{tok[name]:.2f}"
        lines.append(f"| {name} | {best:.2f} | {base / best:.2f}x | {tok_cell} | {same}/{len(outputs[first])} | "
                     f"{' '.join(f'{t:.2f}' for t in times[name])} |")
    notes = [entry for entry in loaded if "process" in entry.described]
    lines += [""] if notes else []
    for entry in notes:
        process = entry.described["process"]
        settings = " ".join(f"{k}={v}" for k, v in process["env"].items()) or "this environment"
        lines.append(f"{entry.row['name']}: in its own process ({settings}): the plugin of "
                     f"{process['package']}, products {process['isa'] or 'not named by that version'}"
                     + (f", prefetch {process['prefetch']}" if process.get("prefetch") else ""))
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
