"""`freetoken._core.DecodeDriver` from Python, on host memory: this test plays the device's side of the handshake
(posts routing, waits for each layer's flags) and checks the plans and CPU sums against the pool and
`CpuExperts`; bad buffers and a device that never posts are errors, not hangs. (On CUDA the graph plays the device:
tests/engine/test_gpu.py.)"""

from __future__ import annotations

import time

import numpy as np
import pytest

from freetoken._core import (
    CpuExperts,
    DecodeDriver,
    DeviceTimeoutError,
    ExpertPool,
    FreetokenError,
    HandshakeBuffers,
    InvalidArgumentError,
    LayerServer,
    OutOfRangeError,
    Planner,
    StepReport,
    align_slots,
    aligned_len,
    mail_layout,
)

L, E, H, I, K = 3, 8, 32, 16, 2
SLOTS, MAX_ROWS, BLOCK_M = 3, 4, 4


class Rig:
    def __init__(self, mode: str, timeout_s: float = 10.0) -> None:
        self.pool = ExpertPool.random(L, E, H, I, seed=3)
        self.cpu = CpuExperts(self.pool, num_threads=2)
        self.planner = Planner(L, E, self.pool.expert_nbytes, SLOTS, pcie_bytes_per_s=1e9, cpu_bytes_per_s={1: 1e9})
        rows, tiles = aligned_len(MAX_ROWS * K, SLOTS, BLOCK_M)
        self.flags = np.zeros((4, L), dtype=np.uint32)  # mail, plan, fill, cpu
        self.mail = np.zeros(mail_layout(MAX_ROWS, K, H)[2], dtype=np.uint8)
        self.plan = np.zeros(MAX_ROWS * K + rows + 2 * tiles, dtype=np.int64)
        self.cpu_out = np.zeros(MAX_ROWS * H, dtype=np.float32)
        self.slots = np.zeros((SLOTS, self.pool.expert_stride), dtype=np.uint8)
        self.arena = np.frombuffer(self.pool.arena_view(), dtype=np.uint8)
        self.server = LayerServer(self.planner, self.cpu, SLOTS, slots=self.slots.reshape(-1))
        self.buffers = self.handshake_buffers()
        self.driver = DecodeDriver(self.server, self.buffers, mode, K, timeout_s=timeout_s)

    def handshake_buffers(self, **replace) -> HandshakeBuffers:
        names = ("mail_flag", "plan_flag", "fill_flag", "cpu_flag")
        arrays = {
            **dict(zip(names, self.flags, strict=True)),
            "mail": self.mail,
            "plan": self.plan,
            "cpu_out": self.cpu_out,
        }
        return HandshakeBuffers(**{**arrays, **replace})

    def device_step(self, generation: int, ids: np.ndarray, batch: int) -> tuple[int, int]:
        """Post every layer's routing (`ids` [size, k]) and check what comes back; the picks the CPU ran and the
        tiles of filled slots."""
        size = ids.shape[0]
        rng = np.random.default_rng(generation)
        cpu_picks = filled_tiles = 0
        for layer in range(L):
            weights = rng.random((size, K), dtype=np.float32)
            hidden = rng.standard_normal((size, H), dtype=np.float32)
            w_at, h_at, end = mail_layout(size, K, H)
            mail = self.mail[:end]
            mail[:w_at].view(np.int64)[:] = ids.reshape(-1)
            mail[w_at:h_at].view(np.float32)[:] = weights.reshape(-1)
            mail[h_at:].view(np.float32)[:] = hidden.reshape(-1)
            self.flags[0, layer] = generation
            deadline = time.monotonic() + 10
            while self.flags[3, layer] != generation:
                assert time.monotonic() < deadline, "the driver never served the layer"
            assert self.flags[1, layer] == self.flags[2, layer] == generation
            slots = self.plan[: size * K].reshape(size, K)
            assert (slots[batch:] == -1).all()
            expected = np.zeros((batch, H), dtype=np.float32)
            cpu_experts = sorted(
                {int(e) for e, s in zip(ids[:batch].ravel(), slots[:batch].ravel(), strict=True) if s < 0}
            )
            for e, s in zip(ids[:batch].ravel(), slots[:batch].ravel(), strict=True):
                if s >= 0:  # the slot holds the expert's bytes
                    start = self.pool.expert_offset(layer, int(e))
                    n = self.pool.expert_nbytes
                    np.testing.assert_array_equal(self.slots[s, :n], self.arena[start : start + n])
            if cpu_experts:
                cpu_picks += int((slots[:batch] < 0).sum())
                self.cpu.forward(layer, hidden[:batch], ids[:batch], weights[:batch], cpu_experts, expected)
            np.testing.assert_allclose(self.cpu_out[: batch * H].reshape(batch, H), expected, rtol=1e-5, atol=1e-6)
            want = np.zeros(len(self.plan), dtype=np.int64)
            rows, tiles = align_slots(np.ascontiguousarray(slots), SLOTS, BLOCK_M, want)
            np.testing.assert_array_equal(self.plan[: size * K + rows], want[: size * K + rows])
            # The tiles apart: hits' (run at once) and filled slots' (after the fill flag); each in one row.
            ready, later = self.plan[size * K + rows :][: 2 * tiles].reshape(2, tiles)
            assert ((ready < 0) | (later < 0)).all()
            np.testing.assert_array_equal(np.maximum(ready, later), want[size * K + rows :][:tiles])
            assert not set(ready[ready >= 0].tolist()) & set(later[later >= 0].tolist())
            filled_tiles += int((later >= 0).sum())
        return cpu_picks, filled_tiles


