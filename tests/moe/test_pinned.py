"""`PinnedRegion` owns a `cudaHostRegister`ed range: the last owner unregisters it on close, on leaving a `with`
block or when collected; a refused registration is a `PinningError` under `FreetokenError`. A fake CUDA runtime
records the calls, so this runs on the CPU."""

from __future__ import annotations

import gc

import pytest

from freetoken.errors import FreetokenError
from freetoken.moe.pinned import PinnedBuffers, PinnedRegion, PinningError


class FakeCudart:
    def __init__(self, fail: int = 0) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []
        self.fail = fail

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", ptr))
        if self.fail:
            return self.fail
        assert ptr not in self.registered, "registered twice"
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        del self.registered[ptr]
        return 0


def test_the_last_owner_unregisters():
    rt, owner = FakeCudart(), bytearray(64)
    a = PinnedRegion(0x1000, 64, keep=owner, cudart=rt)
    b = PinnedRegion(0x1000, 64, cudart=rt)  # a second backend on the same pool: one registration
    assert rt.registered == {0x1000: 64} and rt.calls == [("register", 0x1000)]
    a.close()
    a.close()  # idempotent
    assert rt.registered == {0x1000: 64}
    del b
    gc.collect()
    assert rt.registered == {} and rt.calls[-1] == ("unregister", 0x1000)
    with PinnedRegion(0x2000, 8, cudart=rt):
        assert 0x2000 in rt.registered
    assert 0x2000 not in rt.registered


def test_a_refused_registration_is_a_freetoken_error():
    with pytest.raises(PinningError, match=r"CUDA error 2.*RLIMIT_MEMLOCK") as raised:
        PinnedRegion(0x3000, 10**9, cudart=FakeCudart(fail=2))
    assert isinstance(raised.value, FreetokenError) and isinstance(raised.value, RuntimeError)
    rt = FakeCudart()
    with PinnedRegion(0x3000, 8, cudart=rt):  # nothing was left counted by the failure
        assert rt.calls == [("register", 0x3000)]


@pytest.mark.cuda_mocked  # torch.cuda.cudart is replaced by a fake: nothing touches a device
def test_pinned_buffers_unregister_what_they_replace(monkeypatch):
    rt = FakeCudart()
    monkeypatch.setattr("torch.cuda.cudart", lambda: rt)
    bufs = PinnedBuffers(pin=True)
    small = bufs.get("x", (4,), __import__("torch").float32).data_ptr()
    assert small in rt.registered
    bufs.get("x", (1024,), __import__("torch").float32)  # grown: the old buffer is unregistered
    assert small not in rt.registered and len(rt.registered) == 1
    del bufs
    gc.collect()
    assert rt.registered == {}
