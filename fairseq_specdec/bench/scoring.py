"""BLEU of decoded sentences: detokenized sacreBLEU and tokenized BLEU."""
import gzip
from typing import Dict, List


def detokenize(lines: List[str], lang: str) -> List[str]:
    from sacremoses import MosesDetokenizer

    md = MosesDetokenizer(lang=lang)
    return [md.detokenize(line.replace("@@ ", "").replace("@@", "").split()) for line in lines]


def read_lines(path: str) -> List[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def score(text: Dict[str, str], raw_ref: List[str], tok_ref: List[str], lang: str) -> Dict:
    """BLEU of the decoded sentences (ids are line numbers of the references)."""
    import sacrebleu

    ids = sorted(int(k) for k in text)
    hyp_bpe = [text[str(i)] for i in ids]
    detok = detokenize(hyp_bpe, lang)
    bleu = sacrebleu.metrics.BLEU()
    res = bleu.corpus_score(detok, [[raw_ref[i] for i in ids]])
    out = {"sacrebleu": round(res.score, 2), "signature": str(bleu.get_signature())}
    if tok_ref:
        tok_hyp = [h.replace("@@ ", "") for h in hyp_bpe]
        tb = sacrebleu.metrics.BLEU(tokenize="none", force=True)  # tokenized on purpose: no warning
        out["tok_bleu"] = round(tb.corpus_score(tok_hyp, [[tok_ref[i] for i in ids]]).score, 2)
    return out
