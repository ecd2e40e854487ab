#!/usr/bin/env python3
"""Static SASS instruction counts of a CUDA probe's kernels, without a GPU or nvcc.

Compiles the device part of FILE.cu (everything before its "// Median time" host
section, host-only includes dropped) with NVRTC for sm_90, assembles the PTX with
ptxas, and prints each kernel's registers and its SASS instruction count (the size of
its .text section over 16 bytes, the size of every sm_90 instruction):

    python3 bench/probes/sass_count.py bench/probes/q4k_m1.cu \
        'template __global__ void xreg_m1<2,16,FloatX>(const unsigned char*, const unsigned char*,
         const unsigned long long*, FloatX, float*, unsigned, unsigned);'

The extra argument is appended to the source (explicit instantiations of the kernels to
count). NVRTC and ptxas come from PyPI wheels, unpacked into $CUDA_WHEELS (default
/tmp/cuda):

    pip download --no-deps nvidia-cuda-nvcc-cu12 nvidia-cuda-nvrtc-cu12 \
        nvidia-cuda-runtime-cu12 -d /tmp/cuda/whl
    for w in /tmp/cuda/whl/*.whl; do python3 -m zipfile -e $w /tmp/cuda; done
    chmod +x /tmp/cuda/nvidia/cuda_nvcc/bin/ptxas

Counts are static (a loop body counts once), so compare variants of one kernel, not
kernels with different loop structure.
"""
import ctypes
import os
import re
import subprocess
import sys
import tempfile

HOST_INCLUDES = r"#include <(cuda_runtime|algorithm|cmath|cstdlib|cstdio|cstring|vector|type_traits)"


def device_source(path, extra):
    src = open(path).read()
    dev = src[: src.index("// Median time")]
    dev = "\n".join(line for line in dev.splitlines() if not re.match(HOST_INCLUDES, line))
    # The host's error macro needs cuda_runtime.h; the device part never uses it.
    dev = dev.replace("#define CHECK", "#define CHECK_HOST_ONLY")
    return dev + "\n" + extra + "\n"


def nvrtc_ptx(root, source):
    lib = ctypes.CDLL(os.path.join(root, "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"))
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"probe.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [b"-arch=compute_90", b"-std=c++17", b"-fmad=false", b"-default-device",
            b"-I" + os.path.join(root, "nvidia/cuda_runtime/include").encode()]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc:
        sys.exit("NVRTC failed:\n" + log.value.decode())
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    root = os.environ.get("CUDA_WHEELS", "/tmp/cuda")
    ptx = nvrtc_ptx(root, device_source(sys.argv[1], sys.argv[2]))
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin = os.path.join(tmp, "probe.ptx"), os.path.join(tmp, "probe.cubin")
        open(ptx_path, "wb").write(ptx)
        ptxas = os.path.join(root, "nvidia/cuda_nvcc/bin/ptxas")
        info = subprocess.run([ptxas, "-arch=sm_90", "-v", ptx_path, "-o", cubin],
                              capture_output=True, text=True, check=True).stderr
        regs = dict(re.findall(r"Compiling entry function '(\S+)'.*?\n.*?\n.*?Used (\d+) registers", info, re.S))
        sections = subprocess.run(["readelf", "-S", "-W", cubin], capture_output=True, text=True).stdout
        for line in sections.splitlines():
            fields = line.split()
            at = next((i for i, f in enumerate(fields) if f.startswith(".text.")), None)
            if at is None:
                continue
            name = fields[at][len(".text."):]
            print(f"{int(fields[at + 4], 16) // 16:7d} instructions {regs.get(name, '?'):>4} registers  {name}")


if __name__ == "__main__":
    main()
