"""Shared helpers for the fairseq-specdec tests (imported by conftest and tests)."""
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
ROOT = TESTS_DIR.parent
USER_DIR = str(ROOT / "fairseq_specdec")
for _p in (str(ROOT), str(TESTS_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

#: the tiny Transformer verifier (stock fairseq, --task translation)
AR_ARCH_ARGS = [
    "--arch", "transformer",
    "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
    "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--share-all-embeddings",
]
#: how every test's fairseq-train loads its data: in the main thread.  By
#: default fairseq fills a queue of batches from a daemon thread
#: (``--data-buffer-size 10``; BufferedIterator), and a run that stops at
#: --max-update in mid-epoch leaves that thread running; if it is inside a
#: torch call when the interpreter exits, the process aborts ("terminate
#: called without an active exception", exit -6) after it has trained and
#: saved.  The tests' tiny models update faster than that thread refills the
#: queue, so it is mostly inside torch calls; on the loaded two-process test
#: machine it happened to the probe's and to the blockwise heads' training.
DATA_LOADING_ARGS = ["--num-workers", "0", "--data-buffer-size", "0"]
OPTIM_ARGS = [
    "--optimizer", "adam", "--lr", "2e-3", "--lr-scheduler", "inverse_sqrt",
    "--warmup-updates", "50", "--max-tokens", "1024", "--dropout", "0.0",
    "--no-epoch-checkpoints", "--cpu", "--seed", "1", *DATA_LOADING_ARGS,
]
#: the tiny specdec_vsd drafter (--task draft_verify; reads the verifier's states)
VSD_ARGS = [
    "--task", "draft_verify", "--arch", "specdec_vsd", "--criterion", "glat_block",
    "--embed-dim", "64", "--attention-heads", "2", "--ffn-embed-dim", "128",
]
#: the tiny specdec_nat drafter (--task draft_verify)
NAT_ARGS = [
    "--task", "draft_verify", "--arch", "specdec_nat_tiny", "--criterion", "glat_block",
    "--share-all-embeddings",
]

#: the command-line options of each verification backend: ``auto`` (the
#: fastest exact path for the device: the plugin's native kernels on a CPU)
#: and ``reference`` (fairseq's own modules and torch's products).  Tests that
#: must hold on every backend parametrize over this dict.
BACKEND_ARGS = {
    "auto": [],
    "reference": ["--specdec-backend", "reference"],
}

# n lines, seed; test1/test2 exist for the lost-sentence guard (57 and 1000 lines)
SPLITS = {
    "train": (3000, 1),
    "valid": (100, 2),
    "test": (50, 3),
    "test1": (57, 4),
    "test2": (1000, 5),
}
SPLIT_SIZES = {name: n for name, (n, _) in SPLITS.items()}


TRUST_ENV = "SPECDEC_TRUSTED_CHECKPOINTS"


def cli(name):
    """A fairseq command-line tool of the running venv, else the one on PATH
    (fairseq installed with pip --target, as on the GPU kit's machine)."""
    import shutil

    local = os.path.join(os.path.dirname(sys.executable), name)
    return local if os.path.exists(local) else (shutil.which(name) or local)


def subprocess_env():
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    env.pop(TRUST_ENV, None)
    return env


#: set to 0 to run every command as a new process (see :func:`run`)
FORK_ENV = "SPECDEC_TESTS_FORK"
#: variables that torch or its OpenMP runtime read when loaded: a command
#: whose values differ from the zygote's runs as a new process
_LOAD_TIME_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH", "CUDA", "NVIDIA", "LD_", "PYTHON",
                       "MALLOC", "OPENBLAS", "DNNL", "ONEDNN")


def _load_time(env):
    """The variables of ``env`` read when torch loads (:data:`_LOAD_TIME_PREFIXES`)."""
    return {k: v for k, v in env.items() if k.startswith(_LOAD_TIME_PREFIXES)}


class _Zygote:
    """tests/zygote.py, started at the first command that can use it, one per
    test process (pytest-xdist workers each have their own)."""

    def __init__(self):
        self.proc = None
        self.load_time = None  # the zygote's load-time variables
        self.failed = False

    def script(self, cmd):
        """What a fork would run for ``cmd``, as the request's ``path`` or
        ``code`` and ``argv`` (a fairseq console script of this venv,
        ``python scripts/*.py`` or ``python -c CODE``), else None."""
        first = Path(str(cmd[0]))
        bin_dir = Path(sys.executable).parent
        if first.parent == bin_dir and first.name.startswith("fairseq-") and first.is_file():
            return {"path": str(first), "argv": [str(c) for c in cmd]}
        if first.parent == bin_dir and first.name.startswith("python") and len(cmd) > 1:
            script = Path(str(cmd[1]))
            if script.suffix == ".py" and script.resolve().parent == ROOT / "scripts":
                return {"path": str(script), "argv": [str(c) for c in cmd[1:]]}
            if str(cmd[1]) == "-c" and len(cmd) > 2:
                return {"code": str(cmd[2]), "argv": ["-c", *map(str, cmd[3:])]}
        return None

    def ready(self):
        """Started (at the first call, with the tests' environment of that
        moment); False where forks are turned off or it could not start."""
        if self.failed or os.environ.get(FORK_ENV, "1") == "0" or not hasattr(os, "fork"):
            return False
        if self.proc is None or self.proc.poll() is not None:
            env = subprocess_env()
            self.load_time = _load_time(env)
            self.proc = subprocess.Popen([sys.executable, str(TESTS_DIR / "zygote.py")], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))
            if not self.proc.stdout.readline().startswith('{"ready"'):
                self.failed = True
        return not self.failed

    def accepts(self, env):
        """Whether a command with ``env`` can run in a fork: torch's load-time
        variables as the zygote's."""
        return _load_time(env) == self.load_time

    def _reply(self):
        line = self.proc.stdout.readline()
        if not line:
            self.failed = True
            raise RuntimeError(f"tests/zygote.py stopped (exit status {self.proc.wait()}); "
                               f"{FORK_ENV}=0 runs every command as a new process")
        return json.loads(line)

    def run(self, target, env, cwd, timeout, input=None):
        """``target`` (from :meth:`script`) in a fork, as a CompletedProcess."""
        import selectors
        import tempfile

        with tempfile.TemporaryDirectory(prefix="zygote-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            stdin = None
            if input is not None:
                stdin = os.path.join(tmp, "stdin")
                with open(stdin, "w", encoding="utf-8") as f:
                    f.write(input)
            request = dict(target, env=env, cwd=str(cwd) if cwd else os.getcwd(), stdin=stdin, stdout=out,
                           stderr=err)
            argv = target["argv"]
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = self._reply()["pid"]
            with selectors.DefaultSelector() as sel:
                sel.register(self.proc.stdout, selectors.EVENT_READ)
                ready = sel.select(timeout)
            if not ready:
                os.kill(pid, 9)  # as subprocess.run kills its child (not the child's own children)
                self._reply()
                raise subprocess.TimeoutExpired(argv, timeout)
            rc = self._reply()["rc"]
            with open(out, encoding="utf-8", errors="replace") as f_out, \
                    open(err, encoding="utf-8", errors="replace") as f_err:
                return subprocess.CompletedProcess(argv, rc, f_out.read(), f_err.read())


_ZYGOTE = _Zygote()


def run(cmd, check=True, timeout=900, cwd=None, env=None, input=None):
    """``cmd`` in the tests' environment (``env``: more variables, a None
    value removing one), with ``input`` (text) on its stdin, else an empty
    one; a failure (with ``check``) shows the ends of its output.

    A fairseq console script of this venv, a script of ``scripts/`` or
    ``python -c`` run by this venv's python runs in a fork of
    tests/zygote.py, a process that has imported torch and fairseq once (its
    docstring says what that keeps unchanged), so that it skips those 5 s of
    imports; every other command, and every command where
    ``SPECDEC_TESTS_FORK=0``, is a new process."""
    full_env = dict(subprocess_env(), **{k: str(v) for k, v in (env or {}).items() if v is not None})
    for name in [k for k, v in (env or {}).items() if v is None]:
        full_env.pop(name, None)
    target = _ZYGOTE.script(cmd)
    if target is not None and _ZYGOTE.ready() and _ZYGOTE.accepts(full_env):
        proc = _ZYGOTE.run(target, full_env, cwd, timeout, input=input)
    else:
        proc = subprocess.run(
            [str(c) for c in cmd],
            input=input if input is not None else "",
            capture_output=True,
            text=True,
            env=full_env,
            timeout=timeout,
            cwd=cwd,
        )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n"
            f"--- stdout (tail) ---\n{proc.stdout[-4000:]}\n--- stderr (tail) ---\n{proc.stderr[-4000:]}"
        )
    return proc


