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
# One OpenMP thread by default in every process of the suite: vLLM's CPU worker takes its thread count from it (else
# one per core, spin-waiting for the core the other xdist worker holds, and it leaves its process at that count for
# every later test); the tests' children (tools, vLLM engine processes) start on one torch thread too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

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
_LONGEST_FIRST = [  # seconds each took in one `make test` on the 2-core box while other jobs loaded it (about 3.8x a
    # quiet run; only the order counts); (*): after the ranks forked from a preloaded server (tests/models/_megatron_ref)
    "tests/rollout/test_rollout_vllm.py",  # 659
    "tests/test_learn_recipe.py",  # 603
    "tests/trainer/test_distill_e2e.py",  # 429
    "retool_sft_model",  # 303
    "tests/trainer/test_ppo_e2e.py",  # 257
    "tests/plan/test_plan.py",  # 248
    "tests/tools/test_bench_logprob.py",  # 206
    "tests/trainer/test_bad_inputs.py",  # 191
    "tests/trainer/test_resume.py",  # 185
    "tests/trainer/test_bad_inputs_round2.py",  # 184
    "tests/tools/test_planlab_fit.py",  # 183
    "tests/trainer/test_shared_host.py",  # 173
    "tests/tools/test_bench_update.py",  # 124
    "tests/trainer/test_plan_check.py",  # 120
    "tests/test_golden_run.py",  # 91
    "tests/trainer/test_sft.py",  # ~60 (*)
    "tests/ops/test_logprob_memory.py",  # 71
    "tests/data/test_remote_code.py",  # 63
    "tests/trainer/test_moe_e2e.py",  # 63 (through Ray then; in one process now)
    "tests/trainer/test_async_e2e.py",  # 57
    "tests/models/test_megatron_refusals.py",  # 50
    "tests/data/test_data_synthetic.py",  # 50
    "tests/trainer/test_lora_e2e.py",  # 49
    "tests/tools/test_bench_rollout.py",  # 39
    "tests/models/test_megatron_moe_ep.py",  # ~30 (*)
    "tests/models/test_megatron_pp2.py",  # ~30 (*)
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
