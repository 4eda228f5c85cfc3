"""Run and checkpoint directories another local user could tamper with (issue #66, utils/safefs.py): a link planted in
place of any file rltrain or Hydra writes in a run directory is refused before anything is written (the link's target
is left as it was), by the check before Hydra starts and by each writer on its own; a directory another user owns or
can write is refused naming the owner and mode, as is a resume from one; new directories get no group or other write;
the lock is on the real path, so a second run given a link to a live run's checkpoints is refused; a read-only run
directory is one line and exit 2."""

import os
import stat
import subprocess
import sys

import pytest
import torch

from rltrain.config.entry import CONFIG_DIR, pin_run_dir
from rltrain.utils.checkpoint import check_checkpoint_owner, resume_path, save_checkpoint
from rltrain.utils.plain import save_plain
from rltrain.utils.rundir import (RunDirError, RunDirLocked, claim_checkpoint_dir, lock_run_dir, mark_finished,
                                  prepare_run_dir, run_dir_names)
from rltrain.utils.safefs import UnsafePathError, check_private_dir, make_dirs, write_text

REPO = os.path.dirname(CONFIG_DIR)
ROOT = os.geteuid() == 0
NOBODY = 65534


def _planted(tmp_path, name):
    """A run directory of this user with `name` linked to a file (or directory) of the victim's."""
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    victim = tmp_path / "victim"
    if name in (".hydra", "wandb", "checkpoints", "hf"):
        victim.mkdir()
        (victim / "keep").write_text("victim's")
    else:
        victim.write_text("victim's")
    os.symlink(victim, run / name)
    return run, victim


def _untouched(victim):
    if victim.is_dir():
        return sorted(os.listdir(victim)) == ["keep"] and (victim / "keep").read_text() == "victim's"
    return victim.read_text() == "victim's"


@pytest.mark.parametrize("name", run_dir_names("main"))
def test_a_link_planted_for_any_file_of_a_run_dir_is_refused_before_anything_is_written(tmp_path, name):
    run, victim = _planted(tmp_path, name)
    with pytest.raises(UnsafePathError, match=rf"{run / name} is a symbolic link.*remove it"):
        prepare_run_dir(str(run))
    assert _untouched(victim)


def test_each_writer_refuses_a_link_in_place_of_its_file(tmp_path):
    """Beside the check at the start, every file is opened without following a link (O_NOFOLLOW)."""
    from rltrain.utils.plotting import plot_run
    from rltrain.utils.tracking import JsonlLogger, WandbLogger

    for name, write in [("config.json", lambda run: write_text(str(run / "config.json"), "{}")),
                        ("metrics.jsonl", lambda run: JsonlLogger(str(run))),
                        (".rltrain.lock", lambda run: lock_run_dir(str(run))),
                        ("wandb", lambda run: WandbLogger(str(run), "p", "e", None)),
                        ("reward.png", lambda run: (write_text(str(run / "metrics.jsonl"), '{"step": 1, '
                                                               '"critic/score/mean": 0.5}\n'), plot_run(str(run))))]:
        base = tmp_path / name
        base.mkdir()
        run, victim = _planted(base, name)
        with pytest.raises(UnsafePathError, match="is a symbolic link"):
            write(run)
        assert _untouched(victim), name
    (tmp_path / "fin").mkdir()
    run, victim = _planted(tmp_path / "fin", ".rltrain_finished")
    mark_finished(str(run))  # best effort: it writes nothing through the link
    assert _untouched(victim)


def test_the_entry_point_refuses_a_planted_hydra_dir_before_hydra_writes_into_it(tmp_path):
    run, victim = _planted(tmp_path, ".hydra")
    res = subprocess.run([sys.executable, "-m", "rltrain.main", "--config-name", "grpo_tiny", f"hydra.run.dir={run}"],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"rltrain: {run / '.hydra'} is a symbolic "
                                                                           "link"), res.stderr[-2000:]
    assert _untouched(victim) and sorted(os.listdir(run)) == [".hydra"]


def test_the_recipe_run_dir_is_checked_and_pinned_before_hydra(tmp_path, monkeypatch):
    """`outputs/<experiment>/${now:...}` is resolved once, made and checked, and handed to Hydra as hydra.run.dir."""
    monkeypatch.chdir(tmp_path)
    argv = pin_run_dir(CONFIG_DIR, "grpo_tiny", ["trainer.experiment_name=e1"], "main")
    assert argv[0] == "trainer.experiment_name=e1" and argv[1].startswith(f"hydra.run.dir='{tmp_path}/outputs/e1/")
    made = argv[1].split("=", 1)[1].strip("'")
    assert os.path.isdir(made) and stat.S_IMODE(os.stat(made).st_mode) & 0o022 == 0
    os.chmod(made, 0o777)  # the same directory, given: checked again
    with pytest.raises(UnsafePathError, match="mode 0777: other local users can write it"):
        pin_run_dir(CONFIG_DIR, "grpo_tiny", [f"hydra.run.dir={made}"], "main")


