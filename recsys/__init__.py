"""DLRM training over the disaggregated embedding tier: model, trainer, config, CLI."""
