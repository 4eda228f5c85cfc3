"""Without kernel isolation the sandbox refuses to run code, says why and how to allow it knowingly
(`sandbox.allow_unisolated=true`); the trainer refuses at start (exit 2) and logs the level once.

Unavailability is simulated: the kernel layer switched off, the bindings hidden, or (closest to a real
machine without them) a seccomp filter that makes unshare(2) and the Landlock syscalls fail.
These tests run everywhere, with or without isolation.
"""

import json
import os
import secrets
import subprocess
import sys
import tempfile

import pytest
from hydra import compose, initialize_config_dir

import rltrain.sandbox
import rltrain.sandbox.runner as runner_module
from rltrain.config import register_configs, validate_config
from rltrain.main import CONFIG_DIR, run_entry, run_rl
from rltrain.rollout.multiturn import SandboxToolExecutor, SandboxUnavailableError
from rltrain.sandbox import SandboxPool, run_code
from rltrain.sandbox.runner import _run

NO_ISOLATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "no_isolation.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _writes_a_file(path):
    """A program that, if it ran at all, would leave `path` behind."""
    return f"open({path!r}, 'w').write('ran')\nprint('ran')"


def test_refused_without_the_kernel_layer_and_nothing_runs():
    target = os.path.join(tempfile.gettempdir(), f"rltrain-refused-{secrets.token_hex(6)}")
    r = _run(_writes_a_file(target), timeout_s=5.0, memory_mb=256, cpu_s=None, max_output_bytes=8192,
             max_processes=8, allow_network=False, stdin=None, max_file_bytes=2**20, os_isolation=False, audit=False)
    assert (r.status, r.stdout, r.exit_code, r.isolated) == ("refused", "", None, False)
    assert not os.path.exists(target)  # with neither layer on, only the refusal kept it from running
    assert "no kernel isolation here (kernel isolation disabled)" in r.message
    assert "sandbox.allow_unisolated=true" in r.message and "not a security boundary" in r.message
    assert r.to_tool_output() == "Error: " + r.message


def test_missing_binding_is_refused_naming_the_package(monkeypatch):
    monkeypatch.setattr(runner_module, "_binding_paths", lambda: ())  # as if landlockpy were not installed
    r = run_code("print('ran')")
    assert r.status == "refused" and r.stdout == ""
    assert "landlockpy is unavailable (ModuleNotFoundError" in r.message and "install rltrain's dependencies" in r.message


def _under_no_isolation(code: str) -> dict:
    out = subprocess.run([sys.executable, NO_ISOLATION, sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_machine_without_user_namespaces_or_landlock_refuses_and_allow_unisolated_runs_behind_the_audit_hook():
    target = os.path.join(tempfile.gettempdir(), f"rltrain-refused-{secrets.token_hex(6)}")
    got = _under_no_isolation(
        "import json\nfrom rltrain.sandbox import SandboxPool\n"
        "with SandboxPool(max_workers=1, timeout_s=10.0, memory_mb=256) as strict, \\\n"
        "     SandboxPool(max_workers=1, timeout_s=10.0, memory_mb=256, allow_unisolated=True) as lax:\n"
        f"    r, a, b = strict.run({_writes_a_file(target)!r}), lax.run('print(6 * 7)'), "
        "lax.run(\"open('/etc/passwd').read()\")\n"
        "print(json.dumps([[x.status, x.stdout, x.message, x.isolation, x.isolated, x.to_tool_output()] "
        "for x in (r, a, b)]))")
    (status, stdout, message, isolation, isolated, _), allowed, audited = got
    assert (status, stdout, isolated) == ("refused", "", False)
    assert not os.path.exists(target)
    assert "no user,mnt,pid,ipc,net namespaces (unshare: Operation not permitted" in message
    assert "no Landlock in this kernel" in message and "sandbox.allow_unisolated=true" in message
    assert allowed[:2] == ["ok", "42\n"] and allowed[4] is False and "not isolated" in allowed[3]
    assert audited[0] == "error" and "PermissionError: sandbox: reading '/etc/passwd'" in audited[5]


def _rl_cfg(*overrides):
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="retool_tiny", overrides=list(overrides))


def _model_dir(tmp_path) -> str:
    """A tiny model directory for model.path (the recipe's SFT export is not made here, and the model files are
    checked before the sandbox)."""
    from transformers import Qwen3ForCausalLM

    from rltrain.models.megatron.tiny import tiny_qwen3_config

    path = tmp_path / "model"
    Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=64)).save_pretrained(path)
    return str(path)


