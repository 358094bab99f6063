"""Checkpoint files: atomic saves, retention, ``last.ckpt`` as a link, a full disk, a kill mid-save,
and the resume identity check."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from lightning_fasync.config import ConfigError, load_config
from lightning_fasync.runtime.checkpoints import (
    CheckpointError,
    CheckpointFiles,
    check_hparams,
    check_resume,
    find_last,
    run_identity,
)
from lightning_fasync.pipeline.datasource import ListDataSource
from lightning_fasync.pipeline.state import PipelineError


def saver(value):
    return lambda path: torch.save({"value": value}, path)


def load(path):
    return torch.load(path, weights_only=True)["value"]


def test_saves_are_atomic_linked_and_pruned(tmp_path):
    files = CheckpointFiles(str(tmp_path / "checkpoints"), keep_last=2)
    for step in range(4):
        path = files.save(step, saver(step))
        assert path == files.path(step) and load(path) == step
        assert files.last() == os.path.realpath(path)
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert names == ["last.ckpt", "step-000002.ckpt", "step-000003.ckpt"]  # no temporary left, two kept
    link = tmp_path / "checkpoints" / "last.ckpt"
    assert os.path.islink(link) and os.readlink(link) == "step-000003.ckpt"  # a link, not a second copy
    assert load(link) == 3 and find_last(str(tmp_path)) == files.last()
    # null keeps every checkpoint
    keep_all = CheckpointFiles(str(tmp_path / "all"), keep_last=None)
    for step in range(5):
        keep_all.save(step, saver(step))
    assert len(keep_all.steps()) == 5
    # A rank that does not write (DDP rank > 0) calls write (a collective) and touches no file.
    calls = []
    assert CheckpointFiles(str(tmp_path / "other"), 2).save(0, calls.append, is_writer=False)
    assert len(calls) == 1 and not os.path.exists(tmp_path / "other")


def dir_saver(value):
    """A distributed checkpoint's shape: a directory of parts and a metadata file."""
    def write(path):
        os.makedirs(path)
        for rank in range(2):
            torch.save({"value": value, "rank": rank}, os.path.join(path, f"__{rank}_0.distcp"))
        torch.save({"value": value}, os.path.join(path, "meta.pt"))
    return write


def test_directory_checkpoints_are_renamed_linked_and_pruned_with_their_hf_directories(tmp_path):
    files = CheckpointFiles(str(tmp_path / "checkpoints"), keep_last=2)
    for step in range(3):
        path = files.save(step, dir_saver(step))
        os.makedirs(files.hf_path(step))  # trainer.save_hf's directory beside it
        assert os.path.isdir(path) and load(os.path.join(path, "meta.pt")) == step
        assert files.last() == os.path.realpath(path)
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert names == ["last.ckpt", "step-000001.ckpt", "step-000001.hf", "step-000002.ckpt", "step-000002.hf"]
    assert sorted(os.listdir(files.last())) == ["__0_0.distcp", "__1_0.distcp", "meta.pt"]
    # The same step saved again (a resumed run reaching it) replaces the directory whole.
    files.save(2, dir_saver(22))
    assert load(os.path.join(files.path(2), "meta.pt")) == 22 and not any(".old-" in n or ".tmp-" in n for n in
                                                                         os.listdir(tmp_path / "checkpoints"))
    # A failed write leaves no partial directory and the previous checkpoint linked.
    def fails(path):
        dir_saver(3)(path)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError, match="step-3 checkpoint .* No space left"):
        files.save(3, fails)
    assert files.last() == os.path.realpath(files.path(2))
    assert not any(n.startswith(".") for n in os.listdir(tmp_path / "checkpoints"))


def test_trainer_processes_share_the_trainer_cores_with_one_thread_count():
    from lightning_fasync.fleet.resources import ResourcePlan, trainer_share

    plan = ResourcePlan([0, 1, 2, 3], [[4, 5]])
    shares = [trainer_share(plan, r, 2) for r in range(2)]
    assert [s.trainer_cores for s in shares] == [[0, 1], [2, 3]] and {s.trainer_threads for s in shares} == {2}
    assert all(s.replica_cores == [[4, 5]] for s in shares)
    # Fewer cores than processes: every process on all of them, one thread each (never 1 and 2).
    one = [trainer_share(ResourcePlan([0], [[1]]), r, 2) for r in range(2)]
    assert [s.trainer_cores for s in one] == [[0], [0]] and {s.trainer_threads for s in one} == {1}


def test_pointer_file_where_links_are_unavailable(tmp_path, monkeypatch):
    def no_links(*args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "symlink", no_links)
    files = CheckpointFiles(str(tmp_path), keep_last=3)
    files.save(0, saver(0))
    files.save(1, saver(1))
    assert not os.path.exists(tmp_path / "last.ckpt")
    assert (tmp_path / "last.ckpt.path").read_text().strip() == "step-000001.ckpt"
    assert files.last() == str(tmp_path / "step-000001.ckpt") and load(files.last()) == 1


