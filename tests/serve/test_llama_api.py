"""A Llama-family model served from its Hugging Face directory: the chat API, through the official openai client,
answers with transformers' greedy reply to apply_chat_template's ids, and /v1/completions scores an echoed prompt
with transformers' log-probabilities."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gptkit.weights import load
from helpers import running_app
from hf_tokenizer_dirs import write_byte_level

transformers = pytest.importorskip("transformers")

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another?"},
]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama (grouped-query attention, SwiGLU, RMSNorm, untied head) with a ChatML tokenizer of its own, as
    SmolLM2-Instruct ships, saved as transformers saves it."""
    directory = write_byte_level(tmp_path_factory.mktemp("llama"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.08)  # larger than the default init, so greedy tokens differ step to step
    model.save_pretrained(directory)
    return directory


def transformers_greedy_reply(directory: Path, steps: int) -> tuple[str, list[int]]:
    """transformers' greedy reply to MESSAGES: its text up to the end of turn, and the prompt's ids."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    model = transformers.LlamaForCausalLM.from_pretrained(str(directory)).eval()
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, eos_token_id=None)
    reply = out[0, len(prompt) :].tolist()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    reply = reply[: reply.index(end)] if end in reply else reply
    return tokenizer.decode(reply), prompt


def test_the_openai_client_gets_transformers_greedy_chat_reply(llama_dir: Path) -> None:
    openai = pytest.importorskip("openai")  # here, not at the top: it takes most of a second to import
    loaded = load(str(llama_dir))
    model, tokenizer = loaded.model, loaded.tokenizer
    expected, prompt = transformers_greedy_reply(llama_dir, steps=10)
    with running_app(model, tokenizer) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=10, temperature=0)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(prompt)


def test_an_echoed_prompt_is_scored_with_transformers_log_probabilities(llama_dir: Path) -> None:
    openai = pytest.importorskip("openai")
    loaded = load(str(llama_dir))
    model, tokenizer = loaded.model, loaded.tokenizer
    text = "The colour of the sea is blue, and the sky is grey."
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(llama_dir))
    ids = hf_tokenizer(text)["input_ids"]
    hf = transformers.LlamaForCausalLM.from_pretrained(str(llama_dir)).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)
    expected = [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]
    with running_app(model, tokenizer) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        answer = client.completions.create(model="m", prompt=text, max_tokens=0, echo=True, logprobs=1)
    scored = answer.choices[0].logprobs.token_logprobs
    assert scored[0] is None and len(scored) == len(ids)
    assert scored[1:] == pytest.approx(expected, abs=1e-4)
    assert answer.choices[0].text == text
