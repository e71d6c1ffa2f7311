"""Prompts into token ids: a completion's text or token ids, a conversation through the chat
template, and the fallback template for a model that has none.

A model without a chat template (a base model) still answers chat requests: its tokenizer gets
:data:`FALLBACK_TEMPLATE`, the transcript mlx-lm's server writes for such models (``USER: ...``
lines, then ``ASSISTANT:``), and the server says so when it starts.
"""

from __future__ import annotations

from typing import Any

from mlxbun.serve.checks import BadRequest, shown

# mlx_lm.server's convert_chat as a template: one "ROLE: content" line per message, then the
# assistant's turn (without the trailing space it strips)
FALLBACK_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{ \"ASSISTANT's RULE: \" }}"
    "{%- elif m['role'] == 'user' -%}{{ 'USER: ' }}"
    "{%- elif m['role'] == 'assistant' -%}{{ 'ASSISTANT: ' }}{%- endif -%}"
    "{{ m['content'] }}{{ '\\n' if not loop.last or add_generation_prompt else '' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}"
)


def ensure_template(tokenizer: Any) -> bool:
    """Give a tokenizer without a chat template :data:`FALLBACK_TEMPLATE`; True when it had none."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = FALLBACK_TEMPLATE
    return True


def text_of(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (OpenAI's ``{"type": "text",
    "text": ...}``, Anthropic's text blocks), joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(
            f"{where} must be a string or a list of text parts, not {shown(content)}", param=where
        )
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(f"{where}[{i}]: only text parts are served, not {kind!r}", param=where)
        texts.append(part["text"])
    return "".join(texts)


def completion_tokens(tokenizer: Any, prompt: Any, vocab: int) -> list[int]:
    """A completion's prompt: a string, or a list of token ids below ``vocab``."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        tokens = list(tokenizer.encode(prompt))
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise BadRequest(
                f"prompt: token id {bad[0]} is not below the vocabulary's {vocab}", param="prompt"
            )
        tokens = list(prompt)
    else:
        raise BadRequest(
            f"prompt must be a string or a list of token ids (one prompt a request), not {shown(prompt)}",
            param="prompt",
        )
    if not tokens:
        raise BadRequest("prompt is empty: there is no token to start from", param="prompt")
    return tokens


def chat_tokens(tokenizer: Any, messages: list[dict[str, str]], *, continue_final: bool = False) -> list[int]:
    """The conversation through the chat template, open for the assistant's turn (or, with
    ``continue_final``, continuing the last assistant message as Anthropic's API does)."""
    try:
        if continue_final:
            tokens = tokenizer.apply_chat_template(
                messages, add_generation_prompt=False, continue_final_message=True, tokenize=True
            )
        else:
            tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:
        raise BadRequest(
            f"messages cannot be formatted by the chat template: {e}", param="messages"
        ) from None
    if not tokens:
        raise BadRequest("messages give an empty prompt", param="messages")
    return list(tokens)
