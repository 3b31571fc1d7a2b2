"""The workload floors: what continuous batching saves over static batching, step by step."""

from pagemill.bench.roofline import Machine
from pagemill.bench.workload_floor import continuous_floor, static_floor
from pagemill.models.config import ModelConfig

CFG = ModelConfig.from_dict({
    "model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
})  # fmt: skip
MACHINE = Machine(threads=2, copy_gbs=20.0, sum_gbs=25.0, bandwidth_gbs=25.0, matmul_gflops=100.0)


def test_equal_lengths_cost_the_same_either_way():
    prompts, outputs = [16] * 8, [32] * 8
    cont, stat = continuous_floor(CFG, MACHINE, prompts, outputs), static_floor(CFG, MACHINE, prompts, outputs, 8)
    assert abs(cont.total_s - stat.total_s) < 1e-12
    assert cont.computed_tokens == stat.computed_tokens == 8 * 32


def test_static_batching_pays_for_padding_continuous_does_not():
    prompts, outputs = [16] * 4, [4, 8, 16, 256]
    cont, stat = continuous_floor(CFG, MACHINE, prompts, outputs), static_floor(CFG, MACHINE, prompts, outputs, 4)
    assert cont.computed_tokens == sum(outputs)
    assert stat.computed_tokens == 4 * 256
    assert cont.total_s < stat.total_s
    assert cont.throughput_ceiling > stat.throughput_ceiling


def test_a_memory_bound_step_costs_one_pass_over_the_weights():
    # Batch 1, tiny context: the floor is the weight bytes over the bandwidth.
    f = continuous_floor(CFG, MACHINE, [1], [2])
    h, i = 64, 128
    d = h // 4
    params = 2 * (h * (4 * d + 2 * 2 * d) + 4 * d * h + 3 * h * i) + 1000 * h
    kv = 2 * 2 * 2 * (2 * d) * 4  # 2 tokens of context x (K, V) x 2 layers x 2 kv heads of d, float32
    assert abs(f.decode_s - (params * 4 + kv) / 25e9) < 1e-12


def test_gemm_rate_shrinks_a_product_that_would_take_too_long():
    import torch

    from pagemill.bench.roofline import gemm_gflops

    rate, n = gemm_gflops(torch.float32, 512, 1, budget_s=1e-9)
    assert n == 256 and rate > 0
    rate, n = gemm_gflops(torch.float32, 320, 1, budget_s=60.0)
    assert n == 320 and rate > 0
