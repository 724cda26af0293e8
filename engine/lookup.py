"""N-gram lookup proposals on the device: a drafter without weights.

After a request's last n tokens, propose the tokens that followed the most recent earlier occurrence of those
n tokens in its own history (prompt and reply so far), for the longest n from max_n down to min_n that
occurred; nothing where none did. Verified like any draft, so the output is the target's (greedy: the same
tokens; sampled: a proposal is a draft distribution that puts all its mass on one token).

`propose` does it for a batch of rows at once with fixed shapes and no host synchronization, so it can run
inside a captured CUDA graph, and each round's proposals can come from the round before without the host.
`bench.ngram_headroom` plays the same rule over the target's replies (`ngram_lookup`, its reference here).
"""

from __future__ import annotations

import torch


def propose(history: torch.Tensor, lengths: torch.Tensor, gamma: int, max_n: int = 3,
            min_n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """history (b, S) token ids, row i's tokens in history[i, :lengths[i]] (the rest is ignored); lengths (b,)
    -> (proposals (b, gamma), counts (b,)): row i proposes proposals[i, :counts[i]], the tokens that followed
    the most recent earlier occurrence of its last n tokens (the longest n in max_n .. min_n that occurred, up
    to gamma tokens and never past its length); counts[i] == 0 where none occurred (proposals[i] then
    undefined). The same as `bench.ngram_headroom.ngram_lookup` on each row."""
    if gamma < 1 or not 1 <= min_n <= max_n:
        raise ValueError(f"gamma {gamma}, n {min_n}..{max_n}: need gamma >= 1 and 1 <= min_n <= max_n")
    b, s = history.shape
    lengths = lengths.to(device=history.device, dtype=torch.long)
    found = torch.zeros(b, dtype=torch.bool, device=history.device)
    follow = torch.zeros(b, dtype=torch.long, device=history.device)  # where the proposal starts
    for n in range(max_n, min_n - 1, -1):
        if n >= s:
            continue
        # The row's last n tokens (clamped to the row: a row shorter than n + 1 has no earlier occurrence).
        tail = history.gather(1, (lengths[:, None] - n + torch.arange(n, device=history.device)).clamp(0, s - 1))
        starts = torch.arange(s - n + 1, device=history.device)  # candidate occurrences at p .. p + n - 1
        match = starts[None] <= lengths[:, None] - n - 1  # strictly before the suffix itself
        for j in range(n):
            match = match & (history[:, j:s - n + 1 + j] == tail[:, j:j + 1])
        last = torch.where(match, starts[None], -1).amax(dim=1)  # the most recent occurrence, -1 if none
        take = (last >= 0) & ~found  # the longest n that occurred wins
        follow = torch.where(take, last + n, follow)
        found = found | take
    offsets = torch.arange(gamma, device=history.device)
    proposals = history.gather(1, (follow[:, None] + offsets).clamp(max=s - 1))
    counts = torch.where(found, (lengths - follow).clamp(min=0, max=gamma), 0)
    return proposals, counts
