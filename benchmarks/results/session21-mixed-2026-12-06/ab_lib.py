# In-process A/B of two kernel libraries on the batched layer: A = /tmp/exp/libbase/libbase.so, B = main's.
import ctypes, os, sys, time, torch, statistics
sys.path.insert(0, os.environ.get("TREE", "/work/main") + "/server")
import pagemill.cpu_kernels as ck
from pagemill.bench.cli import resolve_model_dir
from pagemill.bench.shard_driver import random_prompts, warm_runner
from pagemill.config import ShardConfig
from pagemill.proto import pb
from pagemill.shard.engine import ModelRunner
from pagemill.shard.harness import FakeRouter, step_response
torch.set_num_threads(2)
batch, prompt, steps, chunk = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
runner = ModelRunner.from_shard_config(ShardConfig(model_dir=resolve_model_dir(None), uds_path="", dtype="bfloat16"))
warm_runner(runner, max_batch_size=batch + 16, max_prefill_tokens=2048, max_input=prompt + steps * 2 + 8)
bd = runner.model.model.batched
kB = bd._kernels
kA = ck.DecodeKernels(ctypes.CDLL("/tmp/exp/libbase/libbase.so"))
router = FakeRouter(lambda r: step_response(runner.step(r)), runner.pool.num_blocks, runner.block_size)
params = pb.NextTokenChooserParameters(repetition_penalty=1.0)
for rid, ids in enumerate(random_prompts(batch, prompt, runner.config.vocab_size)):
    router.add(rid, ids, 2 * steps + 8, params=params, ignore_eos=True)
for _ in range(6): router.step()
extra = random_prompts(2 * steps + 2, max(chunk, 1), runner.config.vocab_size)
t = {"A": [], "B": []}
for i in range(steps):
    for lab in (("A", "B") if i % 2 == 0 else ("B", "A")):
        bd._kernels = kA if lab == "A" else kB
        if chunk: router.add(10000 + 2 * i + (lab == "B"), extra[2 * i + (lab == "B")], 1, params=params, ignore_eos=True)
        s = time.perf_counter(); router.step(); t[lab].append((time.perf_counter() - s) * 1e3)
a, b = statistics.median(t["A"]), statistics.median(t["B"])
print(f"batch {batch} chunk {chunk}: A {a:.1f} ms  B {b:.1f} ms  B/A {b/a:.3f}")
