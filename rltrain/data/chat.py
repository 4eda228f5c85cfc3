"""Turn a dataset prompt (a string or a list of chat messages) into the text the policy sees.

Must not tokenize or truncate: PromptDataset does that, so the length filter sees the real length.
"""

from __future__ import annotations

from rltrain.utils.errors import UserError


class ChatTemplateError(UserError, ValueError):
    """The tokenizer has no chat template, or its template cannot render a prompt (an unknown role...)."""


def to_messages(prompt: str | list[dict], system_prompt: str | None = None) -> list[dict]:
    """A string becomes one user message; a message list is used as is. `system_prompt` is prepended
    unless the messages already start with a system message."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt is not None and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_prompt(tokenizer, prompt: str | list[dict], *, apply_chat_template: bool, system_prompt: str | None = None) -> str:
    """The prompt text: the tokenizer's chat template with a generation prompt when
    `apply_chat_template` (config `data.apply_chat_template`), else the message contents joined by
    newlines (raw completion-style prompting)."""
    messages = to_messages(prompt, system_prompt)
    if apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                f"the tokenizer ({type(tokenizer).__name__}, model.tokenizer / model.path) has no chat template; "
                "set data.apply_chat_template=false or use a tokenizer that has one"
            )
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as err:  # the template refuses the messages (a role it lacks, roles out of order...)
            roles = [m.get("role") for m in messages if isinstance(m, dict)]
            raise ChatTemplateError(
                f"the chat template of the tokenizer ({type(tokenizer).__name__}) cannot render a prompt with roles "
                f"{roles}: {str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__}; "
                "change the prompt's messages, use a tokenizer whose template takes them, or set "
                "data.apply_chat_template=false") from None
    return "\n".join(m["content"] for m in messages)


def prompt_token_ids(tokenizer, text: str, *, apply_chat_template: bool) -> list[int]:
    """Ids of a rendered prompt. A chat template already holds its special tokens; a raw prompt gets
    the tokenizer's own (e.g. <bos> for CharTokenizer)."""
    return list(tokenizer.encode(text, add_special_tokens=not apply_chat_template))
