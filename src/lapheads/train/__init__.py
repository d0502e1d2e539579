"""Training: one module per task (``classify``, ``lm``, ``chat``, ``dino``) on the shared ``runtime``; each is
imported on first use through the task table (``lapheads.tasks``), never by this package."""
