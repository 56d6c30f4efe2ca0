"""Evaluation beyond the loss: HellaSwag and the lm-evaluation-harness adapter."""
