"""Small C++ kernels for the CPU hot paths, compiled on first use.

Layout:
- build.py: compiles every source under csrc/ into one library, once per machine and
  source version, and loads it with ctypes (no ninja, no torch headers).
- Bindings, one module per family: matvec.py (single-row linears), decode.py (the
  whole-layer decode kernels, paged and prefill attention, the KV write), gemm.py (the
  bfloat16 GEMM and its weight packing), int8.py (the int8 linear), rowwise.py (greedy
  sampling, norms, element-wise ops), read_rate.py (the benchmarks' memory floor).
- csrc/<family>/: the kernels. common/ (vector helpers, bf16 rows, AMX setup, thread
  teams), attention/ (paged decode and prefill attention, KV write), gemm/ (matvec, bf16
  GEMM on AVX512-BF16 or AMX tiles), int8/ (int8 linears on VNNI or AMX-INT8 tiles),
  decode/ (whole decoder layers in one call), rowwise/ (greedy, norms, element-wise).
  Every header includes what it uses and compiles on its own (tests/test_kernel_headers.py).

Each kernel takes float32 and bfloat16 (common/bf16_rows.h: AVX512-BF16 dot products where
the CPU has them, else widened to float32; a scalar fallback without AVX-512). When no
compiler is found or the build fails, the binding getters return None (logged once) and
callers keep torch's own ops. `pagemill launch --no-cpu-kernels` turns them off. docs/cpu.md
explains the paths and which CPU flags pick each.
"""
