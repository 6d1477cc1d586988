"""What the tests share besides the fixtures in tests/conftest.py: a fake engine, a GGUF writer, HF
references, server and browser harnesses, a random draft model."""
