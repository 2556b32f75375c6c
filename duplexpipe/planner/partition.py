"""The contiguous partition: split a row of costs into k non-empty runs whose largest sum is smallest."""

from __future__ import annotations

import math
from collections.abc import Sequence


def balanced_split(costs: Sequence[float], num_groups: int) -> list[int]:
    """Sizes of `num_groups` contiguous non-empty runs of `costs` whose largest sum is smallest.

    Dynamic programming over prefix sums (O(k n^2)); ties go to the split with shorter early runs
    (deterministic). Raises ValueError when `num_groups` is not in [1, len(costs)].
    """
    n = len(costs)
    if not 1 <= num_groups <= n:
        raise ValueError(f"cannot split {n} parts into {num_groups} groups (need 1 <= groups <= parts)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    # best[k][i]: the smallest largest-run sum splitting costs[:i] into k runs; cut[k][i]: where the last run starts
    best = [[math.inf] * (n + 1) for _ in range(num_groups + 1)]
    cut = [[0] * (n + 1) for _ in range(num_groups + 1)]
    best[0][0] = 0.0
    for k in range(1, num_groups + 1):
        for i in range(k, n - (num_groups - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12 * max(1.0, abs(value)):
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(num_groups, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]
