"""Hydra configs, shipped as the package `hybridflow.conf`. `hybridflow.config.load_config` composes
`ppo.yaml` from it with Hydra's `pkg://` search path. This file only makes the folder a package."""
