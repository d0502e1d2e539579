"""Each task's config and the model it describes, apart from its trainer (``lapheads.train.<task>``): the task
table, presets, ``--help`` and a sweep's dry run read these and import no training code."""
