"""A run: its start (config, devices, validation), its directory, and the training loop."""
