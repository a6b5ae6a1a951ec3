"""The Qwen3.5/3.6 XML tool calls that tests/core/data/qwen3_xml_vllm.json records, parsed again
by vLLM's own ``qwen3_xml`` parser (``vllm.parser.qwen3.Qwen3Parser``, thinking off): the
recorded content and calls are what vLLM answers today, so grpo-core's parser, checked against
the file in the main test run, reads these turns as vLLM does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

RECORD = Path(__file__).resolve().parents[1] / "core" / "data" / "qwen3_xml_vllm.json"


def vllm_parse(texts: list[str], tools: list[dict]) -> list[dict]:
    """vLLM's parse of each text: ``{"text", "content", "calls": [[name, arguments]]}``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.qwen3 import Qwen3Parser

    specials = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                        additional_special_tokens=specials)
    out = []
    for text in texts:
        request = ChatCompletionRequest(model="policy", messages=[{"role": "user", "content": "x"}], tools=tools)
        parser = Qwen3Parser(tokenizer, request.tools, chat_template_kwargs={"enable_thinking": False})
        info = parser.extract_tool_calls(text, request)
        out.append({"text": text, "content": info.content,
                    "calls": [[c.function.name, json.loads(c.function.arguments)] for c in info.tool_calls]})
    return out


def test_the_recorded_qwen3_xml_parses_are_vllms():
    record = json.loads(RECORD.read_text(encoding="utf-8"))
    assert vllm_parse([c["text"] for c in record["cases"]], record["tools"]) == record["cases"]


if __name__ == "__main__":  # python tests/vllm/test_qwen3_xml_reference.py: record the file again
    record = json.loads(RECORD.read_text(encoding="utf-8"))
    record["cases"] = vllm_parse([c["text"] for c in record["cases"]], record["tools"])
    RECORD.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
