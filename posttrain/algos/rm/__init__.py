"""Reward models: `losses` (the Bradley-Terry loss with optional reward centering, by name) and `step` (the pair
batch's rewards from `posttrain.model.reward_head` and the update on `learn.step`); the pair data and batching are
DPO's (`posttrain.algos.dpo.data`)."""
