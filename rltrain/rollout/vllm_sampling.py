"""Generation through vLLM in our terms: our SamplingParams as vllm.SamplingParams' keyword arguments, and a vLLM
CompletionOutput as our RolloutResponse (log-probs of the sampled tokens, finish reason, our stop strings). Pure
translation: it must not import vllm or start an engine (rollout/vllm.py does).

Stop strings: prompts are token ids and vLLM has no tokenizer (skip_tokenizer_init), so vLLM cannot match
text. Stop *strings* are matched here on the finished tokens with our tokenizer, exactly as the hf engine
does (first token whose decoded prefix contains a stop string; EOS / stop ids win a tie); the tokens vLLM
sampled past that point are dropped (a stop string costs at most the rest of `max_tokens` in compute).
"""

from __future__ import annotations

from typing import Any

from rltrain.rollout.base import FINISH_REASONS, RolloutResponse, SamplingParams

def vllm_sampling_kwargs(sampling: SamplingParams, eos_token_ids: tuple[int, ...] = ()) -> dict[str, Any]:
    """Our SamplingParams as keyword arguments of vllm.SamplingParams. EOS is ours (the tokenizer's, as in the
    hf engine): vLLM's own is ignored and ours are stop ids. Stop strings are matched by us (module docstring)."""
    stop_ids = list(dict.fromkeys([*sampling.stop_token_ids, *eos_token_ids]))
    return {
        "n": 1 if sampling.greedy else sampling.n,  # vLLM refuses greedy n > 1: the prompt is repeated instead
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "max_tokens": sampling.max_tokens,
        "stop_token_ids": stop_ids,
        "ignore_eos": True,
        "seed": sampling.seed,
        "logprobs": 0 if sampling.logprobs else None,
        # log-probs in flat lists (vLLM's FlatLogprobs) instead of a dict and a Logprob object per token
        "flat_logprobs": bool(sampling.logprobs),
    }


def response_from_completion(prompt_index: int, completion, *, stop: tuple[str, ...] = (), decode=None,
                             eos_token_ids: tuple[int, ...] = ()) -> RolloutResponse:
    """A vLLM CompletionOutput (token_ids, logprobs: list[dict[id, Logprob]] | None, finish_reason, stop_reason)
    as a RolloutResponse, cut at the first stop string (`decode`: ids -> text). A stop on one of
    `eos_token_ids` reads as EOS (stop_reason None). Unknown finish reasons -> "abort"."""
    token_ids = [int(t) for t in completion.token_ids]
    lps = completion.logprobs
    if lps is not None and hasattr(lps, "start_indices"):  # FlatLogprobs: the sampled token's entry per position
        logprobs = []
        for k, tok in enumerate(token_ids):
            lo, hi = lps.start_indices[k], lps.end_indices[k]
            j = lo if lps.token_ids[lo] == tok else lps.token_ids.index(tok, lo, hi)
            logprobs.append(float(lps.logprobs[j]))
    elif lps:
        logprobs = [float(step[tok].logprob) for step, tok in zip(lps, token_ids)]
    else:
        logprobs = [0.0] * len(token_ids)
    finish = completion.finish_reason if completion.finish_reason in FINISH_REASONS else "abort"
    stop_reason = completion.stop_reason
    if stop_reason in eos_token_ids:
        stop_reason = None
    if stop:
        # vLLM's own stop (EOS / stop id) is the last token; it wins a tie with a stop string there
        natural_end = len(token_ids) - (1 if finish == "stop" else 0)
        for k in range(1, natural_end + 1):
            text = decode(token_ids[:k])
            hit = min((s for s in stop if s in text), key=text.find, default=None)
            if hit is not None:
                token_ids, logprobs, finish, stop_reason = token_ids[:k], logprobs[:k], "stop", hit
                break
    return RolloutResponse(prompt_index=prompt_index, token_ids=token_ids, logprobs=logprobs,
                           finish_reason=finish, stop_reason=stop_reason)
