from collections.abc import Sequence

import numpy as np

def fill_prefixes(
    holders: dict[int, int],
    hashes: Sequence[int],
    members: int,
    out: np.ndarray,
    max_probes: int,
    resolution: int,
    /,
) -> bool: ...
