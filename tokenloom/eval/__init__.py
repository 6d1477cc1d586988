"""Measuring a model rather than serving it: scoring texts (perplexity), agreement between two
engines (same top-1, KL), and the ``bench`` command's timing."""
