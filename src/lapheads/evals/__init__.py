"""Evaluations that read run directories: LM tasks (:mod:`lapheads.evals.lm`) with their code sandbox
(:mod:`lapheads.sandbox`), DINO's k-NN / linear / segmentation / PCA evaluation (:mod:`lapheads.evals.dino`)
and the probes it uses (:mod:`lapheads.evals.probes`)."""