def test_a_directory_others_can_write_or_own_is_refused_naming_owner_and_mode(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    for mode in (0o777, 0o775, 0o757):
        os.chmod(d, mode)
        with pytest.raises(UnsafePathError, match=rf"is owned by \S+ \(uid {os.geteuid()}\), mode {mode:04o}: other "
                                                  rf"local users can write it.*chmod go-w"):
            prepare_run_dir(str(d))
    os.chmod(d, 0o755)
    assert prepare_run_dir(str(d)) == str(d)
    # a parent others can write (they could swap the run directory) unless it is sticky, as /tmp is
    shared = tmp_path / "shared"
    (shared / "run").mkdir(parents=True)
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafePathError, match=rf"lies in {shared}, .*mode 0777"):
        prepare_run_dir(str(shared / "run"))
    os.chmod(shared, 0o1777)
    prepare_run_dir(str(shared / "run"))
    if not ROOT:
        return
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(UnsafePathError, match=rf"owned by \S+ \(uid {NOBODY}\), mode 0755: another local user owns"):
        prepare_run_dir(str(d))
    os.chown(d, 0, 0)
    link = tmp_path / "link"
    os.symlink(d, link)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(UnsafePathError, match=rf"goes through the symbolic link {link}, owned by \S+ \(uid {NOBODY}"):
        check_private_dir(str(link), what="run directory", key="hydra.run.dir")


def test_a_checkpoint_another_user_can_write_or_owns_is_not_resumed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    ckpts = run / "checkpoints"
    path = save_checkpoint(str(ckpts), 3, lambda tmp: save_plain({"step": 3}, os.path.join(tmp, "trainer_state.pt")))
    assert resume_path("auto", str(ckpts), upto=str(run)) == path and resume_path(path, str(ckpts)) == path
    for target in (ckpts, run, os.path.join(path, "trainer_state.pt")):
        mode = stat.S_IMODE(os.stat(target).st_mode)
        os.chmod(target, mode | 0o002)
        for mode_arg in ("auto", path):
            with pytest.raises(UnsafePathError, match=rf"mode {mode | 0o002:04o}"):
                resume_path(mode_arg, str(ckpts), upto=str(run))
        os.chmod(target, mode)
    os.symlink("/etc/hostname", os.path.join(path, "extra.pt"))
    with pytest.raises(UnsafePathError, match="extra.pt, .* \\(a symbolic link\\)"):
        check_checkpoint_owner(path)
    os.remove(os.path.join(path, "extra.pt"))
    if ROOT:
        os.chown(path, NOBODY, NOBODY)
        with pytest.raises(UnsafePathError, match=rf"the checkpoint {path} is owned by \S+ \(uid {NOBODY}\)"):
            resume_path(path, str(ckpts))


def test_new_directories_get_no_group_or_other_write_whatever_the_umask(tmp_path):
    old = os.umask(0o002)
    try:
        make_dirs(str(tmp_path / "a" / "b" / "c"))
        path = save_checkpoint(str(tmp_path / "x" / "ckpt"), 1, lambda tmp: torch.save({}, os.path.join(tmp, "w.pt")))
    finally:
        os.umask(old)
    for p in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c", tmp_path / "x", path,
              os.path.join(path, "w.pt"), os.path.join(path, "manifest.json")):
        assert stat.S_IMODE(os.stat(p).st_mode) & 0o022 == 0, p


HOLD = ("import sys, time\nfrom rltrain.utils.rundir import claim_checkpoint_dir\n"
        "claim_checkpoint_dir(sys.argv[1], sys.argv[2], save=True)\nprint('locked', flush=True)\ntime.sleep(60)\n")


def test_a_link_to_a_live_runs_checkpoints_meets_its_lock(tmp_path):
    live = tmp_path / "live"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(live / "checkpoints"), str(live)],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "locked"
        link = tmp_path / "elsewhere"
        os.symlink(live / "checkpoints", link)
        other = tmp_path / "other"
        other.mkdir()
        with pytest.raises(RunDirLocked, match=rf"the checkpoint directory {link} \({live / 'checkpoints'}\) is in use "
                                               rf"by a live run, pid {proc.pid}"):
            claim_checkpoint_dir(str(link), str(other), save=True)
    finally:
        proc.kill()
        proc.wait()


def test_a_read_only_run_directory_is_one_line_and_exit_2(tmp_path):
    if ROOT:
        ro = "/sys/kernel"  # root writes anywhere but where the kernel refuses
        if os.access(ro, os.W_OK) and not os.path.ismount("/sys"):
            pytest.skip("no directory root cannot write")
    else:
        ro = str(tmp_path / "ro")
        os.mkdir(ro, 0o555)
    with pytest.raises(RunDirError, match=rf"the run directory {ro} is not writable"):
        prepare_run_dir(ro)
    res = subprocess.run([sys.executable, "-m", "rltrain.main", "--config-name", "grpo_tiny", f"hydra.run.dir={ro}"],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert lines[0].startswith(f"rltrain: the run directory {ro} is not writable ("), lines
