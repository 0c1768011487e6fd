"""A tiny Qwen3-architecture causal LM for tests and the tiny recipe, built without any download.

``write_tiny_model(dir, seed)`` writes a normal Hugging Face folder: a byte-level BPE tokenizer the
project trains itself (over ALFWorld's words, ``assets/alfworld_corpus.txt``, and the protocol's own
text), a Qwen-style chat template with tools, and a 2-layer Qwen3 model (a few MB). ``AutoTokenizer``,
``AutoModelForCausalLM`` and vLLM load it. The same seed writes the same files.

The weights start random and get a few seconds of next-token training on synthetic turns (a prompt
listing actions, answered by one well-formed call in either action format, often ``look`` or
``inventory``), so that the tiny model writes valid calls some of the time and admissible actions
now and then. Its rollouts then have rewards that differ inside a group, which is what makes the
tiny recipe's updates (and the tests built on them) non-trivial. ``pretrain_steps=0`` keeps it random.
"""

from __future__ import annotations

import json
from pathlib import Path

from alfrl import protocol

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# A Qwen3-style template with tools, append-only: every rendering of a conversation is a prefix of
# the rendering of any longer one, so token-in/token-out prompts equal the template's own rendering.
CHAT_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""


def _training_text() -> list[str]:
    corpus = (Path(__file__).parent / "assets" / "alfworld_corpus.txt").read_text().splitlines()
    protocol_text = [
        protocol.system_prompt("tool_call"),
        protocol.system_prompt("action_tag"),
        json.dumps(protocol.TOOL_SCHEMA),
        protocol.format_action("go to countertop 1", "tool_call", "I should look on the countertop first. "),
        protocol.format_action("take apple 1 from countertop 1", "action_tag", "The apple is here."),
        "Your task is to: put a clean apple in fridge.",
        "Step 1 of 50.\nObservation: You are in the middle of a room.\nAvailable actions:\nlook\ninventory",
        "Status: action executed. Status: task completed. Status: episode ended. Status: action not admissible.",
        "Status: invalid tool-call format. Status: invalid action format. Nothing happens.",
        "<tool_call>\n<function=alfworld_step>\n<parameter=action>\nlook\n</parameter>\n</function>\n</tool_call>",
        "Prior to this step you took actions. [Observation 1: 'You arrive at desk 1.', Action 1: 'look']",
    ]
    return corpus + protocol_text


def build_tokenizer(vocab_size: int = 2048):
    """A byte-level BPE tokenizer with Qwen's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[],
        clean_up_tokenization_spaces=False,
    )
    fast.add_tokens(ADDED_TOKENS, special_tokens=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 32768
    return fast


def _synthetic_turns(tokenizer, rng, count: int) -> list[tuple[list[int], int]]:
    """(token ids, index where the completion starts) of ``count`` synthetic first turns."""
    corpus = (Path(__file__).parent / "assets" / "alfworld_corpus.txt").read_text().splitlines()
    actions = [line for line in corpus if line[:1].isalpha() and " " in line and line.split()[0] in ("go", "take", "move", "open", "use", "heat", "cool", "clean", "close", "examine")]
    examples = []
    for _ in range(count):
        action_format = rng.choice(protocol.ACTION_FORMATS)
        shown = sorted(set(rng.sample(actions, 6))) + ["inventory", "look"]
        target = rng.choice(["look", "inventory", rng.choice(shown)])
        user = "Your task is to: put a clean mug in coffeemachine.\n\nStep 1 of 50.\nObservation: You are in the middle of a room.\nAvailable actions:\n" + "\n".join(shown)
        messages = [{"role": "system", "content": protocol.system_prompt(action_format)}, {"role": "user", "content": user}]
        tools = [protocol.TOOL_SCHEMA] if action_format == "tool_call" else None
        prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        answer = protocol.format_action(target, action_format, "" if action_format == "tool_call" else "I act.")
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        answer_ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        examples.append((prompt_ids + answer_ids, len(prompt_ids)))
    return examples


def _pretrain(model, tokenizer, seed: int, steps: int, batch_size: int = 8) -> None:
    """A few next-token steps on the completions of synthetic turns (single-threaded: bit-reproducible)."""
    import random

    import torch

    rng = random.Random(seed)
    examples = _synthetic_turns(tokenizer, rng, steps * batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.train()
        for step in range(steps):
            batch = examples[step * batch_size : (step + 1) * batch_size]
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
            labels = torch.full((len(batch), width), -100)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for b, (ids, start) in enumerate(batch):
                input_ids[b, : len(ids)] = torch.tensor(ids)
                labels[b, start : len(ids)] = torch.tensor(ids[start:])
                attention[b, : len(ids)] = 1
            loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
    finally:
        torch.set_num_threads(threads)


def write_tiny_model(out_dir: str | Path, seed: int = 0, hidden_size: int = 128, num_layers: int = 2, pretrain_steps: int = 150) -> Path:
    """Write the tiny model folder (tokenizer, chat template, Qwen3 weights) and return its path."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if pretrain_steps:
            _pretrain(model, tokenizer, seed, pretrain_steps)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config.do_sample = True
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
