"""The machine named in every figure's header (fairseq_specdec/bench/machine.py)."""
from fairseq_specdec import kernels
from fairseq_specdec.bench import machine

INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 amx_tile amx_int8

processor\t: 1
model name\t: something else
"""

# CTranslate2 4.x's CT2_VERBOSE=1 lines when a translator loads on a CPU (as it prints them)
CT2_LOG = """[2026-11-27 00:57:09.625] [ctranslate2] [thread 1] [info] CPU: GenuineIntel (SSE4.1=true, AVX=true, AVX2=true, AVX512=true)
[2026-11-27 00:57:09.625] [ctranslate2] [thread 1] [info]  - Selected ISA: AVX512
[2026-11-27 00:57:09.625] [ctranslate2] [thread 1] [info]  - Use Intel MKL: true
[2026-11-27 00:57:09.625] [ctranslate2] [thread 1] [info]  - SGEMM backend: MKL (packed: false)
[2026-11-27 00:57:09.625] [ctranslate2] [thread 1] [info]  - GEMM_S16 backend: MKL (packed: false)
[2026-11-27 00:57:09.625] [ctranslate2] [thread 1] [info]  - GEMM_S8 backend: MKL (packed: false, u8s8 preferred: true)
"""


def test_cpu_info_names_the_first_processor_and_its_vector_features(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(INTEL)
    info = machine.cpu_info(str(path))
    assert info["cpu"] == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz (family 6, model 143)"
    assert info["cpu_features"] == ["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile",
                                    "amx_int8"]


def test_cpu_info_without_proc_cpuinfo_still_names_something(tmp_path):
    info = machine.cpu_info(str(tmp_path / "missing"))
    assert info["cpu"] and info["cpu_features"] == []


def test_ctranslate2_log_gives_its_isa_and_product_backends():
    assert machine.parse_ct2_log(CT2_LOG) == {"isa": "AVX512", "mkl": "true", "sgemm": "MKL", "gemm_s8": "MKL"}
    assert machine.parse_ct2_log("no log at all") == {}


def test_describe_and_header_name_the_cpu_and_every_products_isa():
    info = machine.describe()
    assert info["plugin_isa"] == (kernels.isa() or "torch")
    line = machine.header(info)
    assert line.startswith(f"CPU: {info['cpu']} [") and f"plugin products: {info['plugin_isa']}" in line
    assert "CTranslate2" not in line
    info["ctranslate2"] = {"version": "4.8.5", **machine.parse_ct2_log(CT2_LOG)}
    assert "CTranslate2 4.8.5 (ISA AVX512, float32 products MKL, int8 products MKL)" in machine.header(info)