def generate(data, path, *extra, plugin=True, task="translation", split="test", batch_size=1, check=True):
    """Run fairseq-generate; returns the CompletedProcess."""
    cmd = [cli("fairseq-generate"), data, "--path", path, "--gen-subset", split,
           "--task", task, "--beam", "1", "--batch-size", str(batch_size), "--cpu"]
    if plugin:
        cmd += ["--user-dir", USER_DIR]
    cmd += list(extra)
    return run(cmd, check=check)


_H = re.compile(r"^H-(\d+)\t(\S+)\t(.*)$")
_P = re.compile(r"^P-(\d+)\t(.*)$")


def parse_generate(text):
    """{id: (score, tokens_str, [positional scores])} from fairseq-generate output.

    Raises if an id appears twice (a sentence translated twice is a bug too)."""
    hyps, pos = {}, {}
    for line in text.splitlines():
        m = _H.match(line)
        if m:
            i = int(m.group(1))
            assert i not in hyps, f"H-{i} printed twice"
            hyps[i] = (float(m.group(2)), m.group(3))
            continue
        m = _P.match(line)
        if m:
            pos[int(m.group(1))] = [float(x) for x in m.group(2).split()]
    return {i: (s, t, pos.get(i)) for i, (s, t) in hyps.items()}


def assert_same_hypotheses(ref, got, atol=1e-4):
    """Same ids, identical token strings, scores and positional scores within atol.

    P- lines are printed rounded to 4 decimals, so two values that differ by
    less than ``atol`` may print up to 1e-4 further apart."""
    p_atol = atol + 1.01e-4 if atol > 0 else 0.0
    assert sorted(got) == sorted(ref), (
        f"ids differ: missing {sorted(set(ref) - set(got))[:10]}, extra {sorted(set(got) - set(ref))[:10]}"
    )
    for i in sorted(ref):
        rs, rt, rp = ref[i]
        gs, gt, gp = got[i]
        assert gt == rt, f"sentence {i}: tokens differ\n ref: {rt}\n got: {gt}"
        assert abs(gs - rs) <= atol, f"sentence {i}: score {gs} != {rs}"
        assert rp is not None and gp is not None and len(gp) == len(rp), f"sentence {i}: P- line"
        for j, (a, b) in enumerate(zip(rp, gp)):
            assert abs(a - b) <= p_atol, f"sentence {i}: positional score {j}: {b} != {a}"


