"""Multi-turn chat SFT data: rows of messages -> input_ids + a loss mask that is 1 on assistant tokens only.

Must not know models or losses: it tokenizes, masks and pads; rltrain/trainer/sft.py trains on the result.

A row is {"messages": [...]} (key configurable) with roles system / user / assistant / tool. The
layout is exactly what the multi-turn rollout (rltrain/rollout/multiturn.py) produces, so the SFT'd
model sees in RL what it saw in SFT:

  prompt   = chat template of the messages before the first assistant message, with the generation
             prompt (rltrain.data.chat.render_prompt, like the RL prompt datasets)   -> loss 0
  response = the following messages concatenated as token ids:
             assistant content                                                        -> loss 1
             tool content rendered with `tool_output_template` ("\\n<output>\\n{output}\\n</output>\\n",
             DEFAULT_TOOL_OUTPUT_TEMPLATE, which the rollout appends too)           -> loss 0
             then the tokenizer's EOS (the rollout stops on it)                       -> loss 1

An assistant message that calls the tool holds the call's text itself, e.g. "<code>print(2+3)</code>"
(the `code_tag` pattern) or a ```python fence (`code_block`). User messages after the first assistant
message are not supported (the RL rollout has none): such a row is an error naming the file and line.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import torch

from rltrain.data.chat import ChatTemplateError, render_prompt
from rltrain.data.dataset import DataError, read_rows

logger = logging.getLogger(__name__)

MESSAGE_ROLES = ("system", "user", "assistant", "tool")
DEFAULT_TOOL_OUTPUT_TEMPLATE = "\n<output>\n{output}\n</output>\n"


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_conversation(tokenizer, messages: list[dict], *, system_prompt: str | None = None,
                        tool_output_template: str = DEFAULT_TOOL_OUTPUT_TEMPLATE,
                        where: str = "messages") -> tuple[list[int], list[int], int]:
    """(input_ids [S], loss_mask [S], prompt_length) of one conversation (see the module docstring).

    loss_mask[t] = 1 when input_ids[t] is an assistant token or the final EOS, so the SFT loss is
    -log p(input_ids[t] | input_ids[<t]) summed over those t.
    """
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: must be a non-empty list of messages")
    for j, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in MESSAGE_ROLES and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: message {j} must be an object with 'role' in {MESSAGE_ROLES} and a string "
                             f"'content', got {m!r}"[:300])
    first = next((j for j, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        raise DataError(f"{where}: has no assistant message (nothing to train on)")
    prompt = messages[:first]
    if not any(m["role"] == "user" for m in prompt):
        raise DataError(f"{where}: needs a user message before the first assistant message")
    if any(m["role"] == "tool" for m in prompt):
        raise DataError(f"{where}: a tool message comes before the first assistant message")
    response = messages[first:]
    bad = [m["role"] for m in response if m["role"] not in ("assistant", "tool")]
    if bad:
        raise DataError(f"{where}: after the first assistant message only assistant/tool messages are "
                         f"supported (the rollout has no later user turns), got {bad[0]!r}")
    if response[-1]["role"] != "assistant":
        raise DataError(f"{where}: the last message must be the assistant's answer, got {response[-1]['role']!r}")
    if "{output}" not in tool_output_template:
        raise ValueError(f"tool_output_template must contain '{{output}}', got {tool_output_template!r}")
    prompt_msgs = [{"role": m["role"], "content": m["content"]} for m in prompt]
    try:
        text = render_prompt(tokenizer, prompt_msgs, apply_chat_template=True, system_prompt=system_prompt)
    except ChatTemplateError as e:
        raise DataError(f"{where}: {e}") from None
    ids = _encode(tokenizer, text)
    mask = [0] * len(ids)
    prompt_length = len(ids)
    for m in response:
        if m["role"] == "assistant":
            seg = _encode(tokenizer, m["content"])
            mask += [1] * len(seg)
        else:
            seg = _encode(tokenizer, tool_output_template.replace("{output}", m["content"]))
            mask += [0] * len(seg)
        ids += seg
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError(f"the tokenizer ({type(tokenizer).__name__}, model.tokenizer) has no eos_token_id; the SFT "
                        "response must end with EOS: use a tokenizer that has one")
    ids.append(int(eos))
    mask.append(1)
    return ids, mask, prompt_length


class SFTDataset(torch.utils.data.Dataset):
    """Rows of one or more files (or in-memory message lists), tokenized up front.

    Items: {"input_ids": list[int], "loss_mask": list[int], "prompt_length": int}. Rows longer than
    `max_length` tokens are dropped and counted (`num_dropped`), like PromptDataset's long prompts.
    """

    def __init__(self, sources: Sequence[str | os.PathLike] | Sequence[list[dict]], *, tokenizer, max_length: int,
                 messages_key: str = "messages", system_prompt: str | None = None,
                 tool_output_template: str = DEFAULT_TOOL_OUTPUT_TEMPLATE) -> None:
        if max_length < 2:
            raise ValueError(f"max_length (data.max_length) must be >= 2, got {max_length}")
        self.items: list[dict] = []
        self.num_dropped = 0
        for src in sources:
            if isinstance(src, list):  # in-memory conversations
                rows = [(i + 1, {messages_key: m}) for i, m in enumerate(src)]
                name = "<messages>"
            else:
                rows, name = read_rows(src), str(src)
            for lineno, row in rows:
                where = f"{name}:{lineno}"
                if messages_key not in row:
                    raise DataError(f"{where}: missing key {messages_key!r} (data.messages_key); row keys: {sorted(row)}")
                ids, mask, plen = encode_conversation(tokenizer, row[messages_key], system_prompt=system_prompt,
                                                      tool_output_template=tool_output_template, where=where)
                if len(ids) > max_length:
                    self.num_dropped += 1
                    continue
                self.items.append({"input_ids": ids, "loss_mask": mask, "prompt_length": plen})
        if self.num_dropped:
            logger.warning("SFT data: dropped %d of %d rows longer than max_length=%d",
                           self.num_dropped, self.num_dropped + len(self.items), max_length)
        if not self.items and not self.num_dropped:
            raise DataError(f"SFT data {[str(s) for s in sources if not isinstance(s, list)]} holds no rows (empty); "
                            "give files with conversations in data.train_files")
        if not self.items:
            raise DataError(f"SFT data {[str(s) for s in sources if not isinstance(s, list)]}: no rows left "
                            f"({self.num_dropped} longer than data.max_length={max_length})")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def collate(items: Sequence[dict], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad rows: input_ids [B, S] int64, loss_mask [B, S] float32 (0 on padding), seq_lens [B] int64."""
    if not items:
        raise ValueError("collate needs at least one row")
    width = max(len(it["input_ids"]) for it in items)
    ids = torch.full((len(items), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.float32)
    for r, it in enumerate(items):
        n = len(it["input_ids"])
        ids[r, :n] = torch.tensor(it["input_ids"], dtype=torch.long)
        mask[r, :n] = torch.tensor(it["loss_mask"], dtype=torch.float32)
    seq_lens = torch.tensor([len(it["input_ids"]) for it in items], dtype=torch.long)
    return {"input_ids": ids, "loss_mask": mask, "seq_lens": seq_lens}
