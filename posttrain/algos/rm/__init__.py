"""Reward models: pair losses (`losses`) and the update (`step`) on DPO's pair data (`posttrain.algos.dpo.data`)."""
