"""Model definitions (Llama family), configs and checkpoint loaders."""
