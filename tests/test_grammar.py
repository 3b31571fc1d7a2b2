"""Constrained decoding: JSON schema and regex grammars on llguidance masks, per-request errors."""

from __future__ import annotations

import json
import random
import re
import shutil

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from pagemill.grammar.matcher import GrammarCompiler, GrammarError
from pagemill.proto import pb
from pagemill.bench.block_router import BlockRouter
from test_speculative import generate, make_runner

JSON, REGEX = pb.GRAMMAR_TYPE_JSON, pb.GRAMMAR_TYPE_REGEX


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_model_dir):
    """A random-weight tiny Llama with the default model's tokenizer (vocab 49152)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-tok")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(out)
    shutil.copy(default_model_dir / "tokenizer.json", out / "tokenizer.json")
    return str(out)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Bounded schemas (string lengths, integer ranges, array sizes), so that a
    constrained output always completes within the token budget."""
    kinds = ["integer", "string", "boolean", "enum", "array"] + (["object"] if depth < 1 else [])
    props = {}
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(kinds)
        if kind == "integer":
            lo = rng.randint(-50, 50)
            s = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
        elif kind == "string":
            s = {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
        elif kind == "boolean":
            s = {"type": "boolean"}
        elif kind == "enum":
            s = {"enum": rng.sample(["red", "green", "blue", "cyan", 7, None], rng.randint(1, 4))}
        elif kind == "array":
            s = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                 "minItems": 1, "maxItems": rng.randint(1, 3)}  # fmt: skip
        else:
            s = random_schema(rng, depth + 1)
        props[f"{kind[:3]}_{i}"] = s
    required = rng.sample(sorted(props), rng.randint(0, len(props)))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def test_compile_errors_are_grammar_errors(tiny_dir):
    c = GrammarCompiler(tiny_dir, 49152, [2])
    assert c.compile(None) is None and c.compile(pb.Grammar()) is None
    for value, message in [('{"type": "nope"}', "invalid JSON schema"), ("{not json", "invalid JSON schema"),
                           ("[1, 2]", "invalid JSON schema")]:  # fmt: skip
        with pytest.raises(GrammarError, match=message):
            c.compile(pb.Grammar(type=JSON, value=value))
    with pytest.raises(GrammarError, match="invalid regex"):
        c.compile(pb.Grammar(type=REGEX, value="[a-z]+("))
    with pytest.raises(GrammarError, match="tokenizer.json"):
        GrammarCompiler("/nonexistent", 49152, [2]).compile(pb.Grammar(type=REGEX, value="a"))
    for any_object in ("", "{}"):  # OpenAI json_object
        assert c.compile(pb.Grammar(type=JSON, value=any_object)) is not None


def test_fifty_random_json_schemas_all_validate(tiny_dir, tokenizer):
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(50)]
    prompts = [[rng.randrange(3, 49000) for _ in range(rng.randint(2, 12))] for _ in schemas]
    params = [pb.NextTokenChooserParameters(do_sample=True, temperature=1.0, seed=i, has_seed=True)
              for i in range(25)] + [pb.NextTokenChooserParameters()] * 25  # fmt: skip
    grammars = [pb.Grammar(type=JSON, value=json.dumps(s)) for s in schemas]
    out = generate(make_runner(tiny_dir, blocks=2000), prompts, 160, params=params, grammars=grammars)
    for i, schema in enumerate(schemas):
        o = out[i]
        assert o.error == "" and o.finish == pb.FINISH_REASON_EOS_TOKEN, (schema, o)
        assert o.ids[-1] == 2  # the finished grammar forced EOS (ignore_eos is set)
        text = tokenizer.decode(o.ids[:-1], skip_special_tokens=False)
        jsonschema.validate(json.loads(text), schema)


def test_regex_outputs_match(tiny_dir, tokenizer):
    patterns = [r"\d{3}-\d{4}", r"(yes|no)", r"[a-z]{2,6}@[a-z]{3,5}\.(com|org)", r"#[0-9a-f]{6}",
                r"(Mon|Tue|Wed) [1-9]:[0-5][0-9]"]  # fmt: skip
    grammars = [pb.Grammar(type=REGEX, value=p) for p in patterns]
    out = generate(make_runner(tiny_dir), [[100, 200, 300]] * len(patterns), 40, grammars=grammars)
    for i, p in enumerate(patterns):
        assert out[i].finish == pb.FINISH_REASON_EOS_TOKEN
        assert re.fullmatch(p, tokenizer.decode(out[i].ids[:-1])), (p, out[i])


