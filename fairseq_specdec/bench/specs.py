"""Row specs: what each benchmark row decodes, named uniquely.

A row spec is a JSON-able dict (the worker process reads it): ``name``
(unique: results are matched to specs by it), ``label`` (the table's
decoder column), ``decoding``, ``drafter`` (the drafter's label, "" for
none or an unlabelled one), ``path``, ``beam``, ``batch_size``, ``extra``
(more fairseq-generate options) and what every row shares (data, languages,
threads, limit, warm-up, device, user dir).

Row kinds (``--rows``): ``beam5`` and ``beam1`` (fairseq's own
SequenceGenerator on the verifier), ``strict`` and ``relaxed`` (decoding
``draft-verify`` with every ``--drafter``, strict and the beta:tau grid),
``ct2`` and ``ct2-int8`` (the verifier converted to CTranslate2, greedy;
only when the ``ctranslate2`` package is installed, see
:mod:`fairseq_specdec.bench.ct2`), and every decoding in the registry (:mod:`fairseq_specdec.generation.registry`),
read when the rows are built.  A decoding's :class:`BenchEntry` (the
benchmark's own table, :data:`BENCH_ENTRIES`; the registry of decodings
carries nothing of the benchmark's) says which checkpoint its rows decode
with (the verifier, the verifier then each drafter, one row per drafter, or
the ``--blockwise`` checkpoint), their label and any further options.
``KIND:LABEL+LABEL`` gives a kind's rows for those ``--drafter`` labels only
(``ngram+draft-verify:vsd``: the combined decoding with the specdec_vsd
drafter, not with a chain-only Spec-Drafter).
"""
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from . import ct2

AUTOREGRESSIVE = "autoregressive"
DRAFT_VERIFY = "draft-verify"
#: row kinds of the benchmark itself; every registered decoding name is a row kind too
BUILTIN_ROWS = ("beam5", "beam1", "strict", "relaxed")
#: row kinds that need an optional package (never among the default rows)
OPTIONAL_ROWS = tuple(ct2.COMPUTE_TYPES)
#: where a decoding's rows take their --path from
BENCH_MODELS = ("verifier", "verifier+drafter", "blockwise")
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


@dataclass(frozen=True)
class BenchEntry:
    """How the benchmark runs a decoding's rows: ``model``, where their
    ``--path`` comes from (one of :data:`BENCH_MODELS`); ``label``, the
    table's decoder column (None: the decoding's name); ``extra``, more
    fairseq-generate options."""

    model: str = "verifier"
    label: Optional[str] = None
    extra: Tuple[str, ...] = ()


#: the built-in decodings' entries; another decoding runs on the verifier
#: (then each drafter, where it takes one), labelled by its name, unless it
#: registers its own (:func:`register_bench_entry`)
BENCH_ENTRIES: Dict[str, BenchEntry] = {
    "draft-verify": BenchEntry("verifier+drafter", "draft-verify"),
    "blockwise": BenchEntry("blockwise", "blockwise heads"),
    "ngram": BenchEntry(label="n-gram corpus"),
    "ngram+draft-verify": BenchEntry("verifier+drafter", "n-gram + specdec_vsd tree"),
    "self-draft": BenchEntry(label="int8 self-draft"),
    "loop-greedy": BenchEntry(label="greedy in the speculative loop"),
}


def register_bench_entry(name: str, entry: BenchEntry, replace: bool = False) -> None:
    """How the benchmark runs decoding ``name`` (a plugin's decoding that
    needs other than the default)."""
    if entry.model not in BENCH_MODELS:
        raise ValueError(f"decoding {name!r}: bench model {entry.model!r} is none of {', '.join(BENCH_MODELS)}")
    if name in BENCH_ENTRIES and not replace:
        raise ValueError(f"decoding {name!r} has a benchmark entry already")
    BENCH_ENTRIES[name] = entry


