"""`model.trust_remote_code` (issue #66): a tokenizer or model directory that ships Python (auto_map) is refused with
one line, never asked about on stdin, its code never run, through the trainer's command line with stdin open and
answering "y"; and every from_pretrained of rltrain/ and tools/ says trust_remote_code (transformers asks when it is
left out)."""

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

from rltrain.main import CONFIG_DIR
from rltrain.models.presets import ModelNotFoundError, hf_config_for

REPO = pathlib.Path(CONFIG_DIR).parent


def _custom_code_dir(d, marker, kind):
    """A tokenizer or a model config (`kind`) whose auto_map names a module that, imported, creates `marker`."""
    d.mkdir()
    (d / "custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                 "from transformers import PreTrainedTokenizer, PretrainedConfig\n"
                                 "class CustomTokenizer(PreTrainedTokenizer):\n    pass\n"
                                 "class CustomConfig(PretrainedConfig):\n    model_type = 'custom'\n")
    if kind == "tokenizer":
        (d / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["custom.CustomTokenizer",
                                                                                            None]},
                                                             "tokenizer_class": "CustomTokenizer"}))
    else:
        (d / "config.json").write_text(json.dumps({"auto_map": {"AutoConfig": "custom.CustomConfig"},
                                                   "model_type": "custom"}))
    return d


def test_a_tokenizer_with_custom_code_is_refused_with_stdin_open_and_never_runs(tmp_path):
    marker = tmp_path / "MARKER"
    tok = _custom_code_dir(tmp_path / "tok", marker, "tokenizer")
    cmd = [sys.executable, "-m", "rltrain.main", "--config-name", "grpo_tiny", f"model.tokenizer={tok}",
           "trainer.use_ray=false", f"hydra.run.dir={tmp_path / 'run'}"]
    res = subprocess.run(cmd, cwd=REPO, input="y\ny\n", capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("rltrain:")]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert lines[0] == (f"rltrain: tokenizer '{tok}' (config key `model.tokenizer`, or `model.path` when model.tokenizer "
                        "is null) ships its own Python code (auto_map), which rltrain runs only with "
                        "model.trust_remote_code=true: set it only for code you have read and trust, or use one "
                        "without custom code")
    assert "[y/N]" not in res.stdout + res.stderr and not marker.exists()


def test_a_model_config_with_custom_code_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "MARKER"
    model = _custom_code_dir(tmp_path / "model", marker, "model")
    with pytest.raises(ModelNotFoundError, match=rf"model.path='{model}' ships its own Python code \(auto_map\)"):
        hf_config_for(path=str(model), builtin=None)
    assert not marker.exists()


def test_every_from_pretrained_in_rltrain_and_tools_says_trust_remote_code():
    missing = []
    for path in sorted([*REPO.glob("rltrain/**/*.py"), *REPO.glob("tools/**/*.py")]):
        text = path.read_text()
        if "from_pretrained" not in text:
            continue
        rel = path.relative_to(REPO).as_posix()
        for node in ast.walk(ast.parse(text, rel)):
            f = node.func if isinstance(node, ast.Call) else None
            if not (isinstance(f, ast.Attribute) and f.attr == "from_pretrained"):
                continue
            # rltrain's own tokenizer (a JSON vocabulary) and PEFT's adapter loader (an adapter rltrain exported): no code
            if ast.unparse(f.value) in ("CharTokenizer", "cls", "PeftModel"):
                continue
            if not any(k.arg == "trust_remote_code" for k in node.keywords):
                missing.append(f"{rel}:{node.lineno}")
    assert missing == []
