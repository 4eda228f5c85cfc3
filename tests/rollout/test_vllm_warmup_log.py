"""vLLM's chat-template warm-up traceback of an engine built with skip_tokenizer_init=True is dropped at its logger
(rollout/vllm_args.quiet_tokenizer_warmup); every other record of that logger, tracebacks included, is kept. No vLLM
engine is started: the records are made as vLLM's renderers/base.py makes them."""

import importlib.util
import logging
import os

import pytest

from rltrain.rollout.vllm_args import NO_TOKENIZER, WARMUP_LOGGER, quiet_tokenizer_warmup


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def _warn_failed_warmup(logger, err: Exception) -> None:
    try:
        raise err
    except Exception:
        logger.warning("Chat template warmup failed", exc_info=True)  # vLLM's call, renderers/base.py


def test_only_the_no_tokenizer_warmup_traceback_is_dropped():
    logger = logging.getLogger(WARMUP_LOGGER)
    seen = _Records()
    logger.addHandler(seen)
    before = list(logger.filters)
    logger.filters[:] = []  # as in a fresh process
    try:
        quiet_tokenizer_warmup()
        quiet_tokenizer_warmup()  # a second engine: still one filter
        assert len(logger.filters) == 1
        _warn_failed_warmup(logger, ValueError("Tokenizer not available when `skip_tokenizer_init=True`"))
        _warn_failed_warmup(logger, ValueError("Tokenizer not available when skip_tokenizer_init=True"))
        _warn_failed_warmup(logger, RuntimeError("the chat template does not parse"))
        logger.warning("Chat template warmup failed")
        kept = [(r.getMessage(), r.exc_info and str(r.exc_info[1])) for r in seen.records]
        assert kept == [("Chat template warmup failed", "the chat template does not parse"),
                        ("Chat template warmup failed", None)]
    finally:
        logger.removeHandler(seen)
        logger.filters[:] = before


def test_the_filtered_message_and_logger_are_vllms():
    """The constants name what the installed vLLM raises and where it logs it (its source, read without importing
    vLLM)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    path = os.path.join(spec.submodule_search_locations[0], *WARMUP_LOGGER.split(".")[1:]) + ".py"
    with open(path) as f:
        source = f.read()
    assert f'raise ValueError("{NO_TOKENIZER}")' in source
    assert 'logger.warning("Chat template warmup failed", exc_info=True)' in source
    assert "logger = init_logger(__name__)" in source
