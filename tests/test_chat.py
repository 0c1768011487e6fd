"""Token-in/token-out: each prompt extends the previous one exactly, with the template's own pieces."""

import copy
from types import SimpleNamespace

import pytest

from alfrl import protocol
from alfrl.chat import ChatFormat, TemplateError, chat_format
from alfrl.envs import EnvState

STATE = EnvState("You are in the middle of a room.", ("go to desk 1", "help", "look"), False, False)


def _conversation(fmt, turns):
    """Chain ``turns`` = [(completion text, cut?, feedback text)] and return (prompts, messages)."""
    user = protocol.first_user_message("put a mug in desk.", STATE, 50)
    messages = [{"role": "system", "content": protocol.system_prompt(fmt.action_format)}, {"role": "user", "content": user}]
    prompt = fmt.first_prompt_ids(user)
    prompts = [prompt]
    for text, cut, feedback in turns:
        completion = fmt.encode(text) + ([] if cut else [fmt.end_of_turn_id])
        prompt = prompt + completion + fmt.feedback_ids(completion, feedback)
        prompts.append(prompt)
        messages.append({"role": "assistant", "content": text})
        messages.append({"role": fmt.feedback_role, "content": feedback})
    return prompts, messages


TURNS = [
    (protocol.format_action("go to desk 1", "tool_call", "The desk first. "), False, "Status: action executed.\nStep 2 of 50.\nObservation: You arrive at desk 1."),
    ("<tool_call>\n{\"name\": \"alfworld_step\", \"argu", True, "Status: invalid tool-call format (cut off by the token limit).\nStep 3 of 50."),
    (protocol.format_action("look", "tool_call"), False, "Status: action executed.\nStep 4 of 50.\nObservation: You see a desk."),
]


@pytest.mark.parametrize("action_format", ["tool_call", "action_tag"])
@pytest.mark.parametrize("thinking", [None, False])
def test_each_prompt_extends_the_previous_and_equals_the_template_rendering(tiny_tokenizer, action_format, thinking):
    fmt = chat_format(tiny_tokenizer, action_format, enable_thinking=thinking)
    prompts, messages = _conversation(fmt, TURNS)
    for before, after in zip(prompts, prompts[1:]):
        assert after[: len(before)] == before
    # the tiny template is append-only, so the chained ids equal the rendering of the whole conversation
    # (with enable_thinking=False each turn began with the empty think block the generation prompt added)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    if thinking is False:
        messages = [dict(m, content="<think>\n\n</think>\n\n" + m["content"]) if m["role"] == "assistant" else m for m in messages]
    tools = [protocol.TOOL_SCHEMA] if action_format == "tool_call" else None
    for n, prompt in enumerate(prompts):
        rendered = tiny_tokenizer.apply_chat_template(messages[: 2 + 2 * n], tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
        assert prompt == tiny_tokenizer.encode(rendered, add_special_tokens=False), f"turn {n}"


def test_template_pieces_of_the_tiny_tokenizer(tiny_tokenizer):
    fmt = chat_format(tiny_tokenizer, "tool_call")
    assert fmt.end_of_turn_text == "<|im_end|>"
    assert fmt.between_text == "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
    assert fmt.after_text == "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert fmt.stop_token_ids == (tiny_tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    user = chat_format(tiny_tokenizer, "action_tag", enable_thinking=False)
    assert user.between_text == "<|im_end|>\n<|im_start|>user\n"
    assert user.after_text == "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_completion_text_drops_only_the_final_stop_token(tiny_tokenizer):
    fmt = chat_format(tiny_tokenizer, "tool_call")
    ids = fmt.encode("<tool_call>x</tool_call>")
    assert fmt.completion_text(ids + [fmt.end_of_turn_id]) == "<tool_call>x</tool_call>"
    assert fmt.completion_text(ids) == "<tool_call>x</tool_call>"


# Qwen3's own template renders earlier assistant turns differently from the last one (it strips their
# reasoning), so it is not append-only; the pieces must still come out right.
QWEN3_LIKE = r"""{%- for message in messages %}
{%- if message.role == 'assistant' %}
{%- set content = message.content %}
{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}
{%- if loop.last %}{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + content + '<|im_end|>\n' }}
{%- else %}{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}{%- endif %}
{%- elif message.role == 'tool' %}{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""


def test_a_template_that_is_not_append_only_still_chains_exactly(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = QWEN3_LIKE
    fmt = chat_format(tok, "tool_call")
    assert fmt.between_text == "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
    prompts, _ = _conversation(fmt, [("<think>hmm</think>" + TURNS[0][0], False, "ok")] + TURNS[1:])
    for before, after in zip(prompts, prompts[1:]):
        assert after[: len(before)] == before
    # the sampled reasoning stays in the history: it is what the model produced
    assert "<think>hmm</think>" in tok.decode(prompts[-1])


def test_a_tokenizer_without_a_template_is_refused(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        chat_format(tok, "tool_call")


def test_encode_calls_the_fast_backend_and_gives_transformers_ids(tiny_tokenizer):
    """The Rust backend directly (no batch-of-one path) must give exactly what transformers' encode gives."""
    fmt = chat_format(tiny_tokenizer, "tool_call")
    texts = [fmt.between_text + "You arrive at countertop 1. On it, you see a mug 1." + fmt.after_text, "  spaces\n\n tabs\t",
             "<|im_end|>\n<|im_start|>user\nhello<|im_end|>", "", "unicode: caf\u00e9 \u27e6x\u27e7"]
    calls = []
    backend = tiny_tokenizer.backend_tokenizer

    class Spy:
        def encode(self, text, add_special_tokens):
            calls.append(text)
            return backend.encode(text, add_special_tokens=add_special_tokens)

    spied = ChatFormat(fmt.action_format, fmt.chat_template_kwargs, fmt.end_of_turn_id, fmt.stop_token_ids, fmt.between_text,
                       fmt.after_text, fmt.end_of_turn_text, SimpleNamespace(backend_tokenizer=Spy()))
    for text in texts:
        assert spied.encode(text) == list(tiny_tokenizer.encode(text, add_special_tokens=False))
    assert calls == texts
