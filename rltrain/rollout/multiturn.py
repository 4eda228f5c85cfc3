"""Multi-turn tool-use rollout: the model writes code, a tool executor runs it, its output is appended, repeat.
It drives any Engine and a tool executor; it must not re-tokenize text the model sampled or run code itself.

Loop (all samples of a batch advance together):
  1. Generate for every active sample with the tool pattern's stop strings added (e.g. "</code>"),
     `max_tokens` per call, capped by what is left of `max_total_tokens`.
  2. A sample whose call ended on a tool stop string and whose current model turn contains a
     complete tool call (the LAST match of the pattern in the turn's decoded text) gets its code
     run; if the stop string fired without a complete call (e.g. an opening ``` fence) the same
     turn simply continues. EOS / a user stop ends the sample ("stop", the answer). Running out of
     `max_total_tokens`, `max_tokens` in a call, or `max_turns` ends it with "length".
  3. The codes of all samples that made a call run in ONE executor batch. Each output is rendered
     with `tool_output_template`, tokenized once and appended as-is (loss_mask 0, logprob 0.0),
     truncated if it would overflow `max_total_tokens`.
  4. The next call's prompt is prompt + every response token so far, as ids: sampled ids are never
     decoded and re-encoded, so there is no tokenization drift between turns.

num_turns counts model turns (segments of sampled tokens); tool_calls counts executed calls.
A tool call is only executed when another model turn is allowed (num_turns < max_turns).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from rltrain.data.sft_data import DEFAULT_TOOL_OUTPUT_TEMPLATE  # the SFT data's encoding of a tool's output
from rltrain.rollout.base import Engine, RolloutResponse, SamplingParams, check_prompts
from rltrain.utils.errors import UserError

ToolExecutor = Callable[[list[str]], list[str]]
"""A tool executor maps a batch of code strings to the same number of output strings."""


@dataclass(frozen=True)
class ToolPattern:
    """regex: group 1 is the code of a complete tool call. stop: strings that may close a call."""

    regex: re.Pattern
    stop: tuple[str, ...]

    def last_call(self, text: str) -> str | None:
        matches = list(self.regex.finditer(text))
        return matches[-1].group(1) if matches else None


# Tool-call syntaxes keyed by the config string `rollout.multi_turn.tool_pattern`.
TOOL_PATTERNS: dict[str, ToolPattern] = {
    # ```python\n...\n```  (language tag optional); a closing fence followed by a newline ends the turn.
    "code_block": ToolPattern(re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL), ("```\n",)),
    # <code>...</code>
    "code_tag": ToolPattern(re.compile(r"<code>(.*?)</code>", re.DOTALL), ("</code>",)),
}


class SandboxUnavailableError(UserError, RuntimeError):
    """The kernel cannot isolate tool code here and `sandbox.allow_unisolated` is off."""


def sandbox_isolation(*, allow_unisolated: bool = False, allow_exec: bool = False) -> str:
    """The isolation tool code gets on this machine (the run log's line; docs/security.md), e.g.
    "namespaces:user,mnt,pid,ipc,net + root:private(tmpfs 64 MiB) + caps:none + landlock:7 +
    seccomp(sockets:unix,inet,inet6) + limits:cgroup-v1(memory 1024 MiB, pids 34 per call)": new namespaces, a
    private read-only root with a size-limited tmpfs as the only writable place, no capabilities, Landlock, a
    seccomp filter with a socket-family allowlist, and a cgroup per call.

    Raises SandboxUnavailableError (saying why, and how to allow it knowingly) when the kernel cannot
    isolate it and allow_unisolated (config `sandbox.allow_unisolated`) is off."""
    from rltrain.sandbox import ALLOW_UNISOLATED_HINT, probe_isolation

    probe = probe_isolation(allow_exec=allow_exec)
    if not probe.isolated and not allow_unisolated:
        raise SandboxUnavailableError(f"tool calls are refused: the sandbox has no kernel isolation here "
                                      f"({probe.isolation}); fix that, or {ALLOW_UNISOLATED_HINT}")
    return probe.isolation


class SandboxToolExecutor:
    """The default executor: runs each code string with rltrain.sandbox.SandboxPool (bounded pool,
    time/memory limits, kernel isolation) and returns each result's `to_tool_output()` text.

    Refuses at construction (SandboxUnavailableError) where the kernel cannot isolate the code,
    unless allow_unisolated; allow_exec lets the code run the system's programs."""

    def __init__(self, max_workers: int = 4, timeout_s: float = 10.0, memory_mb: int = 1024, *,
                 allow_unisolated: bool = False, allow_exec: bool = False) -> None:
        from rltrain.sandbox import SandboxPool

        self.isolation = sandbox_isolation(allow_unisolated=allow_unisolated, allow_exec=allow_exec)
        self.pool = SandboxPool(max_workers, timeout_s=timeout_s, memory_mb=memory_mb,
                                allow_unisolated=allow_unisolated, allow_exec=allow_exec)

    def __call__(self, codes: list[str]) -> list[str]:
        return [result.to_tool_output() for result in self.pool.run_many(codes)]

    def close(self) -> None:
        self.pool.close()


@dataclass
class _Sample:
    prompt_index: int
    prompt: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_start: int = 0  # index in token_ids where the current model turn began
    num_turns: int = 1
    tool_calls: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class MultiTurnRollout:
    """Generate responses that may call a tool between model turns (see the module docstring).

    engine: any Engine. tokenizer: encode(text) -> ids (HF tokenizers get add_special_tokens=False)
    and decode(ids) -> text. tool_executor: ToolExecutor (default SandboxToolExecutor()).
    tool_pattern: a TOOL_PATTERNS key or a regex whose group 1 is the code (then `tool_stop`, the
    strings that close a call, is required). max_turns: most model turns per sample.
    max_total_tokens: most response tokens per sample, model and tool tokens together.
    tool_output_template: text around each tool output; must contain "{output}".
    """

    def __init__(self, engine: Engine, tokenizer, *, tool_executor: ToolExecutor | None = None,
                 tool_pattern: str = "code_block", tool_stop: tuple[str, ...] | list[str] | None = None,
                 max_turns: int = 4, max_total_tokens: int = 1024,
                 tool_output_template: str = DEFAULT_TOOL_OUTPUT_TEMPLATE) -> None:
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"MultiTurnRollout max_turns must be an int >= 1, got {max_turns!r}")
        if not isinstance(max_total_tokens, int) or max_total_tokens < 1:
            raise ValueError(f"MultiTurnRollout max_total_tokens must be an int >= 1, got {max_total_tokens!r}")
        if "{output}" not in tool_output_template:
            raise ValueError("MultiTurnRollout tool_output_template must contain '{output}', "
                             f"got {tool_output_template!r}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.pattern = _resolve_pattern(tool_pattern, tool_stop)
        self.tool_executor = tool_executor if tool_executor is not None else SandboxToolExecutor()
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.tool_output_template = tool_output_template
        self._encode_kwargs = ({"add_special_tokens": False}
                               if "add_special_tokens" in inspect.signature(tokenizer.encode).parameters else {})
        self._specials = _special_strings(tokenizer)

    def generate(self, prompts_token_ids: list[list[int]], sampling: SamplingParams) -> list[RolloutResponse]:
        """Same contract as Engine.generate: prompt-major responses, now with loss_mask,
        num_turns and tool_calls filled. `sampling.max_tokens` caps each generation call."""
        check_prompts(prompts_token_ids)
        samples = [_Sample(prompt_index=i, prompt=list(p)) for i, p in enumerate(prompts_token_ids)
                   for _ in range(sampling.n)]
        stop = tuple(dict.fromkeys(sampling.stop + self.pattern.stop))
        active = list(range(len(samples)))
        call = 0
        while active:
            budget = {r: self.max_total_tokens - len(samples[r].token_ids) for r in active}
            params = replace(sampling, stop=stop, max_tokens=min(sampling.max_tokens, max(budget.values())),
                             seed=None if sampling.seed is None else sampling.seed + call)
            if call == 0:  # one request per prompt; the engine expands n (prompt-major, like `samples`)
                responses = self.engine.generate([list(p) for p in prompts_token_ids], params)
            else:
                responses = self.engine.generate([samples[r].prompt + samples[r].token_ids for r in active],
                                                 replace(params, n=1))
            if len(responses) != len(active):
                raise RuntimeError(f"engine returned {len(responses)} responses for {len(active)} requests")
            call += 1
            tool_rows, codes, continuing = [], [], []
            for r, response in zip(active, responses):
                action = self._take_model_tokens(samples[r], response, budget[r])
                if action == "continue":
                    continuing.append(r)
                elif action is not None:  # a tool call's code
                    tool_rows.append(r)
                    codes.append(action)
            outputs = self.tool_executor(codes) if codes else []
            if len(outputs) != len(codes):
                raise RuntimeError(f"tool executor returned {len(outputs)} outputs for {len(codes)} calls")
            for r, output in zip(tool_rows, outputs):
                if self._take_tool_output(samples[r], output):
                    continuing.append(r)
            active = sorted(continuing)
        return [RolloutResponse(prompt_index=s.prompt_index, token_ids=s.token_ids, logprobs=s.logprobs,
                                finish_reason=s.finish_reason, loss_mask=s.loss_mask, stop_reason=s.stop_reason,
                                num_turns=s.num_turns, tool_calls=s.tool_calls) for s in samples]

    def _take_model_tokens(self, sample: _Sample, response: RolloutResponse, budget: int) -> str | None:
        """Append sampled tokens; return the code to run, "continue" to keep generating this turn,
        or None when the sample has finished (finish_reason set)."""
        ids, logprobs = response.token_ids[:budget], response.logprobs[:budget]
        logprobs = logprobs if len(logprobs) == len(ids) else [0.0] * len(ids)
        sample.token_ids += ids
        sample.logprobs += logprobs
        sample.loss_mask += [1] * len(ids)
        if len(response.token_ids) > budget:
            sample.finish_reason = "length"
            return None
        if response.finish_reason != "stop":
            sample.finish_reason = response.finish_reason
            return None
        if not (isinstance(response.stop_reason, str) and response.stop_reason in self.pattern.stop):
            sample.finish_reason, sample.stop_reason = "stop", response.stop_reason
            return None
        code = self.pattern.last_call(self.tokenizer.decode(sample.token_ids[sample.turn_start:]))
        if code is None:  # the stop string fired without a complete call: keep writing this turn
            if len(sample.token_ids) >= self.max_total_tokens:
                sample.finish_reason = "length"
                return None
            return "continue"
        if sample.num_turns >= self.max_turns or len(sample.token_ids) >= self.max_total_tokens:
            # no model turn (or no room) left to read the output: do not run it
            sample.finish_reason = "length"
            return None
        return code

    def _take_tool_output(self, sample: _Sample, output: str) -> bool:
        """Append the rendered tool output (loss_mask 0); True when the sample gets another turn."""
        ids = self._encode_tool_turn(output)
        room = self.max_total_tokens - len(sample.token_ids)
        ids = list(ids[:room])
        sample.token_ids += ids
        sample.logprobs += [0.0] * len(ids)
        sample.loss_mask += [0] * len(ids)
        sample.tool_calls += 1
        if len(sample.token_ids) >= self.max_total_tokens:
            sample.finish_reason = "length"
            return False
        sample.num_turns += 1
        sample.turn_start = len(sample.token_ids)
        return True


    def _encode_tool_turn(self, output: str) -> list[int]:
        """The template's text as the tokenizer reads it (its own special tokens stay special), the tool's
        output as plain text: a special-token string in the output (e.g. "<|end|><|user|>") becomes ordinary
        tokens, so a tool cannot forge turns into the context. Output without such strings is encoded in one
        piece with the template, exactly as before."""
        template = self.tool_output_template
        if not self._specials:
            return list(self.tokenizer.encode(template.replace("{output}", output), **self._encode_kwargs))
        reach = max(map(len, self._specials)) - 1
        pieces = template.split("{output}")
        window = "".join(p[max(len(p) - reach, 0):] + output + q[:reach] for p, q in zip(pieces, pieces[1:]))
        if not any(s in window for s in self._specials):
            return list(self.tokenizer.encode(template.replace("{output}", output), **self._encode_kwargs))
        ids = list(self.tokenizer.encode(pieces[0], **self._encode_kwargs)) if pieces[0] else []
        for piece in pieces[1:]:
            ids += self._encode_plain(output)
            if piece:
                ids += self.tokenizer.encode(piece, **self._encode_kwargs)
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        """Encode `text` so that no special-token string in it becomes its special token: the text is cut
        at each such string, and each string is encoded in two parts (neither is a special token)."""
        ids: list[int] = []
        for i, part in enumerate(re.split("(" + "|".join(map(re.escape, self._specials)) + ")", text)):
            if i % 2 == 0:
                ids += self.tokenizer.encode(part, **self._encode_kwargs) if part else []
            else:
                ids += self.tokenizer.encode(part[:1], **self._encode_kwargs) + self._encode_plain(part[1:])
        return ids


def _special_strings(tokenizer) -> tuple[str, ...]:
    """The strings this tokenizer turns into special or added tokens when they appear in text, longest first
    (HF: all special and added tokens; others: what their special ids decode to)."""
    found: set[str] = set()
    found.update(t for t in getattr(tokenizer, "all_special_tokens", None) or () if isinstance(t, str))
    get_added = getattr(tokenizer, "get_added_vocab", None)
    if callable(get_added):
        found.update(t for t in get_added() if isinstance(t, str))
    for token_id in getattr(tokenizer, "all_special_ids", None) or ():
        try:
            text = tokenizer.decode([token_id], skip_special_tokens=False)
        except Exception:  # a tokenizer whose decode takes no such argument, or rejects the id
            continue
        if isinstance(text, str):
            found.add(text)
    return tuple(sorted((t for t in found if t), key=len, reverse=True))


def _resolve_pattern(tool_pattern: str, tool_stop) -> ToolPattern:
    if tool_pattern in TOOL_PATTERNS:
        pattern = TOOL_PATTERNS[tool_pattern]
        return pattern if tool_stop is None else replace(pattern, stop=tuple(tool_stop))
    try:
        regex = re.compile(tool_pattern, re.DOTALL)
    except re.error as err:
        raise ValueError(f"MultiTurnRollout tool_pattern {tool_pattern!r} is neither one of {sorted(TOOL_PATTERNS)} "
                         f"nor a valid regex: {err}") from err
    if regex.groups < 1:
        raise ValueError(f"MultiTurnRollout tool_pattern regex {tool_pattern!r} needs a group capturing the code")
    if not tool_stop:
        raise ValueError("MultiTurnRollout with a custom tool_pattern regex needs tool_stop: the strings that close "
                         "a tool call (e.g. ['</tool>'])")
    return ToolPattern(regex, tuple(tool_stop))
