import os, sys, time, torch, statistics
sys.path.insert(0, os.environ.get("TREE", "/work/main") + "/server")
from pagemill.cpu_kernels import decode_kernels
torch.set_num_threads(2)
k = decode_kernels()
B, ctx, bs, nh, nkv, D = 64, 160, 64, 9, 3, 64
blocks_per = (ctx + bs - 1) // bs
nb = B * blocks_per * 8
kc = torch.randn(nb, bs, nkv, D).bfloat16(); vc = torch.randn(nb, bs, nkv, D).bfloat16()
perm = torch.randperm(nb)[: B * blocks_per].view(B, blocks_per).to(torch.int32).contiguous()
q = torch.randn(B, nh, D).bfloat16()
lens = torch.full((B,), ctx, dtype=torch.int32)
cu = torch.arange(B + 1, dtype=torch.int32)
f1 = lambda: k.paged_attention(q, kc, vc, perm, lens, 0.125, None)
f2 = lambda: k.prefill_attention(q, kc, vc, perm, cu, lens, 0.125, None)
a, b = f1(), f2()
print("max diff", (a.float() - b.float()).abs().max().item())
t = {"decode": [], "prefill": []}
for _ in range(30):
    for n, f in (("decode", f1), ("prefill", f2)):
        s = time.perf_counter(); f(); t[n].append((time.perf_counter() - s) * 1e3)
print({n: round(statistics.median(v), 3) for n, v in t.items()}, "ms per layer")
