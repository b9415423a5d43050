"""Models, written once with logical axis names (no mesh names in here): the blocks (`llama`),
attention, the loss, mixture of experts, LoRA, and the Hugging Face families (`families`)."""
