"""engine.lookup.propose on the GPU: inside a captured CUDA graph, replayed over new histories, it gives what it
gives eagerly. Skipped without CUDA."""

import pytest
import torch

from engine.lookup import propose

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_proposals_from_a_graph_replay_equal_eager_ones_for_new_histories():
    gen = torch.Generator(device="cuda").manual_seed(0)
    history = torch.randint(0, 5, (8, 2048), device="cuda", generator=gen)
    lengths = torch.randint(1, 2048, (8,), device="cuda", generator=gen)
    propose(history, lengths, 5)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = propose(history, lengths, 5)
    for seed in range(1, 6):
        gen.manual_seed(seed)
        history.copy_(torch.randint(0, 5, (8, 2048), device="cuda", generator=gen))
        lengths.copy_(torch.randint(1, 2048, (8,), device="cuda", generator=gen))
        graph.replay()
        want = propose(history, lengths, 5)
        assert torch.equal(out[1], want[1])
        for i in range(8):
            assert torch.equal(out[0][i, :want[1][i]], want[0][i, :want[1][i]])