def bench_entry(decoding) -> BenchEntry:
    """The entry of a registered decoding: its own, or the default for it."""
    entry = BENCH_ENTRIES.get(decoding.name)
    if entry is None:
        entry = BenchEntry("verifier+drafter" if decoding.takes_drafter else "verifier")
    return entry


def fmt_number(x: float) -> str:
    """``1.0`` -> ``"1"``, ``0.5`` -> ``"0.5"`` (keys of the sweeps)."""
    return str(int(x)) if float(x).is_integer() else str(x)


@dataclass(frozen=True)
class DrafterArg:
    """One ``--drafter [LABEL=]PATH``."""

    label: str
    path: str
    #: more fairseq-generate options for this drafter's rows (``--drafter-options``)
    options: Tuple[str, ...] = ()

    @classmethod
    def parse(cls, value: str) -> "DrafterArg":
        label, sep, path = value.partition("=")
        if sep and LABEL.fullmatch(label):
            return cls(label, path)
        return cls("", value)

    @property
    def suffix(self) -> str:
        """What the drafter's rows add to their names: ``strict-LABEL@bs1``."""
        return f"-{self.label}" if self.label else ""

    def describe(self, text: str) -> str:
        return f"{text} ({self.label})" if self.label else text


def parse_drafters(values: Optional[Sequence[str]], options: Optional[Sequence[str]] = None) -> List[DrafterArg]:
    """Every ``--drafter`` value, with its ``--drafter-options LABEL=OPTIONS``;
    ``ValueError`` if two would name their rows alike or options name no drafter."""
    drafters = [DrafterArg.parse(v) for v in values or []]
    labels = [d.label for d in drafters]
    extra = {}
    for value in options or []:
        label, sep, opts = value.partition("=")
        if not sep or label not in labels or not label:
            raise ValueError(
                f"--drafter-options {value!r}: expected LABEL=OPTIONS with the LABEL of a --drafter LABEL=PATH "
                f"(labels: {', '.join(repr(x) for x in labels if x) or 'none'})"
            )
        extra[label] = tuple(opts.split())
    drafters = [DrafterArg(d.label, d.path, extra.get(d.label, ())) for d in drafters]
    for label in set(labels):
        if labels.count(label) > 1:
            raise ValueError(
                f"--drafter: {labels.count(label)} drafters " + (f"labelled {label!r}" if label else "without a label")
                + "; give each drafter its own label (--drafter LABEL=PATH)"
            )
    return drafters


@dataclass(frozen=True)
class Variant:
    """One ``--variant LABEL[:KINDS]=OPTIONS``: every row of the plugin's
    decodings (or only those of the ``--rows`` kinds listed in ``KINDS``,
    comma-separated) again, with more fairseq-generate options
    (``loop-greedy+LABEL@bs1``)."""

    label: str
    options: Tuple[str, ...]
    kinds: Optional[Tuple[str, ...]] = None  # None: every row of the plugin's decodings

    @classmethod
    def parse(cls, value: str) -> "Variant":
        head, sep, options = value.partition("=")
        label, colon, kinds = head.partition(":")
        wanted = tuple("strict" if k.strip() == DRAFT_VERIFY else k.strip() for k in kinds.split(",") if k.strip())
        if not sep or not LABEL.fullmatch(label) or not options.split() or (colon and not wanted):
            raise ValueError(f"--variant {value!r}: expected LABEL=OPTIONS or LABEL:ROW,ROW=OPTIONS, e.g. "
                             "'no-graphs=FAIRSEQ_SPECDEC_OFF=graphs' or 'no-accept:loop-greedy,strict=FAIRSEQ_SPECDEC_OFF=accept' (NAME=value words are environment assignments set while the row's generator is built)")
        return cls(label, tuple(options.split()), wanted or None)

    def applies(self, spec: Dict) -> bool:
        return self.kinds is None or spec.get("kind") in self.kinds

    def apply(self, spec: Dict) -> Dict:
        name, at, where = spec["name"].partition("@")
        return dict(spec, name=f"{name}+{self.label}{at}{where}", label=f"{spec['label']} [{self.label}]",
                    extra=list(spec["extra"]) + list(self.options), variant=self.label)


