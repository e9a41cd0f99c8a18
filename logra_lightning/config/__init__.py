"""Start-up checks of a run's configuration: values and combinations (:mod:`~logra_lightning.config.checks`),
``--config`` files (:mod:`~logra_lightning.config.files`), model specs (:mod:`~logra_lightning.config.model_spec`)
and resuming from a checkpoint (:mod:`~logra_lightning.config.resume`). Each failure names the key and value."""
