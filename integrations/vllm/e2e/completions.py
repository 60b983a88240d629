"""Greedy completions from an OpenAI-compatible vLLM server, as token ids (and top logprobs)."""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Sequence

from uccl_ep_plugin.bench_serving.server import post_json

TOKEN_PREFIX = "token_id:"


@dataclass
class Completion:
    token_ids: List[int]
    #: Per generated position: {token id: logprob} of the most likely tokens (empty without top_logprobs).
    top_logprobs: List[Dict[int, float]]


def _token_id(text: str) -> int:
    if not text.startswith(TOKEN_PREFIX):
        raise ValueError(f"expected a token as {TOKEN_PREFIX}N (return_tokens_as_token_ids), got {text!r}")
    return int(text[len(TOKEN_PREFIX):])


def greedy_completion(base_url: str, model: str, prompt: Sequence[int], max_tokens: int, top_logprobs: int,
                      timeout: float) -> Completion:
    """``max_tokens`` tokens after ``prompt`` (token ids) at temperature 0, never stopping at EOS."""
    if not prompt or not all(isinstance(t, int) for t in prompt):
        raise ValueError(f"prompt must be a non-empty list of token ids, got {prompt!r}")
    answer = post_json(f"{base_url}/v1/completions", {
        "model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": max(top_logprobs, 1), "return_tokens_as_token_ids": True,
    }, timeout=timeout)
    logprobs = answer["choices"][0]["logprobs"]
    tops = [{_token_id(t): value for t, value in position.items()} for position in logprobs["top_logprobs"]]
    return Completion([_token_id(t) for t in logprobs["tokens"]], tops if top_logprobs else [])


def concurrent_greedy_completions(base_url: str, model: str, prompts: Sequence[Sequence[int]], max_tokens: int,
                                  top_logprobs: int = 0, timeout: float = 300.0) -> List[Completion]:
    """One request per prompt, all in flight at once (so a data-parallel server spreads them)."""
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futures = [pool.submit(greedy_completion, base_url, model, prompt, max_tokens, top_logprobs, timeout)
                   for prompt in prompts]
        return [future.result() for future in futures]
