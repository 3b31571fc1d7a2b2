"""--reasoning-parser: the think block of a reasoning model split into
`reasoning_content`, streamed and not, and a response_format grammar that
holds for the answer after the block only.

A tiny random-weight model whose tokenizer has `<think>` and `</think>` as
tokens and whose chat template opens the block (`<|im_start|>assistant\\n<think>\\n`,
as DeepSeek-R1's does). A logit bias on `</think>` and sampling let random
weights close the block after a few tokens; seeds make it reproducible.
"""

import json

import jsonschema
import openai
import pytest

from server import launch

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
ASK = [{"role": "user", "content": "Is the sky blue?"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def think_ids(tmp_path_factory, default_model_dir):
    """(model dir, id of `</think>`)."""

    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-think")
    tok = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    tok.add_tokens(["<think>", "</think>"])
    tok.save(str(out / "tokenizer.json"))
    cfg = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    cfg.pop("added_tokens_decoder", None)
    cfg["chat_template"] = TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                                 tie_word_embeddings=True)).save_pretrained(out)
    return out, tok.token_to_id("</think>")


@pytest.fixture(scope="module")
def client(think_ids):
    model, _ = think_ids
    s = launch(str(model), "--kv-cache-memory", "64MiB", "--max-input-tokens", "256", "--max-total-tokens", "512",
               "--reasoning-parser", "think")
    yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
    s.stop()


def ask(client, think_ids, seed, **more):
    # About one chance in ten per token of closing the block.
    args = {**dict(model="m", messages=ASK, temperature=1.0, seed=seed, max_tokens=40,
                   logit_bias={str(think_ids[1]): 8.5}), **more}
    return args, client.chat.completions.create(**args)


def streamed(client, args):
    reasoning, content, finish = "", "", None
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    return reasoning, content, finish


def test_reasoning_is_split_from_content_streamed_and_not(client, think_ids):
    seen = 0
    for seed in range(8):
        args, r = ask(client, think_ids, seed, extra_body={"ignore_eos": True})
        msg = r.choices[0].message
        reasoning = msg.reasoning_content
        assert isinstance(reasoning, str) and "</think>" not in reasoning
        if not reasoning or not msg.content:
            continue  # closed at once, or not within max_tokens: try another seed
        seen += 1
        assert not msg.content[0].isspace()
        assert streamed(client, args)[:2] == (reasoning, msg.content)
    assert seen >= 2, "no seed closed the think block mid-reply"


def test_an_unclosed_block_is_all_reasoning(client):
    r = client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=6,
                                       extra_body={"ignore_eos": True})
    msg = r.choices[0].message
    assert msg.reasoning_content and msg.content == "" and r.usage.completion_tokens == 6


def test_the_grammar_applies_to_the_answer_only(client, think_ids):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    answered = 0
    for seed in range(8):
        args, r = ask(client, think_ids, seed, response_format=fmt, max_tokens=60)
        msg = r.choices[0].message
        if r.choices[0].finish_reason != "stop":
            continue  # still reasoning at max_tokens
        answered += 1
        jsonschema.validate(json.loads(msg.content), SCHEMA)
        if msg.reasoning_content:
            # Free text before the block closed: not JSON.
            with pytest.raises(ValueError):
                json.loads(msg.reasoning_content)
        reasoning, content, finish = streamed(client, args)
        assert (reasoning, content, finish) == (msg.reasoning_content, msg.content, "stop")
    assert answered >= 2


def closing_seeds(client, think_ids):
    """(args, reply) of the seeds whose reply closes the block mid-reply."""
    for seed in range(8):
        args, r = ask(client, think_ids, seed, extra_body={"ignore_eos": True})
        msg = r.choices[0].message
        if msg.reasoning_content and msg.content:
            yield args, msg


def test_separate_and_include_reasoning(client, think_ids):
    """SGLang's `separate_reasoning: false` leaves the block in the content as written (the prompt
    opened it); vLLM's `include_reasoning: false` drops it. Streamed the same."""
    seen = 0
    for args, msg in closing_seeds(client, think_ids):
        seen += 1
        inline_args = {**args, "extra_body": {"ignore_eos": True, "separate_reasoning": False}}
        inline = client.chat.completions.create(**inline_args).choices[0].message
        assert getattr(inline, "reasoning_content", None) is None
        assert inline.content.startswith(msg.reasoning_content + "</think>") and inline.content.endswith(msg.content)
        assert streamed(client, inline_args)[:2] == ("", inline.content)
        dropped_args = {**args, "extra_body": {"ignore_eos": True, "include_reasoning": False}}
        dropped = client.chat.completions.create(**dropped_args).choices[0].message
        assert getattr(dropped, "reasoning_content", None) is None and dropped.content == msg.content
        assert streamed(client, dropped_args)[:2] == ("", msg.content)
    assert seen >= 2, "no seed closed the think block mid-reply"


def test_stream_reasoning_false_sends_the_reasoning_in_one_delta(client, think_ids):
    """SGLang's `stream_reasoning: false`: the same reasoning, in one delta once the block ends."""
    for args, msg in closing_seeds(client, think_ids):
        held = {**args, "extra_body": {"ignore_eos": True, "stream_reasoning": False}}
        deltas = [c.delta.reasoning_content for chunk in client.chat.completions.create(**held, stream=True)
                  for c in chunk.choices if getattr(c.delta, "reasoning_content", None)]
        assert deltas == [msg.reasoning_content]
        assert streamed(client, held)[1] == msg.content
        return
    pytest.fail("no seed closed the think block mid-reply")