def parse_variants(values: Optional[Sequence[str]], kinds: Optional[Sequence[str]] = None) -> List[Variant]:
    """Every ``--variant``; ``ValueError`` if two share a label or one names a
    row kind that is not in ``kinds`` (when given: the kinds ``--rows`` takes)."""
    variants = [Variant.parse(v) for v in values or []]
    labels = [v.label for v in variants]
    if len(set(labels)) < len(labels):
        raise ValueError(f"--variant: two variants share a label ({', '.join(labels)})")
    for v in variants:
        unknown = [k for k in v.kinds or () if kinds is not None and k not in kinds]
        if unknown:
            raise ValueError(f"--variant {v.label}: no row kind {', '.join(map(repr, unknown))} "
                             f"(kinds: {', '.join(kinds)})")
    return variants


def with_variants(specs: Sequence[Dict], variants: Sequence[Variant]) -> List[Dict]:
    """``specs``, each row of the plugin's decodings followed by itself under
    every variant that applies to its kind (fairseq's own rows and
    CTranslate2's run once: the options are the plugin's)."""
    out = []
    for spec in specs:
        out.append(spec)
        if spec["decoding"] not in (AUTOREGRESSIVE, "ctranslate2"):
            out += [variant.apply(spec) for variant in variants if variant.applies(spec)]
    return out


def row_kinds(decodings: Mapping) -> List[str]:
    builtin = BUILTIN_ROWS + OPTIONAL_ROWS
    return list(builtin) + [name for name in decodings if name not in builtin]


def resolve_rows(value: str, decodings: Mapping, drafters: Sequence[DrafterArg], blockwise: Optional[str]) -> List[str]:
    """The row kinds of ``--rows`` (``draft-verify`` is ``strict``), checked
    against the registry and the checkpoints given; ``ValueError`` names
    what is wrong."""
    wanted: List[str] = []
    for kind in (r.strip() for r in value.split(",")):
        kind = "strict" if kind == DRAFT_VERIFY else kind
        if kind and kind not in wanted:
            wanted.append(kind)
    kinds = row_kinds(decodings)
    unknown = [r for r in wanted if split_kind(r)[0] not in kinds]
    if unknown:
        raise ValueError(f"unknown --rows {unknown}; choose from {', '.join(kinds)}")
    if "beam5" not in wanted or "beam1" not in wanted:
        raise ValueError("--rows must include beam5 and beam1 (every speedup is a ratio to them)")
    labels = [d.label for d in drafters]
    for full in wanted:
        kind, only = split_kind(full)
        missing = [label for label in only or () if label not in labels]
        if missing:
            raise ValueError(f"--rows {full}: no --drafter LABEL=PATH with the label {', '.join(map(repr, missing))} "
                             f"(labels: {', '.join(repr(x) for x in labels if x) or 'none'})")
        if kind in ct2.COMPUTE_TYPES:
            ct2.require(f"--rows {kind}")
            continue
        model = "verifier+drafter" if kind in ("strict", "relaxed") else _bench_model(decodings, kind)
        if model == "verifier+drafter" and not drafters:
            raise ValueError(f"--rows {kind} needs --drafter")
        if model == "blockwise" and not blockwise:
            raise ValueError(f"--rows {kind} needs --blockwise")
    return wanted


def split_kind(kind: str) -> Tuple[str, Optional[Tuple[str, ...]]]:
    """``KIND:LABEL+LABEL`` (a kind's rows for those ``--drafter`` labels
    only) -> ``(KIND, (LABEL, ...))``; a plain kind -> ``(KIND, None)``."""
    base, colon, labels = kind.partition(":")
    return base, (tuple(x for x in labels.split("+") if x) if colon else None)


def _bench_model(decodings: Mapping, kind: str) -> Optional[str]:
    return bench_entry(decodings[kind]).model if kind in decodings else None


