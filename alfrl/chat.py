"""Token-in/token-out conversations: prompts grow by appending real token ids, never re-tokenizing.

The next prompt of a trajectory is ``previous prompt + sampled completion + feedback ids``, where
the feedback ids come from the tokenizer's own chat template: we render a reference conversation
with placeholder texts once and cut the template's pieces out of it (the text between an assistant
message's content and the next feedback content, and the text after the feedback content up to and
including the next generation prompt). Any Qwen-style template works, ``enable_thinking=False``
included; the history that was sampled is never decoded and encoded again, so the sampler and the
trainer see the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from alfrl import protocol

_ASSISTANT_MARK = "\u27e6ASSISTANT-CONTENT\u27e7"
_FEEDBACK_MARK = "\u27e6FEEDBACK-CONTENT\u27e7"


class TemplateError(ValueError):
    """The tokenizer's chat template cannot be cut into the pieces token-in/token-out needs."""


@dataclass(frozen=True)
class ChatFormat:
    """Everything about the tokenizer that the rollout loop needs, cut from its chat template."""

    action_format: str
    """``tool_call`` or ``action_tag``: decides the system prompt, tools and the feedback role."""
    chat_template_kwargs: dict
    """Extra template variables, e.g. ``{"enable_thinking": False}``."""
    end_of_turn_id: int
    """The token that closes an assistant turn (``<|im_end|>``)."""
    stop_token_ids: tuple[int, ...]
    """Token ids that end a completion."""
    between_text: str
    """Template text after an assistant message's content and before the feedback content."""
    after_text: str
    """Template text after the feedback content, through the next generation prompt."""
    end_of_turn_text: str
    tokenizer: object = field(repr=False, compare=False)

    @property
    def feedback_role(self) -> str:
        return "tool" if self.action_format == "tool_call" else "user"

    @property
    def tools(self) -> list[dict] | None:
        return [protocol.TOOL_SCHEMA] if self.action_format == "tool_call" else None

    # -- building prompts
    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.chat_template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        """``text``'s ids, no special tokens added (special-token text such as ``<|im_end|>`` is its token).

        A fast tokenizer's Rust backend is called directly: the same ids, without transformers' batch-of-one
        path around it (1.27-1.29x faster for Qwen2.5's tokenizer on 2,000 real feedback texts,
        bench/encode_bench.py; the 274-game evaluation encodes ~6,800 of them, at ~1 ms each on the H200's
        host in its profile).
        """
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def first_prompt_ids(self, user_message: str, system_message: str | None = None) -> list[int]:
        """The opening prompt: system prompt (with the tool), first user message, generation prompt."""
        system = system_message if system_message is not None else protocol.system_prompt(self.action_format)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user_message}]
        return self.encode(self.render(messages, add_generation_prompt=True))

    def feedback_ids(self, completion_ids: list[int], feedback: str) -> list[int]:
        """Ids to append after ``completion_ids``: the turn's close, the feedback, the next generation prompt.

        A completion that already ends with the end-of-turn token gets only the rest of the close;
        one cut off by the token limit (or ended by another stop token) gets the whole close.
        """
        between = self.between_text
        if completion_ids and completion_ids[-1] == self.end_of_turn_id:
            between = between[len(self.end_of_turn_text) :]
        return self.encode(between + feedback + self.after_text)

    def completion_text(self, completion_ids: list[int]) -> str:
        """The text of a completion without its final stop token, special tokens kept."""
        ids = list(completion_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def chat_format(tokenizer, action_format: str, enable_thinking: bool | None = None) -> ChatFormat:
    """Cut the template pieces for ``action_format`` out of ``tokenizer``'s chat template."""
    protocol.check_format(action_format)
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError("the tokenizer has no chat template: use an instruct/chat model or a tokenizer folder with one")
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    probe = ChatFormat(action_format, kwargs, -1, (), "", "", "", tokenizer)
    messages = [
        {"role": "system", "content": protocol.system_prompt(action_format)},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": _ASSISTANT_MARK},
        {"role": probe.feedback_role, "content": _FEEDBACK_MARK},
    ]
    text = probe.render(messages, add_generation_prompt=True)
    if text.count(_ASSISTANT_MARK) != 1 or text.count(_FEEDBACK_MARK) != 1:
        raise TemplateError("the chat template does not render assistant and feedback contents verbatim")
    a_end = text.index(_ASSISTANT_MARK) + len(_ASSISTANT_MARK)
    f_start = text.index(_FEEDBACK_MARK)
    between, after = text[a_end:f_start], text[f_start + len(_FEEDBACK_MARK) :]

    between_ids = probe.encode(between)
    if not between_ids:
        raise TemplateError("the chat template puts nothing after an assistant message")
    end_of_turn_id = between_ids[0]
    end_of_turn_text = tokenizer.decode([end_of_turn_id], skip_special_tokens=False)
    if not between.startswith(end_of_turn_text) or end_of_turn_id not in set(tokenizer.all_special_ids) | set(
        tokenizer.added_tokens_decoder
    ):
        raise TemplateError(f"the chat template does not close an assistant turn with a special token (got {end_of_turn_text!r})")
    stops = [end_of_turn_id]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stops:
        stops.append(tokenizer.eos_token_id)
    return ChatFormat(
        action_format=action_format,
        chat_template_kwargs=kwargs,
        end_of_turn_id=end_of_turn_id,
        stop_token_ids=tuple(stops),
        between_text=between,
        after_text=after,
        end_of_turn_text=end_of_turn_text,
        tokenizer=tokenizer,
    )