class _NoIsolation:
    isolated, isolation = False, "seccomp (not isolated: no Landlock in this kernel)"


def test_tool_executor_and_trainer_start_refuse_without_isolation(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(rltrain.sandbox, "probe_isolation", lambda **kw: _NoIsolation())
    with pytest.raises(SandboxUnavailableError, match="sandbox.allow_unisolated=true"):
        SandboxToolExecutor(max_workers=1)
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg = _rl_cfg(f"data.train_files=[{train}]", f"data.val_files=[{train}]", f"model.path={_model_dir(tmp_path)}")
    capsys.readouterr()  # transformers' progress bar of the save
    with pytest.raises(SystemExit) as exit_info:
        run_entry(cfg, validate_config, run_rl)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rltrain: tool calls are refused: the sandbox has no kernel isolation")
    assert "no Landlock in this kernel" in err[0] and "sandbox.allow_unisolated=true" in err[0]


def test_allow_unisolated_lets_the_run_start_and_the_log_states_the_level_once(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(rltrain.sandbox, "probe_isolation", lambda **kw: _NoIsolation())
    started = []
    monkeypatch.setattr("rltrain.trainer.ppo.run_from_config", lambda cfg: started.append(cfg))
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg = _rl_cfg(f"data.train_files=[{train}]", f"data.val_files=[{train}]", f"model.path={_model_dir(tmp_path)}",
                  "sandbox.allow_unisolated=true")
    run_entry(cfg, validate_config, run_rl)
    assert len(started) == 1
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "sandbox" in ln]
    assert lines == [f"rltrain: tool calls run in the sandbox with isolation: {_NoIsolation.isolation}"]
    executor = SandboxToolExecutor(max_workers=1, allow_unisolated=True)
    try:
        assert executor.isolation == _NoIsolation.isolation
    finally:
        executor.close()


def test_pool_validates_the_new_arguments():
    with SandboxPool(max_workers=1, allow_exec=False, allow_unisolated=False) as pool:
        assert pool.run("print(1)").status in ("ok", "refused")


READ_PASSWD_IN_SUBINTERPRETER = """
import {module} as si
si.run_string(si.create(), "print(open('/etc/passwd').read()[:40])")
print("ran")
"""


@pytest.mark.parametrize("module", ["_xxsubinterpreters", "_testcapi"])
def test_sub_interpreters_are_refused_where_the_hook_is_the_only_guard(module):
    """allow_unisolated without the kernel layer: the hook is all there is, so it must not be escapable."""
    code = READ_PASSWD_IN_SUBINTERPRETER.format(module=module)
    if module == "_testcapi":
        code = "import _testcapi\n_testcapi.run_in_subinterp(\"print(open('/etc/passwd').read()[:40])\")\n"
    r = _run(code, timeout_s=10.0, memory_mb=256, cpu_s=None, max_output_bytes=8192, max_processes=8,
             allow_network=False, stdin=None, max_file_bytes=2**20, os_isolation=False, allow_unisolated=True)
    assert not r.isolated
    assert r.status == "error" and "root:" not in r.stdout and "ran" not in r.stdout
    assert "sandbox:" in r.to_tool_output() and "not allowed" in r.to_tool_output(), r.stderr[-500:]
