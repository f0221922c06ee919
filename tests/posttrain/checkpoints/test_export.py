"""Export is a complete model directory: transformers' tokenizer and model load it offline and reproduce
posttrain's greedy reply; the requested dtype and shard size are honoured; LoRA adapters load with `peft` and
reproduce posttrain's logits; `posttrain convert` writes such a directory."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain.algos.grpo.advantages import advantage_fn
from posttrain.learn.state import merge_model
from posttrain.checkpoints.load import load_hf_dir
from posttrain.checkpoints.export import export_hf, save_tokenizer
from posttrain.model.config import LoRAConfig
from posttrain.generate.sampler import SamplingParams, pad_prompts, sample
from posttrain.model.tokenizer import Tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
V = 264  # the byte tokenizer's 259 ids fit
_QWEN2 = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
_DEEPSEEK = dict(_QWEN2, num_key_value_heads=4, num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                 q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
CHAT = [{"role": "user", "content": "What is 12 + 30?"}]


def _hf_dir(path, model_type="qwen2", kwargs=_QWEN2, seed=0):
    cfg = transformers.AutoConfig.for_model(model_type, **kwargs)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g) if "norm" in name else
                    0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    return path


def _logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.mark.parity
def test_export_loads_in_transformers_and_gives_the_same_greedy_reply(tmp_path):
    pre = load_hf_dir(_hf_dir(tmp_path / "src"))
    tok = Tokenizer.byte_level()
    out = export_hf(pre.config, pre.state, tmp_path / "out", tokenizer=tok)
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json"} <= {p.name for p in out.iterdir()}
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    assert hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == text
    ids = tok.encode(text)
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_id == 258 and gen["pad_token_id"] == tok.pad_id

    prompts, lengths = pad_prompts([ids], tok.pad_id)
    ours = sample(pre.graphdef, pre.state, prompts, lengths, jax.random.key(0), group_size=1,
                  params=SamplingParams(max_new_tokens=16, temperature=0.0), stop_ids=tuple(tok.stop_ids),
                  pad_id=tok.pad_id)
    reply = [int(t) for t in ours.tokens_NxLg[0, : int(ours.lengths_N[0])]]
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    assert len(set(reply)) > 1, "degenerate reply: the comparison would prove little"
    assert theirs == reply


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dtype_and_shards_are_honoured(tmp_path, dtype):
    from safetensors import safe_open

    pre = load_hf_dir(_hf_dir(tmp_path / "src"))
    out = export_hf(pre.config, pre.state, tmp_path / "out", tokenizer=Tokenizer.byte_level(), dtype=dtype,
                    max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and not (out / "model.safetensors").exists()
    total = 0
    for s in shards:
        with safe_open(str(out / s), "np") as f:
            for k in f.keys():
                a = f.get_tensor(k)
                assert a.dtype.name == dtype, k
                total += a.nbytes
    assert total == index["metadata"]["total_size"]
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {oct(os.stat(out / s).st_mode & 0o777) for s in [*shards, "config.json"]}
    assert modes == {oct(0o666 & ~umask)}, modes  # weights as readable as the rest (safetensors writes 0o600)
    written = json.loads((out / "config.json").read_text())
    assert written["dtype"] == written["torch_dtype"] == dtype  # transformers 5 / older readers
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == getattr(torch, dtype)  # transformers reads the dtype config.json declares
    assert load_hf_dir(out).config.param_dtype == dtype  # and so do we, by default
    back = load_hf_dir(out, dtype="float32")  # the exported weights, f32 math on both sides
    tokens = np.random.default_rng(0).integers(0, V, (2, 12))
    theirs = _logits(model.float().eval(), tokens)
    np.testing.assert_allclose(np.asarray(nnx.merge(back.graphdef, back.state)(tokens)[0]), theirs, atol=1e-4)
    with pytest.raises(ValueError, match="export dtype 'int8'"):
        export_hf(pre.config, pre.state, tmp_path / "bad", dtype="int8")


def test_smollm2_tokenizer_exports_for_transformers(tmp_path):
    from helpers import smollm2_path

    from posttrain.checkpoints.gguf import read_gguf_metadata

    tok = Tokenizer.from_gguf_metadata(read_gguf_metadata(smollm2_path()))
    save_tokenizer(tok, tmp_path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    chat = CHAT + [{"role": "assistant", "content": "42"}, {"role": "user", "content": "x\n 1 <|im_end|> é 日本"}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True)
    assert hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == text
    for s in (text, "  12345 + 678 = 13023\n\n\t", "naïve café — ok?"):
        assert hf_tok(s, add_special_tokens=False)["input_ids"] == tok.encode(s), s
    assert (hf_tok.eos_token_id, hf_tok.pad_token_id) == (tok.eos_id, tok.pad_id)


# ------------------------------------------------------------------------------------------------ PEFT
@pytest.mark.parametrize("model_type, kwargs, targets", [
    ("qwen3", dict(_QWEN2, head_dim=24), ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                          "down_proj")),
    # MLA: DeepSeek's interleaved rotary rows in q_b_proj / kv_a_proj; its MLPs are refused (next test)
    ("deepseek_v3", _DEEPSEEK, ("q_a_proj", "q_b_proj", "kv_a_proj", "o_proj")),
])
def test_peft_adapter_reproduces_posttrain_logits(tmp_path, model_type, kwargs, targets):
    peft = pytest.importorskip("peft")
    from posttrain.checkpoints.peft import export_peft

    src = _hf_dir(tmp_path / "base", model_type, kwargs)
    lora = LoRAConfig(rank=4, alpha=8.0, targets=targets)
    pre = load_hf_dir(src, lora=lora)
    rng = np.random.default_rng(1)

    def randomize(path, v):  # fresh adapters have B = 0 and change nothing: draw both factors
        if path[-1].endswith(("_lora_a", "_lora_b")):
            return v.replace(jax.numpy.asarray(0.3 * rng.standard_normal(v.shape), v.dtype))
        return v

    state = nnx.from_flat_state([(p, randomize(p, v)) for p, v in nnx.to_flat_state(pre.state)])
    out = export_peft(pre.config, state, tmp_path / "adapter", base_model=str(src))
    adapter_cfg = json.loads((out / "adapter_config.json").read_text())
    assert (adapter_cfg["r"], adapter_cfg["lora_alpha"], adapter_cfg["peft_type"]) == (4, 8.0, "LORA")
    tokens = np.random.default_rng(2).integers(0, V, (2, 16))
    ours = np.asarray(nnx.merge(pre.graphdef, state)(tokens)[0])
    base = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    without = _logits(base.eval(), tokens)
    assert np.abs(ours - without).max() > 0.5, "adapters too small to test"
    model = peft.PeftModel.from_pretrained(base, out).eval()
    np.testing.assert_allclose(_logits(model, tokens), ours, rtol=0, atol=1e-4)


def test_peft_export_refuses_what_peft_cannot_load(tmp_path):
    from posttrain.checkpoints.peft import export_peft

    pre = load_hf_dir(_hf_dir(tmp_path / "src"))
    with pytest.raises(ValueError, match="no LoRA adapters"):
        export_peft(pre.config, pre.state, tmp_path / "adapter")
    moe = load_hf_dir(_hf_dir(tmp_path / "ds", "deepseek_v3", _DEEPSEEK), lora=LoRAConfig(rank=2))
    with pytest.raises(ValueError, match=r"\['down_proj', 'gate_proj', 'up_proj'\] of an MoE model"):
        export_peft(moe.config, moe.state, tmp_path / "adapter")


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_convert_writes_a_complete_bf16_directory(tmp_path):
    pre = load_hf_dir(_hf_dir(tmp_path / "src"))
    export_hf(pre.config, pre.state, tmp_path / "a", tokenizer=Tokenizer.byte_level())
    env = {**os.environ, "POSTTRAIN_XLA_CACHE": "0", "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, "-m", "posttrain.cli", "convert", f"--model={tmp_path / 'a'}",
                          f"--out={tmp_path / 'b'}", "--dtype=bfloat16", "--max_shard_mb=1"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "b"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert (out / "model.safetensors").exists()  # ~0.1 MB: one shard under 1 MiB
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == \
        Tokenizer.byte_level().apply_chat_template(CHAT, add_generation_prompt=True)
    assert transformers.AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


@pytest.mark.slow  # ~45 s: a one-step LoRA run, then convert its checkpoint
def test_cli_convert_of_a_lora_run_checkpoint(tmp_path):
    from safetensors.numpy import load_file

    env = {**os.environ, "POSTTRAIN_XLA_CACHE": "0", "JAX_PLATFORMS": "cpu"}
    common = ["--config=configs/tiny.py", "--config.lora.rank=4"]
    run = subprocess.run([sys.executable, "-m", "posttrain.cli", "train", *common, f"--workdir={tmp_path / 'run'}",
                          "--config.train.steps=1", "--config.checkpoint.every_steps=1", "--config.eval.at_start=False",
                          "--config.eval.at_end=False", "--noprogress"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    res = subprocess.run([sys.executable, "-m", "posttrain.cli", "convert", *common,
                          f"--checkpoint={tmp_path / 'run'}", f"--out={tmp_path / 'hf'}",
                          f"--peft_out={tmp_path / 'peft'}"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["r"] == 4
    adapters = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    layers = json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"]
    assert sum(n.endswith("lora_A.weight") for n in adapters) == 7 * layers  # q k v o gate up down per layer


def test_convert_of_a_lora_run_checkpoint_in_process(tmp_path):
    """`posttrain convert --checkpoint=RUN --peft_out=...` on a LoRA run's checkpoint after one update: a directory
    transformers loads (tokenizer, model) with the run's policy logits, and the adapter."""
    import types

    from posttrain.rollout import batching

    from posttrain import cli

    from posttrain.recipes import grpo
    from posttrain.algos.grpo import step
    from posttrain.config import to_dict
    from posttrain.config.plan import make_run_plan
    from helpers import tiny_config

    cfg = tiny_config(tmp_path / "run", **{"lora.rank": 4, "optim.lr": 1e-2})
    plan = make_run_plan(cfg)
    rollouter, learner, _ = grpo.build(plan)
    try:
        learner.update(batching.random_batch(0, advantage_fn("grpo"), prompts=4, group_size=4, prompt_len=16, completion_len=8,
                                             vocab_size=320, row_multiple=plan.row_multiple))
        learner.save(rollouter.state_dict(), force=True)
        learner.wait()
        tokens = np.random.default_rng(3).integers(0, 259, (2, 12))
        ours = np.asarray(nnx.merge(learner.graphdef, *learner.policy())(tokens)[0])
        bare = merge_model(learner.graphdef, jax.tree.map(jax.numpy.zeros_like, learner.state.params),
                              learner.state.frozen)  # the base model without the trained adapters
        assert np.abs(np.asarray(bare(tokens)[0]) - ours).max() > 1e-2, "adapters unchanged: the test would prove little"
    finally:
        learner.close()
        rollouter.close()
    flags = types.SimpleNamespace(config=to_dict(cfg), checkpoint=str(tmp_path / "run"), out=str(tmp_path / "hf"),
                                  peft_out=str(tmp_path / "peft"), dtype=None, max_shard_mb=4096, model=None)
    assert cli.cmd_convert(flags) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == \
        Tokenizer.byte_level().apply_chat_template(CHAT, add_generation_prompt=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    np.testing.assert_allclose(_logits(model, tokens), ours, rtol=0, atol=1e-4)  # adapters merged, after the update
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["r"] == 4