@pytest.mark.parametrize("mode", ["offload", "cpu", "hybrid"])
def test_driver_serves_steps_through_host_memory(mode):
    rig = Rig(mode)
    routing = np.array([[0, 1], [2, 3], [1, 4], [7, 0]], dtype=np.int64)
    total_cpu = total_filled = 0
    for generation in range(1, 5):
        batch, size = (3, 4) if generation % 2 == 0 else (1, 2)
        ids = np.roll(routing, generation, axis=0)[:size]
        rig.driver.start(batch, size, generation, BLOCK_M)
        cpu_picks, filled = rig.device_step(generation, ids, batch)
        total_filled += filled
        rig.driver.wait_served(L - 1, generation)
        report = rig.driver.finish()
        assert isinstance(report, StepReport) and report.cpu_picks == cpu_picks
        with pytest.raises(AttributeError):
            report.fills = 0  # frozen
        total_cpu += cpu_picks
        if mode == "cpu":
            assert report.fills == 0
    stats = rig.planner.stats()
    assert int(stats["steps"].sum()) == 4 * L
    if mode != "offload":
        assert total_cpu > 0
    if mode != "cpu":
        assert total_filled > 0


def test_a_device_that_never_posts_raises_and_releases_every_layer():
    rig = Rig("offload", timeout_s=0.05)
    rig.driver.start(1, 1, 1, BLOCK_M)
    with pytest.raises(DeviceTimeoutError, match="did not post MoE layer 0") as raised:
        rig.driver.finish()
    # A TimeoutError (callers may catch the builtin) under the one root, naming where it stopped.
    assert isinstance(raised.value, TimeoutError) and isinstance(raised.value, FreetokenError)
    assert (raised.value.layer, raised.value.step) == (0, 1)
    assert (rig.flags[1:] == 1).all()  # the device would run to the end of its step
    rig.driver.start(1, 1, 2, BLOCK_M)  # and the driver serves the next step
    rig.device_step(2, np.array([[5, 6]], dtype=np.int64), 1)
    rig.driver.finish()


