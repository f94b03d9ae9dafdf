"""Offline pipelines: prompt sets, target regeneration, drafter pretraining and evaluation."""
