"""`engine.cache.to_device` on the GPU: the copy is queued behind the stream's work, the host is not stopped, and
the numbers arrive. Skipped without CUDA."""

import pytest
import torch

from engine.cache import row_index, to_device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_to_device_does_not_wait_for_the_stream():
    busy = torch.cuda.Event()
    torch.cuda._sleep(200_000_000)  # ~0.1 s or more of GPU time queued on the current stream
    busy.record()
    got = to_device([[7, 8, 9], [1, 2, 3]], "cuda")
    assert not busy.query(), "to_device waited for the stream's queued work"
    assert got.is_cuda and got.tolist() == [[7, 8, 9], [1, 2, 3]]  # .tolist() waits: the copy ran behind the sleep


def test_scattered_rows_arrive_without_a_wait():
    busy = torch.cuda.Event()
    torch.cuda._sleep(200_000_000)
    busy.record()
    rows = row_index([5, 2, 7], torch.device("cuda"))
    assert not busy.query()
    assert rows.tolist() == [5, 2, 7]


def test_to_device_refuses_a_graph_capture():
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with pytest.raises(RuntimeError, match="capture"):
        with torch.cuda.graph(graph, stream=stream):
            to_device([1, 2], "cuda")