class RowSpecs:
    """Builds the row specs of one benchmark run."""

    def __init__(self, common: Dict, verifier: str, drafters: Sequence[DrafterArg], blockwise: Optional[str],
                 decodings: Mapping, verify_score: str = "verifier", block_size: Optional[int] = None,
                 ct2_dir: Optional[str] = None):
        self.common = common
        self.ct2_dir = ct2_dir
        self.verifier = verifier
        self.drafters = list(drafters)
        self.blockwise = blockwise
        self.decodings = decodings
        self.verify_score = verify_score
        self.k_args = ["--block-size", str(block_size)] if block_size else []

    def _spec(self, name, label, decoding, path, bs, beam=1, extra=(), drafter: Optional[DrafterArg] = None) -> Dict:
        return dict(self.common, name=name, label=label, decoding=decoding, drafter=drafter.label if drafter else "",
                    path=path, beam=beam, batch_size=bs, extra=list(extra))

    def autoregressive(self, name: str, label: str, bs: int, beam: int) -> Dict:
        """fairseq's own SequenceGenerator on the verifier."""
        return self._spec(name, label, AUTOREGRESSIVE, self.verifier, bs, beam=beam)

    def ctranslate2(self, kind: str, bs: int) -> Dict:
        """The verifier converted to CTranslate2 (``self.ct2_dir``), greedy, compute type of ``kind``."""
        if not self.ct2_dir:
            raise ValueError(f"--rows {kind}: no converted CTranslate2 model directory")
        return dict(self._spec(f"{kind}@bs{bs}", ct2.LABELS[kind], "ctranslate2", self.ct2_dir, bs),
                    engine="ctranslate2", compute_type=ct2.COMPUTE_TYPES[kind])

    def filler(self) -> Dict:
        """The discarded beam-1 decoder that keeps a core busy once fewer rows than jobs are left."""
        return self.autoregressive("filler", "filler", 1, beam=1)

    def draft_verify(self, drafter: DrafterArg, name: str, label: str, bs: int,
                     beta: int = 1, tau: float = 0.0, k: Optional[int] = None) -> Dict:
        """Decoding draft-verify with ``drafter``; ``name`` and ``label`` get the drafter's label."""
        extra = ["--decoding", DRAFT_VERIFY, "--verify-beta", str(beta), "--verify-tau", str(tau),
                 "--verify-score", self.verify_score]
        extra += ["--block-size", str(k)] if k else self.k_args
        if DRAFT_VERIFY in self.decodings:
            extra += list(bench_entry(self.decodings[DRAFT_VERIFY]).extra)
        extra += list(drafter.options)
        name, at, where = name.partition("@")
        return self._spec(f"{name}{drafter.suffix}{at}{where}", drafter.describe(label), DRAFT_VERIFY,
                          f"{self.verifier}:{drafter.path}", bs, extra=extra, drafter=drafter)

    def registered(self, kind: str, bs: int) -> List[Dict]:
        """The rows of registered decoding ``kind`` at batch size ``bs`` (one per drafter if it takes one)."""
        decoding = self.decodings[kind]
        entry = bench_entry(decoding)
        extra = ["--decoding", decoding.name] + list(entry.extra)
        label = entry.label or decoding.name
        if entry.model == "verifier+drafter":
            return [self._spec(f"{decoding.name}{d.suffix}@bs{bs}", d.describe(label), decoding.name,
                               f"{self.verifier}:{d.path}", bs, extra=extra + list(d.options), drafter=d)
                    for d in self.drafters]
        path = self.blockwise if entry.model == "blockwise" else self.verifier
        return [self._spec(f"{decoding.name}@bs{bs}", label, decoding.name, path, bs, extra=extra)]

    def main_rows(self, wanted: Sequence[str], batch_sizes: Sequence[int], relaxed_batch_sizes: Sequence[int],
                  grid: Sequence[Tuple[str, str]]) -> List[Dict]:
        specs = []
        for bs in batch_sizes:
            for kind in wanted:
                for spec in self._rows(kind, bs, relaxed_batch_sizes, grid):
                    spec["kind"] = kind  # the --rows kind it came from (--variant LABEL:KINDS)
                    specs.append(spec)
        return specs

    def _rows(self, full: str, bs: int, relaxed_batch_sizes: Sequence[int],
              grid: Sequence[Tuple[str, str]]) -> List[Dict]:
        """The rows of one ``--rows`` kind at batch size ``bs`` (``KIND:LABELS``:
        for those drafters only)."""
        kind, only = split_kind(full)
        if only is not None:
            kept = self.drafters
            self.drafters = [d for d in kept if d.label in only]
            try:
                return self._rows(kind, bs, relaxed_batch_sizes, grid)
            finally:
                self.drafters = kept
        if kind == "beam5":
            return [self.autoregressive(f"beam5@bs{bs}", "fairseq beam 5", bs, beam=5)]
        if kind == "beam1":
            return [self.autoregressive(f"beam1@bs{bs}", "fairseq beam 1", bs, beam=1)]
        if kind == "strict":
            return [self.draft_verify(d, f"strict@bs{bs}", "draft-verify strict", bs) for d in self.drafters]
        if kind in ct2.COMPUTE_TYPES:
            return [self.ctranslate2(kind, bs)]
        if kind == "relaxed":
            if bs not in relaxed_batch_sizes:
                return []
            return [self.draft_verify(d, f"b{beta}t{tau}@bs{bs}", f"draft-verify beta={beta} tau={tau}",
                                      bs, int(beta), float(tau))
                    for d in self.drafters for beta, tau in grid]
        return self.registered(kind, bs)

    def sweep_rows(self, batch_sizes: Sequence[int], ks: Sequence[int], beta_tau: Sequence[Tuple[int, float]]) -> List[Dict]:
        """Latency vs batch size (beam 1 and strict), Tok. vs k, Tok. vs beta/tau, for every drafter."""
        specs = []
        for bs in batch_sizes:
            specs.append(self.autoregressive(f"sweep-beam1@bs{bs}", "fairseq beam 1", bs, beam=1))
            specs += [self.draft_verify(d, f"sweep-strict@bs{bs}", "strict", bs) for d in self.drafters]
        for d in self.drafters:
            specs += [self.draft_verify(d, f"sweep-k{k}", "strict", 1, k=k) for k in ks]
            specs += [self.draft_verify(d, f"sweep-b{beta}t{tau}", "relaxed", 1, beta, tau) for beta, tau in beta_tau]
        return specs

    def sweep_results(self, results: Mapping[str, Dict], batch_sizes: Sequence[int], ks: Sequence[int],
                      beta_tau: Sequence[Tuple[int, float]], bleu: Callable[[Dict], float]) -> Dict:
        """``batch_sweep``, ``k_sweep`` and ``beta_tau_sweep`` of results.json,
        each result taken by its spec's name; ``bleu(result)`` scores one."""
        def ms(r):
            return 1000.0 * r["seconds"] / r["sentences"]

        batch = {"fairseq beam 1": {str(bs): ms(results[f"sweep-beam1@bs{bs}"]) for bs in batch_sizes}}
        k_sweep, bt = {}, {}
        for d in self.drafters:
            batch[d.describe("draft-verify strict")] = {
                str(bs): ms(results[f"sweep-strict{d.suffix}@bs{bs}"]) for bs in batch_sizes}
            k_sweep[d.describe("strict")] = {
                str(k): {"tok": r["tok"], "ms": ms(r)} for k in ks for r in [results[f"sweep-k{k}{d.suffix}"]]}
            for beta, tau in beta_tau:
                r = results[f"sweep-b{beta}t{tau}{d.suffix}"]
                bt.setdefault(d.describe(f"beta={beta}"), {})[fmt_number(tau)] = {
                    "tok": r["tok"], "ms": ms(r), "sacrebleu": bleu(r)}
        return {"batch_sweep": batch, "k_sweep": k_sweep, "beta_tau_sweep": bt}
