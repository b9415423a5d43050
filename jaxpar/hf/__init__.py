"""The Hugging Face bridge: reading Hugging Face directories and Hub snapshots onto a mesh,
importing them as jaxpar runs (`convert`), writing runs back out (`export`), and the base weights
of `train.init_from` and of a LoRA run."""