def train_args_namespace(data, *argv):
    """Parse fairseq-train options (with the plugin) the way fairseq-train does."""
    import fairseq_specdec  # noqa: F401
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(data), "--user-dir", USER_DIR, *argv])
    return args, convert_namespace_to_omegaconf(args)


def generation_cfg(data, *argv):
    """Parse fairseq-generate options (with the plugin) the way fairseq-generate does."""
    import fairseq_specdec  # noqa: F401
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_generation_parser()
    args = options.parse_args_and_arch(parser, [str(data), "--user-dir", USER_DIR, "--cpu", *argv])
    return convert_namespace_to_omegaconf(args)


def save_model_checkpoint(model, cfg, path, criterion_name="GlatBlockCriterion"):
    """Save ``model`` as a checkpoint shaped like the one fairseq's trainer writes."""
    import torch
    from omegaconf import OmegaConf

    state = {
        "args": None,
        "cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        "model": model.state_dict(),
        "criterion": None,
        "optimizer_history": [
            {
                "criterion_name": criterion_name,
                "optimizer_name": "Adam",
                "lr_scheduler_state": {"best": None},
                "num_updates": 0,
            }
        ],
        "task_state": {},
        "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 0}},
    }
    torch.save(state, str(path))
    return str(path)


def build_untrained_drafter(data, seed=1, block_size=4, extra=()):
    """(model, task, cfg): an untrained specdec_nat_tiny on ``data``'s dictionary."""
    import torch
    from fairseq import tasks

    _, cfg = train_args_namespace(
        data, *NAT_ARGS, "--block-size", str(block_size), "--dropout", "0.0", "--cpu",
        "--optimizer", "adam", "--max-update", "100", *extra,
    )
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(seed)
    model = task.build_model(cfg.model)
    return model, task, cfg


