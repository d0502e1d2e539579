"""Evaluations that read run directories: LM tasks (:mod:`lapheads.evals.lm`) and the code sandbox."""