def test_a_bad_grammar_fails_only_its_request(tiny_dir, tokenizer):
    """Its Generation carries the error and no tokens; the others run on, speculating."""
    runner = make_runner(tiny_dir, speculate=2)
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11], [12, 13]]
    grammars = [None, pb.Grammar(type=JSON, value='{"type": "nope"}'), pb.Grammar(type=REGEX, value="(a|b)c")]
    first_step = []
    orig = runner.step
    runner.step = lambda req: (r := orig(req), first_step.extend(r.generations) if not first_step else None)[0]
    out = generate(runner, prompts, 8, grammars=grammars)
    bad = next(g for g in first_step if g.request_id == 1)
    assert "invalid JSON schema" in bad.error and not bad.HasField("tokens")
    assert out[1].ids == [] and out[1].error
    plain = generate(make_runner(tiny_dir), prompts[:1], 8)
    assert out[0].ids == plain[0].ids and out[0].finish == pb.FINISH_REASON_LENGTH
    assert tokenizer.decode(out[2].ids[:-1]) in ("ac", "bc") and out[2].finish == pb.FINISH_REASON_EOS_TOKEN


def test_default_model_writes_valid_json(default_model_dir, tokenizer):
    """SmolLM2 itself under ten random schemas (a real model, so the values are sensible)."""
    rng = random.Random(1)
    schemas = [random_schema(rng) for _ in range(10)]
    prompts = []
    for s in schemas:
        chat = (f"<|im_start|>user\nReply with a JSON object for this schema: {json.dumps(s)}<|im_end|>\n"
                "<|im_start|>assistant\n")  # fmt: skip
        prompts.append(tokenizer.encode(chat, add_special_tokens=False).ids)
    grammars = [pb.Grammar(type=JSON, value=json.dumps(s)) for s in schemas]
    out = generate(make_runner(str(default_model_dir), blocks=400), prompts, 120, grammars=grammars)
    for i, schema in enumerate(schemas):
        assert out[i].finish == pb.FINISH_REASON_EOS_TOKEN, out[i]
        jsonschema.validate(json.loads(tokenizer.decode(out[i].ids[:-1])), schema)


def test_service_step_answers_a_bad_grammar_per_request(tiny_dir):
    """Through ShardService: the RPC succeeds, the bad request gets `error` and is dropped,
    the good one decodes on, and Info reports speculate."""
    import asyncio

    from pagemill.bench.block_router import BlockRouter
    from pagemill.shard.service import ShardService

    runner = make_runner(tiny_dir, speculate=3)
    service = ShardService(runner)
    assert asyncio.run(service.Info(pb.InfoRequest(), None)).speculate == 3
    router = BlockRouter(lambda req: asyncio.run(service.Step(req, None)), runner.pool.num_blocks, runner.block_size,
                        speculate=3)  # fmt: skip
    router.add(1, [5, 6, 7], 4)
    router.add(2, [5, 6, 7], 4, grammar=pb.Grammar(type=REGEX, value="(unclosed"))
    resp = router.step()
    by_id = {g.request_id: g for g in resp.generations}
    assert "invalid regex" in by_id[2].error and len(by_id[2].tokens.ids) == 0
    assert len(by_id[1].tokens.ids) == 1 and not by_id[1].error
    assert set(runner.requests) == {1} and resp.total_ns >= resp.forward_ns > 0
    assert [g.request_id for g in router.step().generations] == [1]


def test_a_preempted_constrained_request_resumes_its_grammar(tiny_dir, tokenizer):
    """Resumed with its generated tokens (generated_len), the grammar continues after them."""
    pattern = r"(abc|xyz)[0-9]{3}"
    grammar = pb.Grammar(type=REGEX, value=pattern)
    full = generate(make_runner(tiny_dir), [[100, 200]], 20, grammars=[grammar])[0]
    router = BlockRouter.for_runner(make_runner(tiny_dir))
    out = router.add(0, [100, 200], 20, grammar=grammar, ignore_eos=True)
    router.step()
    router.step()  # two tokens generated, then preempted: resent with generated_len 2, grammar replayed
    router.preempt(0)
    gens = router.step().generations
    assert not gens[0].error and list(gens[0].tokens.ids) == full.ids[2:3]
    assert out.ids == full.ids[:3]
    assert router.run()[0].ids == full.ids
    assert re.fullmatch(pattern, tokenizer.decode(full.ids[:-1]))