def load_model(path, data):
    """(model, task) through fairseq's own loader (and so through the plugin's
    safe torch.load)."""
    import fairseq_specdec  # noqa: F401
    from fairseq import checkpoint_utils

    models, _, task = checkpoint_utils.load_model_ensemble_and_task([str(path)], arg_overrides={"data": str(data)})
    return models[0].eval(), task


def _dataset(task, split):
    """``split``'s dataset, loaded where the task has not loaded it yet."""
    if split not in task.datasets:
        task.load_dataset(split)
    return task.dataset(split)


def batches(task, split, batch_size):
    """Every sample of ``split`` in batches of at most ``batch_size`` sentences."""
    dataset = _dataset(task, split)
    itr = task.get_batch_iterator(
        dataset=dataset,
        max_sentences=batch_size,
        required_batch_size_multiple=1,
        ignore_invalid_inputs=False,
        disable_iterator_cache=True,  # fairseq would return the first call's batching again
    ).next_epoch_itr(shuffle=False)
    return list(itr)


def mixed_batches(task, split, batch_size):
    """Every sample of ``split`` in batches of at most ``batch_size``
    consecutive ids, sources of every length together (as a corpus in its
    own order gives), where :func:`batches` groups sources of one length:
    a batch whose rows finish at different steps even where the model has
    learned the toy corpus's lengths, which follow from the source's."""
    dataset = _dataset(task, split)
    return [dataset.collater([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
            for start in range(0, len(dataset), batch_size)]


# ---------------------------------------------------------------- in-process generation
def run_generator(gen, model, samples):
    """{id: hypothesis} of ``gen`` on ``samples``."""
    out = {}
    for sample in samples:
        hypos = gen.generate([model], sample)
        assert len(hypos) == len(sample["id"])
        for i, sid in enumerate(sample["id"].tolist()):
            assert sid not in out
            assert len(hypos[i]) == 1
            out[sid] = hypos[i][0]
    return out


def assert_identical(ref, got, atol=1e-4):
    """In-process hypotheses: same ids, tokens, scores and positional scores."""
    import torch

    assert sorted(got) == sorted(ref)
    for i in ref:
        r, g = ref[i], got[i]
        assert g["tokens"].tolist() == r["tokens"].tolist(), f"sentence {i}"
        assert abs(float(g["score"]) - float(r["score"])) <= atol, f"sentence {i}: score"
        assert g["positional_scores"].shape == r["positional_scores"].shape
        assert torch.allclose(g["positional_scores"], r["positional_scores"], atol=atol), f"sentence {i}"


def read_stats(path):
    with open(path) as f:
        return {d["id"]: d for d in map(json.loads, f)}


def check_stats(stats, hyps, k):
    """Per-sentence statistics agree with the output."""
    assert sorted(stats) == sorted(hyps)
    for i, s in stats.items():
        n = len(hyps[i]["tokens"])  # EOS included
        assert s["length"] == n - 1
        assert s["iterations"] == len(s["accepted"]) >= 1
        assert sum(s["accepted"]) == n  # EOS included
        assert all(1 <= a <= k + 1 for a in s["accepted"])


#: the lean pass's product implementations (the backend's choice); a test of one
#: this machine cannot run skips (skip_unless_gemm), and test_rowgemm fails
#: where the extension should have been built and was not.  Not read from
#: the package here: importing the plugin at collection time changes how
#: fairseq's logging is set up for every later test.
GEMMS = ["torch", "rowgemm"]


def profiled_passes(by_name):
    """The iterations of a profiled decoder (its rows of
    scripts/profile-draft-verify.py's JSON keyed by component name before
    " ("): its ordinary verify passes plus its calls of screened greedy
    steps (one or more steps each)."""
    return sum(by_name[name]["calls"] for name in ("verifier pass", "verifier pass, screened greedy steps")
               if name in by_name)


def gemm_available(gemm):
    from fairseq_specdec.kernels import rowgemm

    return gemm == "torch" or rowgemm.unavailable_reason() is None


def skip_unless_gemm(gemm):
    import pytest

    if not gemm_available(gemm):
        pytest.skip(f"the {gemm} products cannot run here")


#: the native products' instruction sets the tests run them on: ``avx512``
#: where the CPU has AVX-512F (skipped elsewhere), its emulation on AVX2
#: everywhere (the same blocks' logic), and the default ``avx2``
ISAS = ["avx2", "avx512", "avx512-emulated"]


@contextlib.contextmanager
def products_isa(name):
    """The native products on instruction set ``name`` inside the block, the
    import-time choice restored after it; skips where this CPU cannot run
    it (the extension's own switch, which FAIRSEQ_SPECDEC_ISA sets at
    import: fairseq_specdec/kernels/__init__.py)."""
    import pytest

    from fairseq_specdec import kernels

    if kernels.unavailable_reason() is not None:
        pytest.skip(kernels.unavailable_reason())
    if name == "avx512" and not kernels.has_avx512():
        pytest.skip("this CPU has no AVX-512F")
    before = kernels.isa_by_rows()
    assert kernels._ext.select_isa(name) == name
    try:
        yield
    finally:
        kernels.set_isa_by_rows(before)

OPTION_SETS = {
    "default": dict(max_len_a=0, max_len_b=200, min_len=1),
    # the length limit falls inside a block (k = 4 > 3): fairseq forces EOS at step 3
    "max_len_3": dict(max_len_a=0, max_len_b=3, min_len=1),
    # longer than any natural output (targets have at most 12 tokens + EOS)
    "min_len_15": dict(max_len_a=0, max_len_b=200, min_len=15),
    "lenpen_unkpen_temp": dict(max_len_a=0, max_len_b=200, min_len=1, len_penalty=0.5, unk_penalty=-3.0, temperature=0.7),
}


def seq_gen(model, tgt_dict, opts):
    from fairseq.sequence_generator import SequenceGenerator

    return SequenceGenerator([model], tgt_dict, beam_size=1, **opts)


def environment(env):
    """os.environ with ``env`` set inside (the benchmark's row environments)."""
    from fairseq_specdec.bench.loading import environment as _environment

    return _environment(env)


def make_generator(model, drafter, tgt_dict, k, acceptance=None, backend="auto", verifier=None, stats=None, off=(),
                   static=None, **opts):
    """A SpeculativeGenerator as the builder makes one: the backend resolved
    from ``backend`` (native parts ``off``, ``static`` shapes for the static
    pass's tests), fairseq's options ``opts`` (DecodeSettings' fields); with
    ``verifier``, that verify pass replaces the backend's."""
    from fairseq_specdec.generation import DecodeSettings, SpeculativeGenerator, StrictAcceptance, resolve_backend

    acceptance = acceptance or StrictAcceptance()
    settings = DecodeSettings(block_size=k, **opts)
    resolved = resolve_backend(backend, model, acceptance, settings.temperature, settings.unk_penalty,
                               off=frozenset(off), static=static)
    if verifier is not None:  # the screened greedy steps run the backend's own verify pass: none with another
        resolved = dataclasses.replace(resolved, verifier=verifier, screen=False)
    return SpeculativeGenerator(resolved, drafter, acceptance, tgt_dict, settings, stats)


def spec_gen(model, drafter, tgt_dict, k, opts, stats=None, acceptance=None):
    return make_generator(model, drafter, tgt_dict, k, acceptance, stats=stats, **opts)


def speculative_run(model, drafter, tgt_dict, k, opts, samples, stats_path, acceptance=None):
    """Decode ``samples`` with a SpeculativeGenerator that writes per-sentence
    statistics; returns ({id: hypothesis}, {id: statistics})."""
    from fairseq_specdec.generation import SpecDecStats

    gen = spec_gen(model, drafter, tgt_dict, k, opts, stats=SpecDecStats(str(stats_path)), acceptance=acceptance)
    got = run_generator(gen, model, samples)
    return got, read_stats(stats_path)


# ---------------------------------------------------------------- test drafters
def reference_drafter(refs, filler, cut=None, after_cut=None, check_prefix=False, with_scores=False):
    """A drafter (the loop's one contract) that drafts each row's reference
    continuation.

    ``refs``: {sentence id: token ids} (a decoder's output, EOS last); past
    the reference's end every slot is ``filler``.  ``cut(sid, k)``: the
    slot from which row ``sid``'s draft is wrong (None: never), filled from
    there with ``after_cut(sid)`` (default ``filler``).  ``check_prefix``:
    assert that the accepted prefix the state hands over is the reference's
    (the contract: BOS at 0, the accepted tokens at ``1 .. lengths[i]``).
    ``with_scores``: return zero log-probs with the drafts.  The sentence ids
    are read once per batch, in ``start_batch``: drafting reads nothing from
    the device."""
    import torch

    from fairseq_specdec.generation.drafters import Drafter

    class ReferenceDrafter(Drafter):
        def __init__(self):
            self.ids = None
            self.calls = 0

        def describe(self):
            return "the reference continuation (a test's drafter)"

        def start_batch(self, state):
            self.ids = state.sample["id"].tolist()

        def propose(self, state, k):
            self.calls += 1
            out = []
            for i, row in enumerate(state.rows):
                sid, n = self.ids[row], state.lengths_host[i]
                ref = refs.get(sid, [])
                if check_prefix:
                    assert state.tokens[i, 1 : n + 1].tolist() == ref[:n], f"sentence {sid}: wrong prefix"
                cont = (ref[n : n + k] + [filler] * k)[:k]
                if cut is not None:
                    c = cut(sid, k)
                    tail = after_cut(sid) if after_cut is not None else filler
                    cont = cont[:c] + [tail] * (k - c)
                out.append(cont)
            tokens = torch.tensor(out, dtype=torch.long, device=state.device).view(len(out), k)
            return tokens, (torch.zeros(tokens.shape, device=state.device) if with_scores else None)

        def reorder(self, order, order_host):
            pass

    return ReferenceDrafter()


def output_tokens(hypotheses):
    """{id: token ids} of {id: hypothesis}."""
    return {i: h["tokens"].tolist() for i, h in hypotheses.items()}


class PairedPass:
    """Two verify passes run side by side on the same state, every pass
    compared (log-probs, -inf slots and final decoder states, within float
    rounding); the loop follows ``main``.  Counts the passes, the ragged
    ones (rows of different lengths) and the widest."""

    impl = "paired"

    def __init__(self, main, ref):
        self.main, self.ref = main, ref
        self.passes = self.ragged_passes = self.widest = 0

    @property
    def model(self):
        return self.main.model

    @property
    def temperature(self):
        return self.main.temperature

    def encode(self, net_input):
        return self.main.encode(net_input)

    def reorder_encoder_out(self, encoder_out, order):
        return self.main.reorder_encoder_out(encoder_out, order)

    def start(self):
        self.main.start()
        self.ref.start()

    def forward(self, tokens, state, needed=None, tree=None):
        import torch

        got = self.main.forward(tokens, state, needed, tree)
        want = self.ref.forward(tokens, state, needed, tree)
        self.compare(got, want)
        self.passes += 1
        self.widest = max(self.widest, tokens.size(1))
        self.ragged_passes += len(set(state.lengths_host)) > 1
        self.after_pass(state)
        return got

    def compare(self, got, want):
        """One pass's log-probs (and the two passes' final states) compared:
        the same -inf slots, the rest within float rounding."""
        import torch

        assert got.shape == want.shape
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        finite = torch.isfinite(want)
        assert torch.isfinite(got[finite]).all()
        assert torch.allclose(got[finite], want[finite], atol=1e-5, rtol=1e-5)
        assert torch.allclose(self.main.last_features, self.ref.last_features, atol=1e-5, rtol=1e-5)

    def after_pass(self, state):
        """What a subclass records after each compared pass."""

    @property
    def last_features(self):
        return self.main.last_features

    def rollback(self, state, keep, keep_host, path=None):
        self.main.rollback(state, keep, keep_host, path)
        self.ref.rollback(state, keep, keep_host, path)

    def reorder(self, state, new_order, new_order_host):
        self.ref.reorder(state, new_order, new_order_host)
        self.main.reorder(state, new_order, new_order_host)


class BitwisePair(PairedPass):
    """A :class:`PairedPass` whose two passes must agree bit for bit: the
    same log-probs (-inf slots included) and the same final states."""

    def compare(self, got, want):
        import torch

        assert torch.equal(got, want), "the two passes' log-probs differ"
        assert torch.equal(self.main.last_features, self.ref.last_features), "the two passes' final states differ"


def partly_right(ref, d):
    """A drafter that proposes the reference continuation, wrong from slot
    ``sid % (k + 1)`` on: rows accept different numbers of drafts, so their
    lengths become ragged."""
    return reference_drafter(output_tokens(ref), d.index("b0"), cut=lambda sid, k: sid % (k + 1))


def strict_generator(model, drafter, tgt_dict, verifier, opts="default", k=4):
    """A strict SpeculativeGenerator whose verify pass is ``verifier``."""
    return make_generator(model, drafter, tgt_dict, k, verifier=verifier, **OPTION_SETS[opts])


def is_fresh_process_isa(name) -> bool:
    """Whether ``name`` is what another process of this machine, importing
    the plugin with FAIRSEQ_SPECDEC_ISA unset, reports as its products'
    instruction set: this process's on a CPU without AVX-512F (or torch's
    products where the kernels cannot run); on one with it, the measured
    choice, which may differ from this process's, so any mix of avx2 and
    avx512 (``kernels.isa``'s forms)."""
    import re

    from fairseq_specdec import kernels

    if kernels.unavailable_reason() is not None:
        return name == "torch"
    if not kernels.has_avx512():
        return name == kernels.isa()
    named = re.findall(r"avx[\w-]+", name)
    return bool(named) and set(named) <= {"avx2", "avx512"}
