# In-process A/B of two kernel libraries on prefill steps (batch prompts of `prompt` tokens in one step).
import ctypes, os, sys, time, torch, statistics
sys.path.insert(0, "/work/main/server")
import pagemill.cpu_kernels as ck
from pagemill.cpu_kernels.gemm import GemmBf16Kernel
from pagemill.bench.cli import resolve_model_dir
from pagemill.bench.shard_driver import random_prompts, warm_runner
from pagemill.config import ShardConfig
from pagemill.proto import pb
from pagemill.shard.engine import ModelRunner
from pagemill.shard.harness import FakeRouter, step_response
torch.set_num_threads(2)
batch, prompt, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
runner = ModelRunner.from_shard_config(ShardConfig(model_dir=resolve_model_dir(None), uds_path="", dtype="bfloat16"))
warm_runner(runner, max_batch_size=64, max_prefill_tokens=2048, max_input=2100)
bd = runner.model.model.batched
libs = {lab: ctypes.CDLL(os.environ["LIB" + lab]) for lab in "AB"}
kern = {lab: (ck.DecodeKernels(l), GemmBf16Kernel(l)) for lab, l in libs.items()}
holders = [m for m in runner.model.modules() if isinstance(getattr(m, "gemm", None), GemmBf16Kernel)]
def use(lab):
    bd._kernels = kern[lab][0]
    for m in holders: m.gemm = kern[lab][1]
params = pb.NextTokenChooserParameters(repetition_penalty=1.0)
t = {"A": [], "B": []}
for i in range(reps):
    for lab in (("A", "B") if i % 2 == 0 else ("B", "A")):
        use(lab)
        router = FakeRouter(lambda r: step_response(runner.step(r)), runner.pool.num_blocks, runner.block_size)
        for rid, ids in enumerate(random_prompts(batch, prompt, runner.config.vocab_size)):
            router.add(rid, ids, 1, params=params, ignore_eos=True)
        s = time.perf_counter(); router.step(); t[lab].append((time.perf_counter() - s) * 1e3)
a, b = statistics.median(t["A"]), statistics.median(t["B"])
print(f"prefill {batch}x{prompt}: A {a:.1f} ms  B {b:.1f} ms  B/A {b/a:.3f}", flush=True)
