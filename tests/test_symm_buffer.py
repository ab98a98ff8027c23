"""runtime/symm.py's SymmBuffer.view: the fused ops take the same views call after call, so a view
is made once per (rank, dtype, shape, offset); it reads the buffer's bytes, and the table of views
stays bounded however many shapes come (a CPU tensor stands in for symmetric memory)."""

import torch

from ditron_inductor.runtime.symm import SymmBuffer


def test_views_are_made_once_read_the_buffer_and_stay_bounded():
    local = torch.arange(256, dtype=torch.uint8)
    peer = torch.zeros(256, dtype=torch.uint8)
    buf = SymmBuffer(local, [local, peer])
    v = buf.view(-1, torch.int16, (4, 8))
    assert v is buf.view(-1, torch.int16, [4, 8])  # a list or a tuple: the same view
    assert torch.equal(v.view(torch.uint8).flatten(), local[:64])
    assert buf.view(1, torch.int16, (4, 8)).data_ptr() == peer.data_ptr()
    assert buf.view(-1, torch.int16, (4, 8), byte_offset=64).data_ptr() == local.data_ptr() + 64
    assert buf.words.dtype == torch.int32 and buf.words.numel() == 64
    for rows in range(1, 1200):
        buf.view(-1, torch.uint8, (rows % 250 + 1, 1), byte_offset=rows % 5)
    assert len(buf._views) <= 1024
