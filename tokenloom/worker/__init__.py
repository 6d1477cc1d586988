"""What runs the model for the engine: the model runner (one step's forward pass and sampling), batch
building, prompt logprobs and CUDA graphs. The scheduler-to-runner contract is ``contract.py``."""
