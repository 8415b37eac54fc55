"""2 ranks (gloo): masked_whiten pools mean and variance over ranks = whitening the
concatenation."""

import sys

import torch
import torch.distributed as dist

from ppo import masked_whiten

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 5, generator=g, dtype=torch.float64) * (1 + r) + r for r in range(2)]
    masks = [(torch.rand(3, 5, generator=g) > 0.4).long() for _ in range(2)]
    got = masked_whiten(xs[rank], masks[rank])
    dist.destroy_process_group()
    whole = masked_whiten(torch.cat(xs), torch.cat(masks))  # one process, no collectives
    want = whole[3 * rank : 3 * (rank + 1)]
    torch.testing.assert_close(got, want)
    local_only = masked_whiten(xs[rank], masks[rank])  # and the pooled result is not the local one
    assert not torch.allclose(got, local_only), "rank statistics were not pooled"
    print("whiten across ranks ok", file=sys.stdout)