def test_a_link_or_pointer_that_leaves_the_directory_is_refused(tmp_path):
    ckpts, outside = tmp_path / "ckpts", tmp_path / "elsewhere.ckpt"
    ckpts.mkdir()
    outside.write_text("x")
    files = CheckpointFiles(str(ckpts), keep_last=3)
    (ckpts / "last.ckpt.path").write_text("../elsewhere.ckpt\n")
    with pytest.raises(CheckpointError, match=r"names '\.\./elsewhere\.ckpt', which is not a step checkpoint's file name"):
        files.last()
    (ckpts / "last.ckpt.path").unlink()
    os.symlink(str(outside), str(ckpts / "last.ckpt"))
    with pytest.raises(CheckpointError, match=r"last\.ckpt points to .*elsewhere\.ckpt, outside"):
        files.last()
    os.unlink(ckpts / "last.ckpt")
    files.save(0, saver(0))  # its own link is followed
    assert files.last() == str(ckpts / "step-000000.ckpt")


def test_a_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path):
    files = CheckpointFiles(str(tmp_path), keep_last=3)
    files.save(0, saver(0))

    def full_disk(path):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    with pytest.raises(CheckpointError, match=r"step-000001\.ckpt failed: No space left on device \(ENOSPC\)\. "
                                              r"The previous checkpoint .*step-000000\.ckpt is intact"):
        files.save(1, full_disk)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step-000000.ckpt"]  # the partial file is gone
    assert load(files.last()) == 0


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    # A child saves step 0, then dies (SIGKILL) in the middle of writing step 1.
    marker = tmp_path / "writing"
    script = textwrap.dedent(f"""
        import os, time, torch
        from lightning_fasync.runtime.checkpoints import CheckpointFiles
        files = CheckpointFiles({str(tmp_path / "checkpoints")!r}, keep_last=3)
        files.save(0, lambda p: torch.save({{"value": 0}}, p))
        def slow(path):
            with open(path, "wb") as f:
                f.write(b"x" * 1000)
                f.flush()
                open({str(marker)!r}, "w").close()
                time.sleep(60)
        files.save(1, slow)
    """)
    child = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert child.poll() is None and time.monotonic() < deadline, "the child never started the second save"
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    files = CheckpointFiles(str(tmp_path / "checkpoints"), keep_last=3)
    assert [s for s, _ in files.steps()] == [0] and load(files.last()) == 0
    assert find_last(str(tmp_path)) == files.last()


def test_resume_refuses_an_accounting_change_and_warns_about_the_rest():
    saved = run_identity(load_config({}))
    with pytest.raises(ConfigError, match=r"^`data_source\.num_prompts_per_step` is 8 but the checkpoint ck was saved "
                                          r"with 64; .*exactly-once"):
        check_resume(saved, run_identity(load_config({"data_source": {"num_prompts_per_step": 8}})), "ck")
    with pytest.raises(ConfigError, match="`fully_async.stale_steps`"):
        check_resume(saved, run_identity(load_config({"fully_async": {"stale_steps": 2.0}})), "ck")
    with pytest.warns(UserWarning, match=r"rollout\.temperature: 1\.0 -> 0\.9"):
        check_resume(saved, run_identity(load_config({"rollout": {"temperature": 0.9}})), "ck")
    with pytest.warns(UserWarning, match=r"model\.lr: 0\.001 -> 0\.0005"):
        check_hparams({"lr": 1e-3, "model": "tiny"}, {"lr": 5e-4, "model": "tiny"}, "ck")
    check_resume(None, saved, "ck")  # an older checkpoint without identity is not checked
    # A source given as `data_sources` is the one compared, under the same keys.
    listed = run_identity(load_config({"data_sources": [{"num_prompts_per_step": 8}]}))
    assert listed["config"]["data_source.num_prompts_per_step"] == 8 and "data_sources" not in listed["config"]
    with pytest.raises(ConfigError, match=r"^`data_source\.num_prompts_per_step` is 8 but the checkpoint ck was saved "
                                          r"with 64"):
        check_resume(saved, listed, "ck")
    check_resume(run_identity(load_config({"data_source": {"num_prompts_per_step": 8}})), listed, "ck")
    small, big = torch.nn.Linear(2, 2), torch.nn.Linear(2, 3)
    with pytest.raises(ConfigError, match="`model.model` builds a policy whose shape differs"):
        check_resume(run_identity(load_config({}), small), run_identity(load_config({}), big), "ck")


def test_datasource_refuses_a_state_saved_with_another_order():
    state = ListDataSource([[1], [2], [3]], seed=5).state_dict()
    ListDataSource([[1], [2], [3]], seed=5).load_state_dict(state)
    with pytest.raises(PipelineError, match=r"saved with seed=5 and is now built with seed=6 \(`data_source.seed`\)"):
        ListDataSource([[1], [2], [3]], seed=6).load_state_dict(state)
