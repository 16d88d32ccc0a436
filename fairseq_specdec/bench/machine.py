"""The machine a figure was measured on, for the header of every benchmark,
interleaved run and roofline (and so of every report made from them).

:func:`describe` returns a dict:

* ``cpu``: the CPU's model name (``/proc/cpuinfo``), with its vendor family
  and model numbers (a virtual machine may name only "AMD EPYC");
* ``cpu_features``: the instruction sets among :data:`FEATURES` that it has;
* ``cores``: logical CPUs the process sees;
* ``plugin_isa``: the instruction set of the plugin's native products
  (:func:`fairseq_specdec.kernels.isa`), or ``"torch"`` where they cannot
  run (torch's products then);
* ``plugin_prefetch``: whether the native float32 products prefetch the
  next block of weights (:func:`fairseq_specdec.kernels.describe_prefetch`:
  ``on``, ``off``, or by class of row counts), absent where they cannot run;
* ``plugin_prefetch_measured`` (only where the plugin measured it): ``{first
  rows: {probe: {"on" or "off": [ms of each round]}}}``
  (:data:`fairseq_specdec.kernels.PREFETCH_MEASURED`);
* ``torch``: torch's version and the CPU capability its own kernels use
  (``torch.backends.cpu.get_cpu_capability()``);
* ``ctranslate2`` (when asked with a converted model): its version and what
  its ``CT2_VERBOSE`` log says when it loads that model on the CPU: the
  selected ISA and the backends of its float32 and int8 products.

:func:`header` writes it as one line.
"""
import os
import platform
import re
import subprocess
import sys
from typing import Dict, Optional

#: /proc/cpuinfo flags reported (what the products of the plugin, torch and CTranslate2 may use)
FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")

#: CT2_VERBOSE log lines -> result keys
_CT2_LINES = {"Selected ISA": "isa", "SGEMM backend": "sgemm", "GEMM_S8 backend": "gemm_s8", "Use Intel MKL": "mkl"}


def cpu_info(path: str = "/proc/cpuinfo") -> Dict:
    """``{"cpu", "cpu_features"}`` of the first processor in ``path`` (Linux);
    elsewhere the platform's processor name and no features."""
    try:
        with open(path) as f:
            text = f.read().split("\n\n")[0]
    except OSError:
        return {"cpu": platform.processor() or platform.machine() or "unknown", "cpu_features": []}
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    name = fields.get("model name") or fields.get("Processor") or platform.machine() or "unknown"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    flags = set(fields.get("flags", "").split())
    return {"cpu": name, "cpu_features": [f for f in FEATURES if f in flags]}


def ct2_info(model_dir: str, compute_type: str = "int8", timeout: float = 120.0) -> Dict:
    """What CTranslate2 logs (``CT2_VERBOSE=1``) when it loads ``model_dir``
    on the CPU with ``compute_type``, in a child process so that its log
    reaches nothing else: ``{"version", "isa", "sgemm", "gemm_s8", "mkl"}``
    (``error`` instead of the log's keys where the child failed)."""
    import ctranslate2

    code = ("import sys, ctranslate2; ctranslate2.Translator(sys.argv[1], device='cpu', "
            "compute_type=sys.argv[2], inter_threads=1, intra_threads=1)")
    env = dict(os.environ, CT2_VERBOSE="1")
    info = {"version": ctranslate2.__version__}
    try:
        done = subprocess.run([sys.executable, "-c", code, model_dir, compute_type], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        info["error"] = f"loading {model_dir} took more than {timeout:.0f} s"
        return info
    info.update(parse_ct2_log(done.stderr + done.stdout))
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        info["error"] = lines[-1] if lines else f"exit status {done.returncode}"
    return info


def parse_ct2_log(text: str) -> Dict[str, str]:
    """The keys of :data:`_CT2_LINES` from CTranslate2's verbose log, e.g.
    ``[info]  - SGEMM backend: DNNL (packed: false)`` -> ``{"sgemm": "DNNL"}``."""
    found = {}
    for line in text.splitlines():
        for label, key in _CT2_LINES.items():
            match = re.search(re.escape(label) + r":\s*([^\s(]+)", line)
            if match and key not in found:
                found[key] = match.group(1)
    return found


def describe(ct2_model: Optional[str] = None) -> Dict:
    """The machine (see the module's docstring); with ``ct2_model`` (a
    converted model directory) CTranslate2's choices too."""
    import torch

    from .. import kernels

    info = cpu_info()
    info["cores"] = os.cpu_count()
    info["plugin_isa"] = kernels.isa() or "torch"
    prefetch = kernels.describe_prefetch()
    if prefetch is not None:
        info["plugin_prefetch"] = prefetch
    if kernels.PREFETCH_MEASURED:
        info["plugin_prefetch_measured"] = {
            str(first): {probe: {mode: [round(ms, 3) for ms in rounds] for mode, rounds in by_mode.items()}
                         for probe, by_mode in by_probe.items()}
            for first, by_probe in kernels.PREFETCH_MEASURED.items()}
    info["torch"] = {"version": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if ct2_model is not None:
        info["ctranslate2"] = ct2_info(ct2_model)
    return info


def header(info: Dict) -> str:
    """One line naming the machine, for a table's header."""
    features = ", ".join(info.get("cpu_features", [])) or "none of " + "/".join(FEATURES[:3])
    parts = [f"CPU: {info['cpu']} [{features}], {info.get('cores', '?')} logical CPUs",
             f"plugin products: {info['plugin_isa']}"
             + (f", prefetch {info['plugin_prefetch']}" if "plugin_prefetch" in info else ""),
             f"torch {info['torch']['version']} ({info['torch']['cpu_capability']})"]
    ct2 = info.get("ctranslate2")
    if ct2 is not None:
        if "error" in ct2:
            parts.append(f"CTranslate2 {ct2['version']} (its log: {ct2['error']})")
        else:
            parts.append(f"CTranslate2 {ct2['version']} (ISA {ct2.get('isa', '?')}, float32 products "
                         f"{ct2.get('sgemm', '?')}, int8 products {ct2.get('gemm_s8', '?')})")
    return "; ".join(parts)
