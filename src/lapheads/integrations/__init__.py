"""Adapters to other ecosystems (optional extras): lm-evaluation-harness (:mod:`lapheads.integrations.lm_eval`)."""
