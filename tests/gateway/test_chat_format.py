"""Chat rendering equals Hugging Face's apply_chat_template; tool-call parsing is lenient and lossless."""

from __future__ import annotations

import json
from importlib import resources

import pytest
from gw_helpers import ADD_TOOL

from agl.chat.format import lower_messages, parse_tool_calls, render_chat, render_tool_call
from agl.chat.tokenizer import load_default_tokenizer

TOK = load_default_tokenizer()


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hello"}],
        [
            {"role": "system", "content": "Be short."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hey"},
            {"role": "user", "content": "Bye ünïcödé 🚀"},
        ],
    ],
)
def test_rendering_matches_transformers_apply_chat_template(messages: list[dict[str, str]]) -> None:
    transformers = pytest.importorskip("transformers")
    assets = resources.files("agl.chat").joinpath("assets")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(assets.joinpath("tokenizer.json")),
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        chat_template=assets.joinpath("chat_template.jinja").read_text(),
    )
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert TOK.encode_chat(messages)[1] == list(expected)
    assert TOK.render(messages) == hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def test_shipped_tokenizer_is_smollm2() -> None:
    assert TOK.name == "SmolLM2-135M-Instruct"
    assert TOK.eos_token_id == 2 and TOK.token_to_id("<|im_start|>") == 1
    assert TOK.max_context == 8192
    assert TOK.render([{"role": "user", "content": "x"}]).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
    )


def test_lowering_tools_calls_and_results() -> None:
    msgs = lower_messages(
        [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "2?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a":1,"b":2}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "3"},
        ],
        [ADD_TOOL],
    )
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert msgs[0]["content"].startswith("Use tools.\n\nYou are a function calling AI model.")
    assert json.dumps(ADD_TOOL["function"]) in msgs[0]["content"]
    assert msgs[1]["content"] == "1+2?"
    assert msgs[2]["content"] == render_tool_call("add", {"a": 1, "b": 2})
    assert msgs[3]["content"] == "<tool_response>\n3\n</tool_response>"


def test_native_tool_templates_get_openai_messages() -> None:
    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments.a }}{% endif %};{% endfor %}"
    out = render_chat(
        template,
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 5}'}}
                ],
            },
        ],
        [ADD_TOOL],
    )
    assert out == "[add]user:q;assistant:5;"


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("plain answer", "plain answer", []),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', None, [("add", {"a": 1})]),
        (
            'Sure.\n<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call>',
            "Sure.",
            [("add", {"a": 2})],
        ),
        (
            '<tool_call>[{"name": "f", "arguments": {}}, {"name": "g", "parameters": {"x": 1}}]</tool_call>',
            None,
            [("f", {}), ("g", {"x": 1})],
        ),
        (
            '<tool_call>\n```json\n{"name": "add", "arguments": {"a": 3}}\n```\n</tool_call>',
            None,
            [("add", {"a": 3})],
        ),
        ('<tool_call>{"name": "add", "arguments": {"a": 4}}', None, [("add", {"a": 4})]),  # stopped at EOS
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ],
)
def test_parse_tool_calls_is_lenient(
    text: str, content: str | None, calls: list[tuple[str, dict[str, int]]]
) -> None:
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") for c in got_calls)


def test_canonical_tool_call_round_trips() -> None:
    text = render_tool_call("search", {"q": "café", "k": 3})
    content, calls = parse_tool_calls(text)
    assert content is None
    assert render_tool_call(calls[0].name, calls[0].arguments) == text
