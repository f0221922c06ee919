"""`posttrain rm` end to end on configs/rm_tiny.py (3 steps): held-out accuracy from chance (zero head: ties) to
>= 7/8, its export in `<workdir>/reward_model` holding the trained weights (the held-out sequences' margins are the
recipe's own: the packed pair layout and single sequences agree); an export read by transformers'
`AutoModelForSequenceClassification` (LlamaForSequenceClassification, one label) gives our scores (<= 1e-4, f32);
config and CLI errors are one line."""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.config import ConfigError
from posttrain.config.rm import default_rm_config, rm_config_from_dict

sys.path.insert(0, "configs")
import rm_tiny  # noqa: E402


def padded(seqs, pad_id):
    L = max(map(len, seqs))
    tokens = np.full((len(seqs), L), pad_id, np.int32)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = s
    return tokens, np.asarray([len(s) for s in seqs], np.int32)


def test_rm_tiny_trains_and_exports(tmp_path):
    from posttrain.algos.dpo import data
    from posttrain.checkpoints.reward_model import load_reward_model
    from posttrain.model.tokenizer import Tokenizer
    from posttrain.recipes import rm

    c = rm_tiny.get_config()
    c.train.steps, c.checkpoint.every_steps = 3, 100
    summary = rm.train(rm.make_rm_plan(rm_config_from_dict(c), workdir=str(tmp_path)), progress=False)
    start, end = summary["eval_start"], summary["eval_end"]
    assert (start["rm/accuracy"], start["rm/margin"], start["rm/length_baseline_accuracy"]) == (0.5, 0.0, 0.5)
    assert end["rm/accuracy"] >= 0.875 and end["rm/margin"] > 0 and end["rm/pairs"] == 8.0, end
    assert end["rm/vs_length"] == end["rm/accuracy"] - end["rm/length_baseline_accuracy"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["rm/loss"] for r in rows if "rm/loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0]

    tok = Tokenizer.byte_level()
    pairs = data.encode_pairs(tok, [(r["id"], r) for r in c.rm.eval_examples], data.PairSettings())
    seqs = [np.concatenate([p.prompt, reply]) for p in pairs for reply in (p.chosen, p.rejected)]
    cfg, graphdef, state, loaded_tok = load_reward_model(tmp_path)  # the run directory: its reward_model/
    assert summary["export"] == str(tmp_path / "reward_model") and loaded_tok.stop_ids == tok.stop_ids
    score = jax.jit(lambda st, t, n: nnx.merge(graphdef, st).score_sequences(t, n))
    ours = np.asarray(score(state, *map(jnp.asarray, padded(seqs, tok.pad_id))))
    # single sequences give the packed pair layout's held-out margin: the export holds the trained weights
    np.testing.assert_allclose((ours[0::2] - ours[1::2]).mean(), end["rm/margin"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_transformers_reads_the_export_and_scores_the_same(tmp_path, pad_is_eos):
    """A random tiny-dense reward model (head weights spread over [-1, 1]) exported and read back by transformers'
    AutoModelForSequenceClassification: LlamaForSequenceClassification, one label, our scores (<= 1e-4, f32) on
    a batch the exported AutoTokenizer pads (padding=True), also for a tokenizer whose pad is its end-of-turn
    token, as SmolLM2's: the export's tokenizer padded with <|im_end|> while the config's pad_token_id was 0, so
    transformers pooled a padding position of every shorter sequence (a trained SmolLM2 reward model: 0.71 off)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from helpers import pad_is_eos_tokenizer, random_model

    from posttrain.checkpoints.reward_model import export_reward_model
    from posttrain.infra import mesh as mesh_lib
    from posttrain.model.reward_head import with_head
    from posttrain.model.tokenizer import Tokenizer

    tok = pad_is_eos_tokenizer() if pad_is_eos else Tokenizer.byte_level()
    cfg, graphdef, state = random_model("tiny-dense", seed=2, std=0.05, vocab_size=320, dtype="float32",
                                        param_dtype="float32")
    mesh = mesh_lib.make_mesh({"fsdp": 1}, jax.devices()[:1])
    rm_def, rm_state = with_head(cfg, graphdef, state, mesh, mesh_lib.RULES, score=np.linspace(-1, 1, cfg.d_model))
    export_reward_model(cfg, rm_state, tmp_path, tokenizer=tok)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
             for q, a in (("What is 2 + 3?", "5"), ("Hi", "Hello there!"), ("Name a colour.", "Blue, or red."))]
    seqs = [tok.encode(t) for t in texts]
    tokens, lengths = padded(seqs, tok.pad_id)
    ours = np.asarray(jax.jit(lambda st, t, n: nnx.merge(rm_def, st).score_sequences(t, n))(
        rm_state, jnp.asarray(tokens), jnp.asarray(lengths)))
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, torch_dtype=torch.float32)
    assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.num_labels == 1
    assert hf.config.pad_token_id not in tok.stop_ids
    assert (hf.config.pad_token_id == tok.pad_id) is not pad_is_eos
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tok.pad_token_id == hf.config.pad_token_id
    enc = hf_tok(texts, padding=True, add_special_tokens=False, return_tensors="pt")
    assert [row[row_mask.bool()].tolist() for row, row_mask in zip(enc["input_ids"], enc["attention_mask"])] == seqs
    with torch.no_grad():
        theirs = hf(**enc).logits[:, 0].numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
    assert np.ptp(ours) > 1e-2  # scores that differ: the comparison can fail


def test_config_errors_are_one_clear_line(tmp_path):
    c = default_rm_config()
    with pytest.raises(ConfigError, match="rm: no training data"):
        rm_config_from_dict(c)
    c = rm_tiny.get_config()
    c.rm.center_coef = -1.0
    with pytest.raises((ConfigError, ValueError), match=r"center_coef \(a finite number >= 0\)"):
        rm_config_from_dict(c)
    c = rm_tiny.get_config()
    c.lora.rank = 4
    with pytest.raises(ConfigError, match="lora.rank=4: a reward model trains"):
        rm_config_from_dict(c)
    (tmp_path / "empty").mkdir()
    c = default_rm_config()
    c.rm.from_archive = str(tmp_path / "empty")
    with pytest.raises(ConfigError, match="rm.from_archive=.*no episode archive"):
        rm_config_from_dict(c)


def test_cli_rm_help_and_archive_error(tmp_path, capsys):
    from absl import flags

    from posttrain import cli

    try:
        cli.main(["posttrain", "rm", "--help"])
    except SystemExit:
        pass
    finally:
        flags.FLAGS.unparse_flags()
    out = capsys.readouterr().out
    assert "posttrain rm     --config=configs/rm_tiny.py" in out and "--from_archive" in out and "--workdir" in out
    (tmp_path / "run").mkdir()
    try:
        rc = cli.main(["posttrain", "rm", f"--from_archive={tmp_path / 'run'}", "--noprogress"])
        err = capsys.readouterr().err
    except SystemExit as e:
        rc, err = 2, str(e.code)
    finally:
        flags.FLAGS.unparse_flags()
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "rm.from_archive=" in err, err


def _numpy_length_baseline(train, held):
    """Reference: per-pair accuracy of 'the longer reply wins' and 'the shorter wins' by plain loops; the direction
    better on the training pairs (longer on a tie) applied to the held-out pairs."""
    def acc(pairs, sign):
        return [1.0 if sign * (len(c) - len(r)) > 0 else 0.5 if len(c) == len(r) else 0.0 for c, r in pairs]
    sign = 1 if np.mean(acc(train, 1)) >= np.mean(acc(train, -1)) else -1
    return sign, np.asarray(acc(held, sign))


@pytest.mark.parametrize("shorter_wins", [False, True])
def test_length_baseline_direction_is_chosen_on_the_training_pairs(shorter_wins):
    from types import SimpleNamespace

    from posttrain.recipes import rm

    rng = np.random.default_rng(3)
    def pairs(n):
        lens = np.sort(rng.integers(1, 9, size=(n, 2)), axis=1)  # chosen the shorter (or equal) one
        lens[: n // 4] = lens[: n // 4, ::-1]  # a quarter the other way
        if not shorter_wins:
            lens = lens[:, ::-1]
        return [SimpleNamespace(chosen=np.zeros(a), rejected=np.zeros(b)) for a, b in lens]
    train, held = pairs(40), pairs(25)
    sign, ref = _numpy_length_baseline([(p.chosen, p.rejected) for p in train],
                                       [(p.chosen, p.rejected) for p in held])
    assert rm.length_direction(train) == sign == (-1 if shorter_wins else 1)
    np.testing.assert_array_equal(rm.length_accuracy(held, sign), ref)
    acc = rng.integers(0, 2, size=len(held)).astype(float)
    m = rm.held_out_metrics(acc, np.zeros(len(held)), ref, sign)
    assert m["rm/length_baseline_direction"] == sign and m["rm/length_baseline_accuracy"] == pytest.approx(ref.mean())
    assert m["rm/vs_length"] == pytest.approx(acc.mean() - ref.mean())
    assert m["rm/vs_length_lo"] <= m["rm/vs_length"] <= m["rm/vs_length_hi"]


def test_paired_difference_interval_matches_a_numpy_paired_bootstrap():
    from posttrain.learn.offline_loop import paired_difference_interval

    rng = np.random.default_rng(0)
    a = (rng.random(60) < 0.8).astype(float)
    b = np.where(rng.random(60) < 0.9, a, 1 - a)  # correlated with a: pairing narrows the interval
    idx = rng.integers(0, 60, size=(20000, 60))  # reference: the same rows resampled for a and b
    ref = np.percentile(a[idx].mean(1) - b[idx].mean(1), [2.5, 97.5])
    lo, hi = paired_difference_interval(a, b)
    np.testing.assert_allclose([lo, hi], ref, atol=0.02)
    unpaired = np.percentile(a[idx].mean(1) - b[rng.integers(0, 60, size=(20000, 60))].mean(1), [2.5, 97.5])
    assert hi - lo < 0.8 * (unpaired[1] - unpaired[0])
    assert paired_difference_interval(np.ones(3), np.zeros(3)) == (1.0, 1.0)
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference_interval(np.ones(3), np.ones(4))
