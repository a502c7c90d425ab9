"""Load the CPU kernel library vLLM itself picks for this CPU (vllm.platforms.cpu.import_kernels):
vllm._C needs AVX512-BF16, vllm._C_AVX512 AVX512, vllm._C_AVX2 AVX2 (importing vllm._C on an AVX2
host dies of SIGILL). Exits non-zero if it does not load (e.g. libnuma.so.1 missing). Each library's
module name is _C, so after a good load Python says "does not define module export function":
expected, as vLLM treats it."""

import importlib
import sys

import torch

avx512 = torch.cpu._is_avx512_supported()
name = ("vllm._C" if avx512 and torch.cpu._is_avx512_bf16_supported() else
        "vllm._C_AVX512" if avx512 else "vllm._C_AVX2")
try:
    importlib.import_module(name)
except ImportError as exc:
    if "does not define module export function" not in str(exc):
        sys.exit(f"vLLM's CPU kernels ({name}) do not load: {exc}")
print(f"vLLM's CPU kernels load: {name}")
