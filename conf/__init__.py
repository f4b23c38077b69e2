"""Hydra configs, shipped as the package `hybridflow.conf` (pyproject maps conf/ there; in a source
checkout hybridflow/conf is a link to this folder). `hybridflow.config.load_config` composes
`ppo.yaml` from it with Hydra's `pkg://` search path. This file only makes the folder a package."""
