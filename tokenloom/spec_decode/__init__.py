"""Speculative decoding: proposers (n-gram lookup, draft model), verification, acceptance rules."""
