"""LoRA adapters served beside the base model: PEFT directories read (adapter.py), fitted to the
model's fused and sharded linears (layers.py), kept resident by id (pool.py) and applied per
step as segmented low-rank products over the rows that use each adapter (apply.py)."""
