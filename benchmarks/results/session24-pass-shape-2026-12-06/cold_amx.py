# Cold (ring over ~600 MB in huge pages) AMX GEMM A/B/C: LIBS=a.so,b.so; args: rows linears
import ctypes, os, sys, time, statistics, torch
sys.path.insert(0, "/work/main/server")
from pagemill.cpu_kernels.gemm import GemmBf16Kernel, pack_bf16
torch.set_num_threads(2)
libs = os.environ["LIBS"].split(",")
ks = [GemmBf16Kernel(ctypes.CDLL(l)) for l in libs]
SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
rows_list = [int(r) for r in sys.argv[1].split(",")]
for name in sys.argv[2].split(","):
    n, k = SHAPES[name]
    copies = max(2, (600 << 20) // (n * k * 2))
    w = pack_bf16(torch.randn(n, k).bfloat16())
    ring = torch.empty((copies,) + tuple(w.shape), dtype=w.dtype)
    for i in range(copies): ring[i].copy_(w)
    for rows in rows_list:
        x = torch.randn(rows, k).bfloat16()
        out = [k_(x, ring[0], None, n) for k_ in ks]
        for o in out[1:]: assert torch.equal(o, out[0])
        t = [[] for _ in ks]
        c = 0
        for rep in range(15):
            order = range(len(ks)) if rep % 2 == 0 else reversed(range(len(ks)))
            for j in order:
                s = time.perf_counter()
                for _ in range(40):
                    ks[j](x, ring[c % copies], None, n); c += 1
                t[j].append((time.perf_counter() - s) / 40 * 1e6)
        m = [statistics.median(v) for v in t]
        print(f"{name:8s} rows {rows:3d}: " + "  ".join(f"{os.path.basename(l)} {v:7.1f} us ({v/m[0]:.3f})" for l, v in zip(libs, m)), flush=True)
