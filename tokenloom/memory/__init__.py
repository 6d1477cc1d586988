"""The process's memory: allocator settings, huge pages for weights, and what the OS reports."""
