"""Shared pytest setup: GPU tests skip cleanly without CUDA, sandbox tests without kernel isolation;
wandb never reaches the network."""

import functools
import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Tiny models run faster on one thread; the Ray workers of end-to-end tests get the same setting.
os.environ.setdefault("RLTRAIN_TORCH_THREADS", "1")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass


@functools.lru_cache(maxsize=1)
def _sandbox_not_isolated() -> str:
    """Why the sandbox refuses to run code on this machine ('' when it isolates it); probed once."""
    from rltrain.sandbox import probe_isolation

    probe = probe_isolation()
    return "" if probe.isolated else probe.isolation


def pytest_runtest_setup(item):
    if item.get_closest_marker("sandbox") and _sandbox_not_isolated():
        pytest.skip(f"the sandbox refuses to run code on this machine ({_sandbox_not_isolated()}): it needs user "
                    "namespaces, Landlock and seccomp; tests/sandbox/test_isolation_required.py covers the refusal")


# `make test` runs the suite on two xdist workers (`-n 2 --dist loadscope`, see the Makefile); each worker is a pytest
# session of its own. A unit of work handed to a worker keeps together the tests that share an expensive fixture: a
# module (a module fixture runs once), or the modules that share an expensive session fixture (_SHARED_SESSION).
# Units start longest first (_LONGEST_FIRST), so no long one is left for the end of one worker while the other
# idles. Serial runs (`pytest tests/x.py`, `-n 0`, `-p no:xdist`) keep the plain order.
# (xdist's own `--dist loadgroup` with xdist_group marks does not group under pytest 9.2: it renames node ids
# through an attribute pytest no longer reads.)
_SHARED_SESSION = {  # retool_sft_model (tests/trainer/conftest.py): the tiny ReTool SFT model, ~20 s to train
    "tests/trainer/test_retool_tiny.py": "retool_sft_model", "tests/trainer/test_vllm_trainer.py": "retool_sft_model"}
_LONGEST_FIRST = [  # seconds each took in a `make test` on the 2-core box, beside the other worker
    "tests/trainer/test_async_e2e.py",  # 163 (beside the ReTool pair: the vLLM module's start-up comes after it)
    "retool_sft_model",  # 278
    "tests/rollout/test_rollout_vllm.py",  # 168
    "tests/trainer/test_mesh.py",  # 126
    "tests/trainer/test_multinode.py",  # 91
    "tests/test_learn_recipe.py",  # 84
    "tests/trainer/test_resume.py",  # 56
    "tests/trainer/test_ppo_e2e.py",  # 52
    "tests/trainer/test_shared_host.py",  # ~50 estimated (two 2-step runs at once, one through Ray)
    "tests/models/test_megatron_moe_ep.py",  # 50
    "tests/trainer/test_moe_e2e.py",  # 47
    "tests/test_golden_run.py",  # 40
    "tests/trainer/test_bad_inputs_round2.py",  # 40
    "tests/trainer/test_bad_inputs.py",  # 37
    "tests/trainer/test_sft.py",  # 36
    "tests/ops/test_logprob_memory.py",  # 33
    "tests/models/test_megatron_pp2.py",  # 33
    "tests/plan/test_plan.py",  # 26
    "tests/trainer/test_plan_check.py",  # 23
    "tests/tools/test_bench_logprob.py",  # 23
    "tests/config/test_config.py",  # 22
    "tests/tools/test_bench_update.py",  # 21
]


def _unit(nodeid: str) -> str:
    """The unit of work (xdist scope) a test belongs to."""
    module = nodeid.split("::", 1)[0]
    return _SHARED_SESSION.get(module, module)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return _unit(nodeid)

    return UnitScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # xdist hands out units in the workers' (identical) collection order
        rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(_unit(item.nodeid), len(rank)))  # stable: the rest keep their order
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_leaked_dist_env():
    """An in-process worker publishes torch.distributed's variables in this process and must take them back
    (LocalWorkerGroup.shutdown). One left behind is inherited by every later subprocess, whose rendezvous then
    meets this process's store on the same port (EADDRINUSE in CI once): the test that leaks fails, named."""
    before = {k: os.environ.get(k) for k in _DIST_ENV}
    yield
    after = {k: os.environ.get(k) for k in _DIST_ENV}
    if after != before:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        pytest.fail(f"the test left torch.distributed variables in the environment: "
                    f"{ {k: v for k, v in after.items() if before[k] != v} }")
