"""pass@k and mean@n over ``n`` sampled completions per prompt (pure functions).

pass@k is the probability that at least one of ``k`` completions drawn without
replacement from a prompt's ``n`` is correct, estimated without bias from ``c`` correct
ones among ``n`` (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
https://arxiv.org/abs/2107.03374, eq. 1):

    pass@k = 1 - C(n - c, k) / C(n, k)

averaged over prompts. The ratio of binomials is computed as the product
``prod_{i = n-c+1}^{n} (1 - k / i)``, which never forms a large binomial coefficient (so no
overflow for large ``n``) and equals the ratio exactly in real arithmetic. mean@n is the
plain mean of a score over all ``n`` samples of every prompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["pass_at_k", "mean_pass_at_k", "mean_at_n", "default_ks"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct completions out of ``n``."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct completion
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(n: int, correct: Sequence[int], k: int) -> float:
    """pass@k averaged over prompts; ``correct[p]`` is prompt ``p``'s count of correct
    completions out of ``n``. NaN when there is no prompt."""
    if not correct:
        return math.nan
    return sum(pass_at_k(n, int(c), k) for c in correct) / len(correct)


def mean_at_n(scores: Sequence[float]) -> float:
    """Mean of the scores of all ``n`` samples of all prompts, NaN (unscorable) ones left
    out; NaN when none is scored."""
    scored = [float(s) for s in scores if not math.isnan(float(s))]
    return sum(scored) / len(scored) if scored else math.nan


def default_ks(n: int) -> list[int]:
    """The k values reported when the spec names none: 1 and n."""
    return sorted({1, n})
