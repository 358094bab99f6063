"""OldActorSnapshot: step-start log-probs reproduced exactly, live weights restored bit-exactly."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from lightning_fasync.algorithms import OldActorSnapshot

V, H = 11, 8


class TinyLM(nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.mid = nn.Linear(H, H)
        self.head = nn.Linear(H, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def token_log_probs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]) for a toy causal-free model: enough to see weight changes."""
    logits = model(ids[:, :-1]).log_softmax(-1)
    return logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    opt.zero_grad()
    (-token_log_probs(model, ids).mean()).backward()
    opt.step()


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("offload", [True, False])
@pytest.mark.parametrize("tied", [False, True])
def test_snapshot_reproduces_step_start_log_probs_and_restores_live_weights(offload, tied):
    torch.manual_seed(0)
    model = TinyLM(tied)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batches = [torch.randint(0, V, (3, 6)) for _ in range(3)]
    step_start = copy.deepcopy(model)
    snap = OldActorSnapshot(model, offload_to_cpu=offload)

    snap.begin_step(0)
    with torch.no_grad(), snap.use_old_weights() as swapped:  # first mini-batch: takes the snapshot
        first_old = token_log_probs(model, batches[0])
    assert swapped is False and snap.has_snapshot
    train_step(model, opt, batches[0])

    for ids in batches[1:]:
        snap.begin_step(0)  # idempotent within a step
        live = params(model)
        with torch.no_grad():
            live_lp = token_log_probs(model, ids)
            with snap.use_old_weights() as swapped:
                old = token_log_probs(model, ids)
        assert swapped is True
        assert torch.equal(old, token_log_probs(step_start, ids).detach())  # exact step-start values
        assert not torch.equal(old, live_lp)  # the actor did move
        assert_bit_equal(params(model), live)  # live weights restored bit-exactly
        train_step(model, opt, ids)

    with torch.no_grad(), snap.use_old_weights():
        assert torch.equal(token_log_probs(model, batches[0]), first_old)

    # New step: the snapshot is invalidated and the next use snapshots the current weights.
    snap.begin_step(1)
    assert not snap.has_snapshot
    now = params(model)
    with snap.use_old_weights() as swapped:
        pass
    assert swapped is False
    with torch.no_grad():
        model.mid.weight.add_(1.0)
    with torch.no_grad(), snap.use_old_weights() as swapped:
        assert swapped is True
        assert_bit_equal(params(model), now)


def test_snapshot_stores_each_local_tensor_once_on_cpu():
    model = TinyLM(tied=True)
    snap = OldActorSnapshot(model, offload_to_cpu=True)
    snap.begin_step(0)
    with snap.use_old_weights():
        pass
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert [tuple(b.shape) for b in snap._buffers] == shapes  # tied weight stored once
    assert all(b.device.type == "cpu" for b in snap._buffers)
    snap.release()
    assert not snap.has_snapshot and snap._buffers == []


def test_exception_inside_the_block_restores_live_weights():
    torch.manual_seed(1)
    model = TinyLM()
    snap = OldActorSnapshot(model)
    snap.begin_step(3)
    with snap.use_old_weights():
        pass
    start = params(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    live = params(model)
    with pytest.raises(KeyError):
        with snap.use_old_weights():
            raise KeyError("boom")
    assert_bit_equal(params(model), live)
    with snap.use_old_weights():  # the snapshot itself survived the failed block
        assert_bit_equal(params(model), start)
    assert_bit_equal(params(model), live)


def test_misuse_raises_clear_errors():
    model = TinyLM()
    snap = OldActorSnapshot(model)
    snap.begin_step(0)
    with snap.use_old_weights():
        pass
    with snap.use_old_weights():
        with pytest.raises(RuntimeError, match="nested"):
            with snap.use_old_weights():
                pass
        with pytest.raises(RuntimeError, match="begin_step"):
            snap.begin_step(1)
    model.extra = nn.Linear(2, 2)  # parameter set changed within the step
    with pytest.raises(RuntimeError, match="changed shape or count"):
        with snap.use_old_weights():
            pass


DTENSOR_SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from lightning_fasync.algorithms import OldActorSnapshot

    rank, init = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    lin = nn.Linear(4, 6)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))
    lin.bias = nn.Parameter(distribute_tensor(lin.bias.detach(), mesh, [Shard(0)]))
    snap = OldActorSnapshot(lin)
    snap.begin_step(0)
    with snap.use_old_weights():
        pass
    # Exactly the local shards are stored: half of the rows on each of the two ranks.
    assert [tuple(b.shape) for b in snap._buffers] == [(3, 4), (3,)], [b.shape for b in snap._buffers]
    start = [p.to_local().clone() for p in lin.parameters()]
    with torch.no_grad():
        for p in lin.parameters():
            p.to_local().add_(rank + 1.0)
    live = [p.to_local().clone() for p in lin.parameters()]
    with snap.use_old_weights() as swapped:
        assert swapped
        assert all(torch.equal(p.to_local(), s) for p, s in zip(lin.parameters(), start))
    assert all(torch.equal(p.to_local(), s) for p, s in zip(lin.parameters(), live))
    dist.destroy_process_group()
    print("ok", rank)
    """
)


def test_snapshot_of_dtensor_parameters_keeps_local_shards(tmp_path):
    """Two gloo ranks with row-sharded DTensor parameters (the FSDP2 layout)."""
    init = f"file://{tmp_path / 'store'}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DTENSOR_SCRIPT, str(rank), init],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out
        assert f"ok {rank}" in out
