"""Compare greedy token streams of two servers on the same weights.

Greedy decoding picks the top logit; two correct implementations may pick differently only where the
reference's top two logits are exactly equal (then either is the argmax). After the first difference
the two streams continue from different contexts, so each stream is compared up to there.
"""

from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

from completions import Completion


@dataclass
class Divergence:
    prompt: int
    position: int
    reference_token: int
    candidate_token: int
    #: The reference's two best (token, logprob) at that position.
    reference_top2: List[Tuple[int, float]]

    @property
    def is_exact_tie(self) -> bool:
        (first, first_lp), (second, second_lp) = self.reference_top2
        return first_lp == second_lp and {first, second} == {self.reference_token, self.candidate_token}


@dataclass
class MatchReport:
    tokens_compared: int = 0
    tokens_equal: int = 0
    divergences: List[Divergence] = field(default_factory=list)

    @property
    def ties(self) -> List[Divergence]:
        return [d for d in self.divergences if d.is_exact_tie]

    @property
    def mismatches(self) -> List[Divergence]:
        return [d for d in self.divergences if not d.is_exact_tie]

    def summary(self) -> str:
        return (f"{self.tokens_equal}/{self.tokens_compared} greedy tokens equal, "
                f"{len(self.ties)} divergence(s) at an exact top-2 tie of the reference, "
                f"{len(self.mismatches)} other divergence(s)")


def compare(reference: Sequence[Completion], candidate: Sequence[Completion]) -> MatchReport:
    """``reference`` must carry top-2 logprobs (requested with top_logprobs >= 2)."""
    if len(reference) != len(candidate):
        raise ValueError(f"reference has {len(reference)} completions, candidate {len(candidate)}")
    report = MatchReport()
    for prompt, (ref, cand) in enumerate(zip(reference, candidate)):
        if len(ref.token_ids) != len(cand.token_ids):
            raise ValueError(f"prompt {prompt}: {len(ref.token_ids)} reference tokens, {len(cand.token_ids)} candidate")
        if len(ref.top_logprobs) != len(ref.token_ids):
            raise ValueError(f"prompt {prompt}: the reference has no top logprobs per token")
        for position, (a, b) in enumerate(zip(ref.token_ids, cand.token_ids)):
            report.tokens_compared += 1
            if a == b:
                report.tokens_equal += 1
                continue
            top2 = sorted(ref.top_logprobs[position].items(), key=lambda item: -item[1])[:2]
            if len(top2) < 2:
                raise ValueError(f"prompt {prompt} position {position}: fewer than 2 reference top logprobs")
            report.divergences.append(Divergence(prompt, position, a, b, top2))
            break
    return report
