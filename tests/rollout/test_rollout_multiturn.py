"""Tests for the multi-turn tool loop with a scripted policy (a fake engine that follows the Engine
contract: stop strings, max_tokens, EOS) and a fake tool executor; one test uses the real sandbox."""

from __future__ import annotations

import string

import pytest
import torch

from rltrain.rollout import Engine, MultiTurnRollout, RolloutOutput, RolloutResponse, SamplingParams
from rltrain.rollout.multiturn import DEFAULT_TOOL_OUTPUT_TEMPLATE

PAD, EOS = 0, 1
CHARS = string.printable  # includes ` < > / \n


class CharTok:
    """ids 0 <pad>, 1 <eos>, then one id per printable character."""

    eos_token_id, pad_token_id = EOS, PAD

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        assert add_special_tokens is False  # the loop must not add BOS to tool outputs
        return [2 + CHARS.index(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(CHARS[i - 2] for i in ids if i >= 2)


TOK = CharTok()


def fake_logprob(position: int) -> float:
    """The scripted policy's log-prob for the token at absolute position `position` of prompt+response."""
    return -0.001 * (position + 1)


class ScriptedEngine(Engine):
    """Prompts are 2 characters ("A?"); scripts[prompt][k] is the text of model turn k, which the
    engine writes char by char after the k-th tool output, honouring stop strings and max_tokens,
    and ends with EOS."""

    def __init__(self, scripts: dict[str, list[str]], tool_end: str = "</output>\n"):
        self.scripts, self.tool_end = scripts, tool_end  # tool_end: how each tool turn ends
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []

    @property
    def eos_token_ids(self):
        return (EOS,)

    def generate(self, prompts_token_ids, sampling):
        self.calls.append(([list(p) for p in prompts_token_ids], sampling))
        out = []
        for index, prompt in enumerate(prompts_token_ids):
            text = TOK.decode(prompt)
            turn = text.count(self.tool_end)
            done = text[2:] if turn == 0 else text[text.rfind(self.tool_end) + len(self.tool_end):]
            script = self.scripts[text[:2]][turn]
            assert script.startswith(done), (script, done)
            for _ in range(sampling.n):
                ids, finish, stop_reason, written = [], None, None, ""
                for ch in script[len(done):] + "\0":
                    ids.append(EOS if ch == "\0" else TOK.encode(ch)[0])
                    written += ch
                    hit = [s for s in sampling.stop if s in written]
                    if ch == "\0":
                        finish = "stop"
                    elif hit:
                        finish, stop_reason = "stop", hit[0]
                    elif len(ids) == sampling.max_tokens:
                        finish = "length"
                    if finish:
                        break
                logprobs = [fake_logprob(len(prompt) + i) for i in range(len(ids))]
                out.append(RolloutResponse(index, ids, logprobs, finish, stop_reason=stop_reason))
        return out

    def update_weights(self, named_tensors):
        return 0

    def sleep(self, level=1):
        pass

    def wake_up(self):
        pass


class RecordingExecutor:
    def __init__(self, outputs: dict[str, str] | None = None, default: str = "ok"):
        self.outputs, self.default, self.batches = outputs or {}, default, []

    def __call__(self, codes):
        self.batches.append(list(codes))
        return [self.outputs.get(c, self.default) for c in codes]


def enc(text: str) -> list[int]:
    return TOK.encode(text)


def tool_turn(output: str) -> list[int]:
    return enc(DEFAULT_TOOL_OUTPUT_TEMPLATE.replace("{output}", output))


def check_logprobs(response: RolloutResponse) -> None:
    expected = [fake_logprob(2 + i) if m else 0.0 for i, m in enumerate(response.loss_mask)]
    assert response.logprobs == pytest.approx(expected, abs=0)


def test_code_tag_two_turns_loss_mask_turns_and_one_tool_batch():
    scripts = {"A?": ["let me compute <code>print(1+1)</code>", " so it is 2"],
               "B?": ["<code>x=3\nprint(x*x)</code>", "nine"]}
    engine, executor = ScriptedEngine(scripts), RecordingExecutor({"print(1+1)": "2", "x=3\nprint(x*x)": "9"})
    rollout = MultiTurnRollout(engine, TOK, tool_executor=executor, tool_pattern="code_tag", max_turns=4,
                               max_total_tokens=500)
    out = rollout.generate([enc("A?"), enc("B?")], SamplingParams(n=2, max_tokens=100, seed=5))

    assert [r.prompt_index for r in out] == [0, 0, 1, 1]
    assert executor.batches == [["print(1+1)"] * 2 + ["x=3\nprint(x*x)"] * 2]  # one batch for all samples
    for r in out:
        key = "A?" if r.prompt_index == 0 else "B?"
        first, tool, second = enc(scripts[key][0]), tool_turn("2" if key == "A?" else "9"), enc(scripts[key][1]) + [EOS]
        assert r.token_ids == first + tool + second
        assert r.loss_mask == [1] * len(first) + [0] * len(tool) + [1] * len(second)
        assert (r.num_turns, r.tool_calls, r.finish_reason, r.stop_reason) == (2, 1, "stop", None)
        check_logprobs(r)
    # Turn 2 was prompted with the exact ids: prompt + sampled ids + tool ids, nothing re-tokenized.
    second_prompts, second_sampling = engine.calls[1]
    expected_a = enc("A?") + enc(scripts["A?"][0]) + tool_turn("2")
    expected_b = enc("B?") + enc(scripts["B?"][0]) + tool_turn("9")
    assert second_prompts == [expected_a, expected_a, expected_b, expected_b]
    assert second_sampling.n == 1 and "</code>" in second_sampling.stop and second_sampling.seed == 6
    assert len(engine.calls) == 2


def test_code_block_opening_fence_continues_the_same_turn():
    scripts = {"A?": ["run:\n```\nprint(5)\n```\n", "it printed 5"], "B?": ["```python\nprint(7)\n```\n", "7"]}
    engine, executor = ScriptedEngine(scripts), RecordingExecutor()
    rollout = MultiTurnRollout(engine, TOK, tool_executor=executor, tool_pattern="code_block", max_total_tokens=500)
    out = rollout.generate([enc("A?"), enc("B?")], SamplingParams(max_tokens=100))
    # A stops first on the opening fence "```\n" (no complete block: continue), then on the closing one.
    assert executor.batches == [["print(7)\n"], ["print(5)\n"]]
    for r, key in zip(out, ["A?", "B?"]):
        first, tool, second = enc(scripts[key][0]), tool_turn("ok"), enc(scripts[key][1]) + [EOS]
        assert r.token_ids == first + tool + second
        assert r.loss_mask == [1] * len(first) + [0] * len(tool) + [1] * len(second)
        assert (r.num_turns, r.tool_calls, r.finish_reason) == (2, 1, "stop")
        check_logprobs(r)


def test_max_turns_stops_before_running_a_call_nobody_can_read():
    scripts = {"A?": ["<code>a</code>", "<code>b</code>", "<code>c</code>", "end"]}
    executor = RecordingExecutor()
    rollout = MultiTurnRollout(ScriptedEngine(scripts), TOK, tool_executor=executor, tool_pattern="code_tag",
                               max_turns=2, max_total_tokens=500)
    (r,) = rollout.generate([enc("A?")], SamplingParams(max_tokens=100))
    assert executor.batches == [["a"]]
    assert r.token_ids == enc("<code>a</code>") + tool_turn("ok") + enc("<code>b</code>")
    assert (r.num_turns, r.tool_calls, r.finish_reason) == (2, 1, "length")
    check_logprobs(r)


def test_max_total_tokens_truncates_tool_output_and_model_tokens():
    scripts = {"A?": ["<code>a</code>", "end"]}
    first = enc(scripts["A?"][0])
    rollout = MultiTurnRollout(ScriptedEngine(scripts), TOK, tool_executor=RecordingExecutor(default="x" * 50),
                               tool_pattern="code_tag", max_total_tokens=len(first) + 10)
    (r,) = rollout.generate([enc("A?")], SamplingParams(max_tokens=100))
    assert r.token_ids == first + tool_turn("x" * 50)[:10]
    assert r.loss_mask == [1] * len(first) + [0] * 10
    assert (r.finish_reason, r.tool_calls, r.num_turns) == ("length", 1, 1)

    executor = RecordingExecutor()
    rollout = MultiTurnRollout(ScriptedEngine(scripts), TOK, tool_executor=executor, tool_pattern="code_tag",
                               max_total_tokens=5)
    (r,) = rollout.generate([enc("A?")], SamplingParams(max_tokens=100))
    assert r.token_ids == first[:5] and r.finish_reason == "length" and executor.batches == []


def test_per_call_max_tokens_and_user_stop_strings_end_the_sample():
    scripts = {"A?": ["a long answer without tools"]}
    rollout = MultiTurnRollout(ScriptedEngine(scripts), TOK, tool_executor=RecordingExecutor(), tool_pattern="code_tag")
    (r,) = rollout.generate([enc("A?")], SamplingParams(max_tokens=4))
    assert r.token_ids == enc("a lo") and r.finish_reason == "length" and r.num_turns == 1
    (r,) = rollout.generate([enc("A?")], SamplingParams(max_tokens=100, stop=["without"]))
    assert r.token_ids == enc("a long answer without")
    assert (r.finish_reason, r.stop_reason, r.tool_calls) == ("stop", "without", 0)


def test_custom_regex_pattern_and_rollout_output_masks():
    scripts = {"A?": ["<tool>q</tool>", "fin"]}
    rollout = MultiTurnRollout(ScriptedEngine(scripts, tool_end="]"), TOK, tool_executor=RecordingExecutor({"q": "Q"}),
                               tool_pattern=r"<tool>(.*?)</tool>", tool_stop=["</tool>"],
                               tool_output_template="[{output}]")
    responses = rollout.generate([enc("A?")], SamplingParams(n=3, max_tokens=100))
    expected = enc("<tool>q</tool>") + enc("[Q]") + enc("fin") + [EOS]
    assert all(r.token_ids == expected for r in responses)
    batch = RolloutOutput.from_responses(responses, pad_token_id=PAD)
    n_first = len(enc("<tool>q</tool>"))
    assert batch.loss_mask[0].tolist() == [1] * n_first + [0, 0, 0] + [1] * 4
    assert torch.all(batch.sampler_logprobs[:, n_first:n_first + 3] == 0)
    assert batch.metrics()["rollout/tool_calls/mean"] == 1.0


@pytest.mark.parametrize("kwargs,match", [
    ({"tool_pattern": r"<t>.*?</t>", "tool_stop": ["</t>"]}, "group"),
    ({"tool_pattern": r"<t>(.*?)</t>"}, "tool_stop"),
    ({"tool_pattern": r"<t>((</t>"}, "regex"),
    ({"tool_output_template": "no placeholder"}, "output"),
    ({"max_turns": 0}, "max_turns"),
    ({"max_total_tokens": 0}, "max_total_tokens"),
])
def test_bad_configuration_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiTurnRollout(ScriptedEngine({}), TOK, tool_executor=RecordingExecutor(), **kwargs)


@pytest.mark.sandbox
def test_real_sandbox_runs_the_code():
    from rltrain.rollout.multiturn import SandboxToolExecutor

    executor = SandboxToolExecutor(max_workers=2, timeout_s=20.0, memory_mb=512)
    try:
        scripts = {"A?": ["<code>print(6*7)</code>", "42"], "B?": ["<code>raise ValueError('boom')</code>", "err"]}
        rollout = MultiTurnRollout(ScriptedEngine(scripts), TOK, tool_executor=executor, tool_pattern="code_tag")
        a, b = rollout.generate([enc("A?"), enc("B?")], SamplingParams(max_tokens=100))
    finally:
        executor.close()
    tool_a = TOK.decode([t for t, m in zip(a.token_ids, a.loss_mask) if m == 0])
    tool_b = TOK.decode([t for t, m in zip(b.token_ids, b.loss_mask) if m == 0])
    assert tool_a == DEFAULT_TOOL_OUTPUT_TEMPLATE.replace("{output}", "42\n")
    assert "boom" in tool_b and "Error" in tool_b
    assert (a.num_turns, a.tool_calls, a.finish_reason) == (2, 1, "stop")
