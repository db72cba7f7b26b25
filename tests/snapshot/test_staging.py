"""The snapshot message's checksums. The GPU one (the sum of 64-bit words) runs here on CPU tensors:
the same torch operations a CUDA device runs."""
import numpy as np
import pytest
import torch

from elaswave.snapshot.staging import HostStaging, checksum, word_sum


def _message(n: int = 3 * 64) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(0)).view(torch.uint8).clone()


@pytest.mark.parametrize("check", [checksum, word_sum], ids=["crc32", "word_sum"])
def test_every_single_bit_flip_changes_the_checksum(check):
    msg = _message()
    base = int(check(msg))
    for byte in range(0, msg.numel(), 7):
        for bit in (0, 3, 7):
            damaged = msg.clone()
            damaged[byte] ^= 1 << bit
            assert int(check(damaged)) != base, (byte, bit)


def test_the_word_sum_is_exact_whatever_the_order():
    msg = _message(3 * 4096)
    words = msg.view(torch.int64).numpy()
    with np.errstate(over="ignore"):
        expected = int(words.sum(dtype=np.int64))  # wrapping, as the device's sum does
    assert int(word_sum(msg)) == expected
    assert int(word_sum(msg.view(torch.int64).flip(0).contiguous().view(torch.uint8))) == expected


def test_on_cpu_the_received_buffer_is_kept_as_it_is():
    staging = HostStaging(torch.device("cpu"))
    msg = _message()
    staged = staging.start(msg, 16)
    assert staged.wait() is msg
    assert int(staged.check) == int(checksum(msg[16:]))
    assert not staging.recycle(msg)
