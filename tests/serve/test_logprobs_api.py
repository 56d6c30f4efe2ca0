"""What the server tells tools about its tokens, in-process: logprobs and echo (a prompt scored, streamed or not),
chat logprobs, presence and frequency penalties and logit_bias per request, best_of, and vLLM's tokenizer endpoints.

Expected log-probabilities come from full passes of the plain model in float64 (no cache, no engine), and the
penalised tokens from OpenAI's rule written out in tests/infer/test_engine.py's reference_with_rules.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gptkit.data.tokenizer import CharTokenizer, ChatTokenizer, TiktokenTokenizer
from helpers import HTTP, SERVE_TEXT, gpt2_chat_tokenizer, lively_model, plain_copy, running_app
from infer.test_engine import reference_with_rules


@pytest.fixture(scope="module")
def tokenizer() -> CharTokenizer:
    return CharTokenizer.from_text(SERVE_TEXT, eot=True)


@pytest.fixture(scope="module")
def model(tokenizer):
    return lively_model(tokenizer.vocab_size, block_size=32)


@pytest.fixture(scope="module")
def server(model, tokenizer):
    with running_app(model, tokenizer, slots=4) as base:
        yield base


def complete(base: str, **body) -> dict:
    answer = HTTP.post(f"{base}/v1/completions", json={"model": "m", **body}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def float64_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log-softmax (T, V) of the plain model's logits at every position of `tokens`, in float64."""
    with torch.no_grad():
        logits, _ = plain_copy(model)(torch.tensor([tokens]), torch.zeros(1, len(tokens), dtype=torch.long))
    return logits[0].double().log_softmax(-1)


def test_logprobs_of_generated_tokens_are_the_models(server, model, tokenizer):
    prompt = "ROMEO:"
    choice = complete(server, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)["choices"][0]
    logprobs, text = choice["logprobs"], choice["text"]
    made = tokenizer.encode(text)
    assert logprobs["tokens"] == list(text) and len(made) == 8  # one character per token
    expected = float64_logprobs(model, tokenizer.encode(prompt) + made)[len(prompt) - 1 : -1]
    assert logprobs["token_logprobs"] == pytest.approx([float(expected[i, t]) for i, t in enumerate(made)], abs=1e-5)
    assert logprobs["text_offset"] == list(range(8))
    for position, top in enumerate(logprobs["top_logprobs"]):
        best = expected[position].topk(3)
        assert list(top) == [tokenizer.decode([int(t)]) for t in best.indices]
        assert list(top.values()) == pytest.approx(best.values.tolist(), abs=1e-5)
        assert max(top.values()) == logprobs["token_logprobs"][position]  # greedy: the chosen one is the best


