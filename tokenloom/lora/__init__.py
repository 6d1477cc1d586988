"""LoRA adapters over a loaded base model: PEFT folders read (peft.py), projections given adapter
slots (layers.py, manager.py), and the batched op that mixes adapters in one step (kernel.py)."""
