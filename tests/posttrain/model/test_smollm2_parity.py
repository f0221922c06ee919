"""SmolLM2-135M-Instruct (the default GGUF) against transformers on the same dequantized weights (float32, CPU):
teacher-forced logits on a right-padded batch, and greedy generation token for token.

Both sides get the SAME token ids (our tokenizer; transformers' GGUF tokenizer splits digits differently), and
transformers sees each prompt unpadded (logits) or left-padded with an attention mask (generation).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_gguf_matches_transformers, smollm2_path
from flax import nnx

from posttrain.checkpoints import load_pretrained
from posttrain.checkpoints.gguf import load_gguf

from posttrain.generate.sampler import SamplingParams, pad_prompts, sample

pytestmark = pytest.mark.parity  # scripts/accelerator_check.sh runs these on the accelerator

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

QUESTIONS = ["What is 12 + 35?", "Write a haiku about the sea.", "Name three primary colors.",
             "Explain recursion in one sentence.", "What is the capital of France?", "Give me a synonym for happy.",
             "How many legs does a spider have?", "Translate 'good morning' into Spanish."]


@pytest.fixture(scope="module")
def ours():
    return load_pretrained(smollm2_path())


@pytest.fixture(scope="module")
def theirs():
    path = smollm2_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def smollm():
    return load_gguf(smollm2_path())


def test_default_gguf_matches_transformers(smollm, theirs):
    assert_gguf_matches_transformers(smollm, theirs)


def test_smollm2_hf_config_and_metadata(smollm):
    assert smollm.hf_config == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0, "rope_scaling": None, "tie_word_embeddings": True, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "attention_bias": False, "mlp_bias": False}
    assert smollm.metadata["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert sum(v.size for v in smollm.state_dict.values()) == 134_515_008
    assert all(v.dtype == np.float32 and v.flags.writeable for v in smollm.state_dict.values())
    assert smollm.tokenizer.eos_id == 2 and smollm.tokenizer.vocab_size == 49152


@pytest.fixture(scope="module")
def prompts(ours):
    tok = ours.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True) for q in QUESTIONS]


def test_logits_match_transformers_on_a_right_padded_batch(ours, theirs, prompts):
    batch = prompts[:4]
    assert len({len(p) for p in batch}) > 1, "want prompts of different lengths to exercise padding"
    tokens, lengths = pad_prompts(batch, ours.tokenizer.pad_id)
    segment = (np.arange(tokens.shape[1])[None, :] < lengths[:, None]).astype(np.int32)
    fwd = jax.jit(lambda s, t, seg: nnx.merge(ours.graphdef, s)(t, None, seg)[0])
    logits = np.asarray(fwd(ours.state, jnp.asarray(tokens), jnp.asarray(segment)))
    worst = 0.0
    for i, p in enumerate(batch):
        with torch.no_grad():
            ref = theirs(torch.tensor([p])).logits[0].numpy()
        assert np.isfinite(logits[i]).all()
        worst = max(worst, float(np.abs(logits[i, :len(p)] - ref).max()))
    assert worst <= 1e-3, f"max |logit diff| {worst}"


def _until_stop(tokens, stops):
    out = []
    for t in tokens:
        out.append(int(t))
        if t in stops:
            break
    return out


def test_greedy_generation_matches_transformers(ours, theirs, prompts):
    tok = ours.tokenizer
    n_new = 32
    tokens, lengths = pad_prompts(prompts, tok.pad_id)
    out = sample(ours.graphdef, ours.state, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0),
                 group_size=1, params=SamplingParams(max_new_tokens=n_new, temperature=0.0),
                 stop_ids=tok.stop_ids, pad_id=tok.pad_id)
    ours_tok, ours_len = np.asarray(out.tokens_NxLg), np.asarray(out.lengths_N)

    width = max(map(len, prompts))  # transformers: one left-padded batch with an attention mask
    ids = torch.tensor([[tok.pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        gen = theirs.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n_new,
                              eos_token_id=list(tok.stop_ids), pad_token_id=tok.pad_id)[:, width:].numpy()
    report = []
    for i, p in enumerate(prompts):
        mine = ours_tok[i, :ours_len[i]].tolist()
        ref = _until_stop(gen[i], tok.stop_ids)
        assert mine == _until_stop(ours_tok[i], tok.stop_ids), "sampler lengths disagree with its own tokens"
        if mine == ref:
            continue
        j = next(k for k in range(min(len(mine), len(ref)) + 1) if k == len(mine) or mine[k] != ref[k])
        with torch.no_grad():  # top-2 logit gap (transformers) at the divergence point
            logits = theirs(torch.tensor([p + ref[:j]])).logits[0, -1].numpy()
        top2 = np.sort(logits)[-2:]
        report.append(f"prompt {i}: diverges at new token {j} (ours {mine[j:j + 3]}, transformers "
                      f"{ref[j:j + 3]}), transformers top-2 logit gap {top2[1] - top2[0]:.2e}")
    assert not report, "\n".join(report)
    assert ours_len.max() == n_new and ours_len.min() < n_new, "want both stopped and truncated sequences"