def test_bad_buffers_and_calls_are_clear_errors():
    rig = Rig("hybrid")
    with pytest.raises(InvalidArgumentError, match="one flag per MoE layer"):
        rig.handshake_buffers(mail_flag=rig.flags[0, :2])
    with pytest.raises(InvalidArgumentError, match="one per MoE layer"):
        DecodeDriver(
            rig.server,
            rig.handshake_buffers(
                **dict.fromkeys(("mail_flag", "plan_flag", "fill_flag", "cpu_flag"), np.zeros(2, np.uint32))
            ),
            "hybrid",
            K,
        )
    with pytest.raises(InvalidArgumentError, match="dtype float32"):
        rig.handshake_buffers(cpu_out=rig.cpu_out.astype(np.float64))
    with pytest.raises(InvalidArgumentError, match="either slots"):
        LayerServer(rig.planner, rig.cpu, SLOTS)
    with pytest.raises(ValueError, match="backend"):
        DecodeDriver(rig.server, rig.buffers, "magic", K)
    with pytest.raises(InvalidArgumentError, match="no step is running"):
        rig.driver.finish()
    with pytest.raises(InvalidArgumentError, match="bad step"):
        rig.driver.start(3, 2, 1, BLOCK_M)
    rig.driver.start(5, 5, 1, BLOCK_M)  # more rows than the buffers hold: the step fails, nothing hangs
    with pytest.raises(InvalidArgumentError, match="the buffers hold"):
        rig.driver.finish()
    # A plan error keeps its kind across the driver thread, and names the layer.
    rig.driver.start(1, 1, 2, BLOCK_M)
    rig.mail[:8].view(np.int64)[0] = E  # an expert id out of range, posted for every layer
    rig.flags[0] = 2
    with pytest.raises(OutOfRangeError, match=r"MoE layer 0.*out of range"):
        rig.driver.finish()


@pytest.mark.skipif(
    __import__("os").environ.get("TRITON_INTERPRET") != "1",
    reason="CPU tensors need Triton's interpreter (conftest sets it without a GPU)",
)
def test_device_kernels_of_the_handshake_in_the_interpreter():
    """The device side's kernels on CPU tensors: `_post_mail` writes the layout the driver reads (`mail_len`,
    `mail_views`) from strided router outputs, then the generation into the mail flag, and leaves its row counter
    at zero for the next layer; `_wait_fetch` copies once the flag holds the generation, adds into
    the destination with `accumulate`, and marks a layer it gave up on."""
    import torch

    from freetoken.moe.handshake import _fetch, _post_mail, _wait_fetch, mail_views

    size = 3
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, E, (size, K + 1), generator=gen)[:, :K]  # row stride K + 1, as a slice would have
    weights = torch.rand(size, K, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    hidden = torch.randn(size, H + 5, generator=gen).to(torch.bfloat16)[:, :H]
    buf = torch.zeros(size * (12 * K + 4 * H), dtype=torch.uint8)  # the driver's `mail_len`
    views = mail_views(buf, size, K, H)
    arrived, mail_flag = torch.zeros(1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    gen_dev = torch.tensor([7], dtype=torch.int32)
    _post_mail[(size,)](
        ids,
        weights,
        hidden,
        *views,
        arrived,
        mail_flag[1:],
        gen_dev,
        H,
        ids.stride(0),
        weights.stride(0),
        hidden.stride(0),
        TOP_K=K,
        BLOCK_K=2,
        BLOCK_H=16,
    )
    assert mail_flag.tolist() == [0, 7] and arrived.item() == 0
    assert torch.equal(views[0], ids)
    assert torch.equal(views[1], weights.float())
    assert torch.equal(views[2], hidden.float())

    flags = torch.zeros(2, dtype=torch.int32)
    src = torch.randn(10, generator=gen)
    dst = torch.ones(10, dtype=torch.bfloat16)
    flags[0] = 7
    _fetch(flags[0:], gen_dev, src, dst, flags[1:], accumulate=True)
    torch.testing.assert_close(dst.float(), 1 + src, atol=0, rtol=2**-7)  # to bf16 (the interpreter truncates)
    plan = torch.zeros(10, dtype=torch.int64)
    _fetch(flags[0:], gen_dev, torch.arange(10), plan, flags[1:])
    assert plan.tolist() == list(range(10)) and flags[1] == 0
    flags[0] = 6  # an old generation: the kernel gives up after its polls and marks the layer
    _wait_fetch[(1,)](flags[0:], gen_dev, src, dst, flags[1:], 10, 3, BLOCK=16, ACCUMULATE=False)
    assert flags[1] == 7