def test_echo_with_no_tokens_scores_the_prompt(server, model, tokenizer):
    prompt = "First Citizen: hear me"
    answer = complete(server, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = answer["choices"][0]
    ids = tokenizer.encode(prompt)
    expected = float64_logprobs(model, ids)
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == list(prompt) and logprobs["text_offset"] == list(range(len(prompt)))
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    scores = [float(expected[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert logprobs["token_logprobs"][1:] == pytest.approx(scores, abs=1e-5)
    assert sum(logprobs["token_logprobs"][1:]) == pytest.approx(sum(scores), abs=1e-4)


def test_echo_streams_the_prompt_then_the_tokens_as_one_answer(server):
    body = {"prompt": ["All:", "ROMEO:"], "max_tokens": 6, "echo": True, "logprobs": 2, "seed": 3}
    whole = complete(server, **body)["choices"]
    response = HTTP.post(f"{server}/v1/completions", json={"model": "m", **body, "stream": True}, timeout=60)
    chunks = [json.loads(line[6:]) for line in response.text.split("\n\n") if line.startswith("data: {")]
    for index, choice in enumerate(whole):
        mine = [chunk["choices"][0] for chunk in chunks if chunk["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == choice["text"] and choice["text"].startswith(body["prompt"][index])
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [value for c in mine for value in c["logprobs"][key]] == choice["logprobs"][key]
        assert len(choice["logprobs"]["tokens"]) == len(body["prompt"][index]) + 6


def test_chat_logprobs_come_in_the_chat_format():
    import openai  # here, not at the top: it takes most of a second to import

    tokenizer = ChatTokenizer.extending(CharTokenizer.from_text(SERVE_TEXT, eot=True))
    model = lively_model(tokenizer.vocab_size)
    with running_app(model, tokenizer) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0)
        answer = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Speak"}], temperature=0, max_tokens=6, logprobs=True,
            top_logprobs=2,
        )  # fmt: skip
        body = {"model": "m", "messages": [{"role": "user", "content": "Speak"}], "max_tokens": 6, "logprobs": True}
        streamed = HTTP.post(f"{base}/v1/chat/completions", json={**body, "seed": 2, "stream": True}, timeout=60)
        whole = HTTP.post(f"{base}/v1/chat/completions", json={**body, "seed": 2}, timeout=60).json()
    chunks = [json.loads(line[6:]) for line in streamed.text.split("\n\n") if line.startswith("data: {")]
    pieces = [
        entry
        for chunk in chunks
        if chunk["choices"][0]["logprobs"]
        for entry in chunk["choices"][0]["logprobs"]["content"]
    ]
    assert pieces == whole["choices"][0]["logprobs"]["content"] and all(p["top_logprobs"] == [] for p in pieces)
    choice = answer.choices[0]
    content = choice.logprobs.content
    assert 1 <= len(content) == answer.usage.completion_tokens
    shown = "".join(entry.token for entry in content)
    assert shown == choice.message.content + ("<|end|>" if choice.finish_reason == "stop" else "")
    for entry in content:
        assert bytes(entry.bytes).decode() == entry.token and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy
        assert sum(math.exp(top.logprob) for top in entry.top_logprobs) <= 1 + 1e-6


@pytest.mark.gpt2_bpe
def test_a_token_that_is_part_of_a_character_is_written_as_bytes():
    tokenizer = TiktokenTokenizer("gpt2")
    model = lively_model(tokenizer.vocab_size, block_size=32)
    split = tokenizer.encode("🙂")  # four bytes in more than one token
    assert len(split) > 1
    with running_app(model, tokenizer) as base:
        echo = complete(base, prompt=split, max_tokens=0, echo=True, logprobs=0)["choices"][0]["logprobs"]["tokens"]
    pieces = [tokenizer.decode_bytes([token]) for token in split]
    assert echo == ["bytes:" + "".join(f"\\x{byte:02x}" for byte in piece) for piece in pieces]


def test_penalties_and_bias_follow_openais_rule_even_in_a_busy_batch(server, model, tokenizer):
    prompt = "All:"
    # the end of text banned too: the reference does not stop
    bias = {tokenizer.encode("e")[0]: -100.0, tokenizer.encode("k")[0]: 1.5, tokenizer.eot_token: -100.0}
    rules = {"presence_penalty": 0.5, "frequency_penalty": 1.2, "logit_bias": {str(k): v for k, v in bias.items()}}
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, **rules}
    expected, _, _ = reference_with_rules(plain_copy(model), tokenizer.encode(prompt), 12, 0.5, 1.2, bias)
    others = [{"prompt": "ROMEO:", "max_tokens": 30, "seed": seed} for seed in range(4)]
    with ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(lambda b: complete(server, **b), [*others, body]))
    assert (
        tokenizer.encode(answers[-1]["choices"][0]["text"]) == expected and "e" not in answers[-1]["choices"][0]["text"]
    )
    plain = complete(server, prompt=prompt, max_tokens=12, temperature=0)["choices"][0]["text"]
    assert plain != answers[-1]["choices"][0]["text"]


def test_best_of_answers_the_candidates_with_the_highest_mean_logprob(server):
    body = {"prompt": "All:", "max_tokens": 10, "temperature": 1.0, "seed": 11}
    candidates = complete(server, **body, n=5, logprobs=0)["choices"]  # best_of draws the same five: seeds 11..15
    means = [sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"]) for c in candidates]
    ranked = sorted(range(5), key=lambda i: -means[i])
    best = complete(server, **body, n=2, best_of=5)
    assert [c["text"] for c in best["choices"]] == [candidates[i]["text"] for i in ranked[:2]]
    assert [c["index"] for c in best["choices"]] == [0, 1] and best["choices"][0]["logprobs"] is None
    assert best["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in candidates)


@pytest.mark.gpt2_bpe
def test_tokenizer_endpoints_speak_vllms_format():
    wrong_model = [("tokenize", {"prompt": "Hi"}), ("detokenize", {"tokens": [1]})]
    tokenizer = gpt2_chat_tokenizer()
    model = lively_model(tokenizer.vocab_size)
    with running_app(model, tokenizer) as base:
        info = HTTP.get(f"{base}/tokenizer_info").json()
        text = "Hello world<|endoftext|>again"
        tokens = HTTP.post(f"{base}/tokenize", json={"prompt": text}).json()
        back = HTTP.post(f"{base}/detokenize", json={"tokens": tokens["tokens"]}).json()
        messages = [{"role": "user", "content": "Hi"}]
        chat = HTTP.post(f"{base}/tokenize", json={"messages": messages}).json()
        bad = HTTP.post(f"{base}/detokenize", json={"tokens": [tokenizer.vocab_size]})
        neither = HTTP.post(f"{base}/tokenize", json={})
        no_messages = HTTP.post(f"{base}/tokenize", json={"messages": []})
        not_text = HTTP.post(f"{base}/tokenize", json={"prompt": 5})
        other_model = [HTTP.post(f"{base}/{path}", json={"model": "other", **body}) for path, body in wrong_model]
    assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == 16
    assert "<|assistant|>" in info["chat_template"]
    hello, again = tokenizer.encode("Hello world"), tokenizer.encode("again")
    assert tokens == {"count": len(hello) + 1 + len(again), "max_model_len": 16, "tokens": [*hello, 50256, *again]}
    assert back == {"prompt": text}
    assert chat["tokens"] == tokenizer.chat.render_prompt(messages, tokenizer)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert neither.status_code == 400 and neither.json()["error"]["param"] == "prompt"
    assert no_messages.status_code == 400 and no_messages.json()["error"]["param"] == "messages"
    assert not_text.status_code == 400 and "token ids" not in not_text.json()["error"]["message"]
    assert [(r.status_code, r.json()["error"]["code"]) for r in other_model] == [(404, "model_not_found")] * 2


def test_an_echoed_prompt_is_scored_whole_up_to_one_token_past_the_context(server, model, tokenizer):
    """A 33-token prompt for a 32-token context: every token after the first scored in one pass (the last is only
    scored); one token more cannot be scored whole and is refused, whatever --long_prompts says."""
    prompt = ("Speak, speak. " * 3)[:33]
    scored = complete(server, prompt=prompt, max_tokens=0, echo=True, logprobs=0)["choices"][0]["logprobs"]
    ids = tokenizer.encode(prompt)
    expected = float64_logprobs(model, ids[:-1])
    assert scored["token_logprobs"][1:] == pytest.approx(
        [float(expected[i - 1, ids[i]]) for i in range(1, 33)], abs=1e-5
    )
    refused = HTTP.post(
        f"{server}/v1/completions", json={"model": "m", "prompt": prompt + " ", "max_tokens": 0, "echo": True}
    )
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert "max_length=34" in refused.json()["error"]["message"]


@pytest.mark.gpt2_bpe
def test_text_offsets_count_characters_of_the_text_when_tokens_split_them():
    """GPT-2 spells 🙂 in two tokens of two bytes each, and has a token of the lone byte 0xa9 (no UTF-8 alone): each
    token starts at the character holding its first byte, in the text as decoded ("a🙂b", "x\ufffdy"), also when a
    character's tokens come in two streamed chunks."""
    from gptkit.infer.engine import TokenLogprob
    from gptkit.serve.openai_api import TextOffsets, completion_logprobs

    gpt2 = TiktokenTokenizer("gpt2")
    split = gpt2.encode("a🙂b")
    assert [len(gpt2.decode_bytes([t])) for t in split] == [1, 2, 2, 1]
    logprobs = completion_logprobs([TokenLogprob(token=t, logprob=-1.0) for t in split], gpt2, TextOffsets())
    assert logprobs["text_offset"] == [0, 1, 1, 2]
    assert logprobs["tokens"][1] == "bytes:\\xf0\\x9f"
    streamed = TextOffsets()
    chunks = [
        completion_logprobs([TokenLogprob(token=t, logprob=-1.0) for t in part], gpt2, streamed)
        for part in (split[:2], split[2:])
    ]
    assert [chunk["text_offset"] for chunk in chunks] == [[0, 1], [1, 2]]
    lone = next(t for t in range(50257) if gpt2.decode_bytes([t]) == b"\xa9")
    tokens = [gpt2.encode("x")[0], lone, gpt2.encode("y")[0]]
    assert gpt2.decode_bytes(tokens).decode("utf-8", "replace") == "x\ufffdy"
    made = completion_logprobs([TokenLogprob(token=t, logprob=-1.0) for t in tokens], gpt2, TextOffsets())
    assert made["text_offset"] == [0, 1, 2]


def test_an_echo_shows_the_prompt_as_sent_though_a_llama_tokenizer_opens_it_with_bos(tmp_path):
    """The server puts Llama 3's <|begin_of_text|> before a text prompt (as transformers and llama.cpp do); an echo
    shows and scores the client's prompt alone, its first token given the bos, as a float64 pass computes it."""
    import hf_tokenizer_dirs
    from gptkit.data.hf_tokenizer import load_hf_tokenizer
    from gptkit.data.tokenizer import prompt_opening

    llama3 = load_hf_tokenizer(hf_tokenizer_dirs.write_family(tmp_path / "llama3", "llama3"))
    (bos,) = prompt_opening(llama3)
    model = lively_model(llama3.vocab_size, block_size=32)
    prompt = "hello world"
    with running_app(model, llama3, slots=2) as base:
        choice = complete(base, prompt=prompt, max_tokens=0, echo=True, logprobs=0)["choices"][0]
    ids = llama3.encode(prompt)
    assert choice["text"] == prompt
    assert choice["logprobs"]["tokens"] == [llama3.decode([t]) for t in ids]
    expected = float64_logprobs(model, [bos, *ids])
    want = [float(expected[i, t]) for i, t in enumerate(ids)]  # row i predicts token i + 1 of [bos, *ids]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-5)
    assert choice["logprobs"]["text_offset"][0] == 0


def test_more_alternatives_than_the_vocabulary_is_a_400():
    """A 5-token vocabulary: 20 alternatives asked (echoed or made) is the client's mistake, said before any work;
    the echoed case never answered at all."""
    small = CharTokenizer.from_text("abc\n", eot=True)
    with running_app(lively_model(small.vocab_size, block_size=16), small, slots=2) as base:
        asked = [
            ("completions", {"prompt": "ab", "max_tokens": 0, "echo": True, "logprobs": 20}, "logprobs"),
            ("completions", {"prompt": "ab", "max_tokens": 2, "logprobs": 20}, "logprobs"),
        ]
        for path, body, param in asked:
            answer = HTTP.post(f"{base}/v1/{path}", json={"model": "m", **body}, timeout=30)
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert (error["param"], error["message"]) == (param, f"{param} is 20; the vocabulary has 5 tokens")
        assert complete(base, prompt="ab", max_tokens=1, logprobs=5)["choices"][0]["logprobs"] is not None
