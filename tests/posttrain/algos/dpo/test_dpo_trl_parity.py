"""DPO against TRL: our sigmoid and IPO losses (and TRL's metric names) equal `trl.DPOTrainer`'s on the same tiny
model, pairs and beta. The torch side is built from our own weights (`checkpoints.export.export_hf`: a random
tiny-dense policy and a different random reference, float32); TRL tokenizes the string pairs itself (its EOS
added) and its `DataCollatorForPreference` batches them; TRL's loss is `DPOTrainer.compute_loss` on that batch
(the public Trainer hook; no optimizer step); our loss is `algos.dpo.step`'s on the SAME token ids (TRL's
prompt_ids / chosen_ids / rejected_ids): `sequence_logprobs` under each set of weights, then `pair_terms` (the
loss_fn's per-pair terms; loss_fn itself is tested against NumPy in test_dpo_loss.py)."""
import jax
import numpy as np
import pytest
from helpers import random_model

from posttrain.algos.dpo import data
from posttrain.algos.dpo import step as dpo_step
from posttrain.checkpoints.export import export_hf
from posttrain.learn import optim
from posttrain.learn.state import create_train_state, merge_model
from posttrain.model.tokenizer import Tokenizer

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

RECORDS = [{"prompt": "What is 2 + 3?", "chosen": "2 + 3 = 5.", "rejected": "2 + 3 = 6."},
           {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Seven, or so"},
           {"prompt": "Hi", "chosen": "Hello!", "rejected": "Go away."},
           {"prompt": "Count to three, please.", "chosen": "1 2 3", "rejected": "3 2 1 0"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(tokenizer, policy (graphdef, state), reference state, policy HF dir, reference HF dir)."""
    tok = Tokenizer.byte_level()
    out = {}
    for name, seed in (("policy", 0), ("reference", 1)):
        cfg, graphdef, weights = random_model("tiny-dense", seed=seed, std=0.05, vocab_size=320, dtype="float32",
                                              param_dtype="float32")
        d = tmp_path_factory.mktemp(name)
        export_hf(cfg, weights, d, tokenizer=tok)
        tx = optim.make_optimizer("adamw", lr=1e-3, schedule="constant").tx
        out[name] = (*create_train_state(graphdef, weights, tx, jax.random.key(0)), d)
    return tok, out


@pytest.fixture(scope="module")
def trainer(models):
    """One `trl.DPOTrainer` on the exported policy and reference (float32: bf16 off, which TRL would otherwise
    turn on for the reference's forward on a CPU with bf16 support) and its collated batch of all RECORDS."""
    _, out = models
    load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    args = trl.DPOConfig(output_dir=str(out["policy"][2] / "trl"), beta=0.1, loss_type=["sigmoid"], report_to=[],
                         per_device_train_batch_size=len(RECORDS), use_cpu=True, bf16=False,
                         precompute_ref_log_probs=False, max_length=None)
    trainer = trl.DPOTrainer(model=load(out["policy"][2]), ref_model=load(out["reference"][2]), args=args,
                             train_dataset=datasets.Dataset.from_list(RECORDS),
                             processing_class=transformers.AutoTokenizer.from_pretrained(str(out["policy"][2])))
    rows = [trainer.train_dataset[i] for i in range(len(RECORDS))]
    return trainer, rows, trainer.data_collator(rows)


def trl_loss(trainer, loss, beta):
    """(TRL's loss, its logged metrics) of the batch with `loss` and `beta` (the trainer's own attributes, which
    `DPOTrainer.compute_loss` reads: one trainer serves every case)."""
    trainer, _, batch = trainer
    trainer.beta, trainer.loss_types, trainer.loss_weights = beta, [loss], [1.0]
    trainer._metrics["eval"].clear()  # the model is in eval mode: compute_loss logs under "eval"
    with torch.no_grad():
        value = trainer.compute_loss(trainer.model, batch)
    return float(value), {k: float(np.mean(v)) for k, v in trainer._metrics["eval"].items()}


@pytest.fixture(scope="module")
def our_logps(models, trainer):
    """{"policy" | "reference": (s_N, tokens_N)}: `algos.dpo.step.sequence_logprobs` (the step's own scoring: the
    packed two-branch layout, chunked logprobs) of TRL's token ids under each set of weights (one compiled program)."""
    tok, out = models
    pairs = [data.Pair(str(i), np.asarray(r["prompt_ids"], np.int32), np.asarray(r["chosen_ids"], np.int32),
                       np.asarray(r["rejected_ids"], np.int32)) for i, r in enumerate(trainer[1])]
    batch = jax.tree.map(jax.numpy.asarray, data.make_batch(pairs, *data.regions(pairs), tok.pad_id, len(pairs)))
    graphdef = out["policy"][0]
    fn = jax.jit(lambda p, f, b: dpo_step.sequence_logprobs(merge_model(graphdef, p, f), b,
                                                            dpo_step.StepOptions(logprob_chunk=32)))
    return {name: fn(out[name][1].params, out[name][1].frozen, batch) for name in ("policy", "reference")}


def our_loss(our_logps, loss, beta):
    """(our loss, our metrics): the mean over the pairs of `dpo_step.pair_terms`, as the step's loss_fn takes it."""
    (s_N, tokens_N), (ref_N, _) = our_logps["policy"], our_logps["reference"]
    terms = dpo_step.pair_terms(s_N, ref_N, tokens_N, dpo_step.StepOptions(loss=loss, beta=beta))
    return float(terms["dpo/loss"].mean()), {k: float(v.mean()) for k, v in terms.items()}


@pytest.mark.parametrize("loss,beta", [("sigmoid", 0.1), ("sigmoid", 2.0), ("ipo", 0.5)])
def test_dpo_loss_equals_trl_dpo_trainer(trainer, our_logps, loss, beta):
    theirs, their_metrics = trl_loss(trainer, loss, beta)
    rows = trainer[1]
    ours, our_metrics = our_loss(our_logps, loss, beta)
    assert all(len(r["chosen_ids"]) and len(r["rejected_ids"]) for r in rows)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    if loss == "sigmoid":  # not log 2: the reference differs from the policy, so the comparison can fail
        assert abs(ours - np.log(2.0)) > 1e-3
    # TRL's rewards/* are beta x the summed log-ratios under every loss; ours follow the loss's own log-probs
    # (IPO: per-token means), so the metrics are compared for the sigmoid loss
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")[:4 * (loss == "sigmoid")]:
        np.testing.assert_allclose(our_metrics[key], their_metrics[key], rtol=1e-4, atol=1e-4, err_msg=key)
